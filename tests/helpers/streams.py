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
    many times its request moved."""
    got: list[list[int]] = [[] for _ in prompts]
    moved = [0] * len(prompts)
    enough = [asyncio.Event() for _ in prompts]

    async def one(i: int) -> None:
        async with PdserveClient(router.target) as client:
            request = build_request(token_ids=prompts[i], temperature=0.0, max_tokens=n,
                                    ignore_eos=True)
            async for r in client.call(request, timeout=300):
                if r.HasField("chunk"):
                    got[i] += r.chunk.token_ids
                    if len(got[i]) >= after_tokens:
                        enough[i].set()
                else:
                    moved[i] = r.final.migrations

    async def inject() -> None:
        await asyncio.gather(*(e.wait() for e in enough))
        fault()

    await asyncio.gather(inject(), *(one(i) for i in range(len(prompts))))
    return list(zip(got, moved, strict=True))
