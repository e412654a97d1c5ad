"""Greedy streams through a server with a fault injected mid-answer, and what every
client received, token by token."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from services.api.client import PdserveClient, build_request
from tests.helpers.servers import ServerProcess


async def reference(colocated: ServerProcess, prompts: list[list[int]], n: int) -> list[list[int]]:
    async with PdserveClient(colocated.target) as client:
        return [(await client.generate(token_ids=ids, temperature=0.0, max_tokens=n,
                                       ignore_eos=True)).token_ids for ids in prompts]


async def streams_through(router: ServerProcess, prompts: list[list[int]], n: int,
                          fault: Callable[[], None], after_tokens: int = 8
                          ) -> list[tuple[list[int], int]]:
    """Greedy streams of `prompts` through `router`; `fault()` runs once every stream has
    received `after_tokens` tokens. Each stream's tokens as the client got them, and how
    many times its request moved.

    The streams start longest prompt first, each once the one before has its first
    token: started together, a short prompt's answer runs ahead by the long one's prefill
    and, on a slow machine, ends before the fault. Started this way they decode side by
    side, and the fault lands while every one of them still streams (checked)."""
    got: list[list[int]] = [[] for _ in prompts]
    moved = [0] * len(prompts)
    first = [asyncio.Event() for _ in prompts]
    enough = [asyncio.Event() for _ in prompts]
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))

    async def one(i: int, after: asyncio.Event | None) -> None:
        if after is not None:
            await after.wait()
        async with PdserveClient(router.target) as client:
            request = build_request(token_ids=prompts[i], temperature=0.0, max_tokens=n,
                                    ignore_eos=True)
            async for r in client.call(request, timeout=300):
                if r.HasField("chunk"):
                    got[i] += r.chunk.token_ids
                    first[i].set()
                    if len(got[i]) >= after_tokens:
                        enough[i].set()
                else:
                    moved[i] = r.final.migrations

    async def inject() -> None:
        await asyncio.gather(*(e.wait() for e in enough))
        done = [i for i in range(len(prompts)) if len(got[i]) >= n]
        assert not done, (f"streams {done} had all {n} tokens before the fault: "
                          "ask for longer answers")
        fault()

    await asyncio.gather(inject(), *(one(i, first[order[k - 1]] if k else None)
                                     for k, i in enumerate(order)))
    return list(zip(got, moved, strict=True))
