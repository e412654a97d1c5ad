"""pdserve across hosts that are not loopback: every service in a network namespace of its
own on a bridge (services/bench/netns.py), bound to its host's address, with the
credentials of a multi-host deployment (services/bench/netns_stack.py).

- Every listening socket is on its host's address or that host's own loopback, none on a
  wildcard address; on the host's address only the ports its services advertise (and the
  torch transport's rendezvous store), everything internal to a worker on loopback.
- Greedy parity: through the router, with the links rate-limited (and delayed where the
  kernel has netem), each answer is token-identical to vLLM's offline reference, with
  the KV shipped over gRPC to one decode worker and over torch.distributed to the other.
- A partition: a decode worker cut from every other host mid-stream, for a few seconds.
  The client gets the undisturbed answer token for token (or one clear status), a
  request sent during the cut is served by what is reachable, and afterwards nothing
  stays staged, in flight or leased past its bound.
- Two more cuts, compared the same way: prefill from the decode host receiving its KV,
  during the transfer; the router from Redis, mid-stream.
- A latency burst as the chaos benchmark injects it (its fault plan; every packet a host
  receives held 100 ms, without netem): streams equal the undisturbed run, a request sent
  at its start is answered within 5 s, nothing stays held after it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import warnings
from typing import Any

import grpc
import pytest
import redis

from services.api.client import build_request
from services.bench.faults import Fault, FaultPlan
from services.bench.netns import Fabric
from services.bench.netns_stack import (
    GRPC_PORT,
    KV_PORT,
    METRICS_PORT,
    REDIS_PORT,
    NetFaults,
    NetStack,
)
from services.registry.registry import Registry
from services.registry.signing import RecordSigner
from tests.conftest import REFERENCE_MAX_TOKENS
from tests.helpers.prompts import prompt_of_length
from tests.netns.conftest import CLIENT_LEASE_S, HOSTS, KV_LEASE_S

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.engine]

DECODERS = ("decode-grpc", "decode-torch")
DELAY_MS = 1.0  # each way, per link: a datacenter's hop
RATE_MBIT = 1000  # per link, each way
CUT_S = 5.0


def kv_bytes(stack: NetStack) -> dict[str, float]:
    return {h: stack.metrics(h).get("pdserve_kv_transfer_bytes_total", 0.0) for h in DECODERS}


async def _advertised(stack: NetStack, fabric: Fabric) -> dict[str, dict[int, str]]:
    """The ports each host's services tell others about, by host: the router's and
    Redis's as configured, the workers' as their records in Redis say."""
    ports = {"redis": {REDIS_PORT: "redis-server"},
             "router": {GRPC_PORT: "router gRPC", METRICS_PORT: "router metrics"}}
    registry = Registry.from_url(stack.redis_url,
                                 signer=RecordSigner(stack.cluster_secret.encode()))
    try:
        records = await registry.workers()
    finally:
        await registry.close()
    by_addr = {fabric.addr(h): h for h in HOSTS}
    for w in records:
        # Every address a record carries ("address", "kv_address", ...), and the metrics.
        named = {f.name: getattr(w, f.name) for f in dataclasses.fields(w)
                 if f.name.endswith("address")}
        for what, address in (*named.items(), ("metrics", w.metrics_target)):
            if isinstance(address, str) and address:
                host, _, port = address.rpartition(":")
                assert host in by_addr, f"{w.worker_id} advertises {what} at {address}"
                ports.setdefault(by_addr[host], {})[int(port)] = f"{w.worker_id} {what}"
    return ports


async def test_only_advertised_ports_listen_on_a_hosts_address(netstack: NetStack,
                                                               fabric: Fabric) -> None:
    # On each host, what listens on its address is what its services advertise (gRPC,
    # metrics, the KV receiver), plus on the torch transport's host the pair groups'
    # rendezvous store (its port is told to senders over the KV control stream).
    # Everything else (vLLM's engine: its gloo groups, ZMQ sockets; the KV events relay)
    # is internal to one worker and listens on that host's loopback only.
    advertised = await _advertised(netstack, fabric)
    for host in HOSTS:
        addr = fabric.addr(host)
        sockets = fabric.sockets(host)
        wildcard = [str(s) for s in sockets if s.ip in ("0.0.0.0", "*", "::")]
        assert not wildcard, f"{host} listens on every interface: {wildcard}"
        elsewhere = [str(s) for s in sockets if s.ip not in (addr, "127.0.0.1", "::1")]
        assert not elsewhere, f"{host} listens beyond its address {addr}: {elsewhere}"
        ours = advertised.get(host, {})
        on_addr = {s.port: s for s in sockets if s.ip == addr}
        missing = [f"{what} ({port})" for port, what in ours.items() if port not in on_addr]
        assert not missing, f"{host}: nothing listens on {addr} for {missing}"
        extra = [s for port, s in on_addr.items() if port not in ours]
        if host == "decode-torch":  # the rendezvous store, in the KV receiver's process
            receiver = on_addr[KV_PORT].pid
            stores = [s for s in extra if s.pid == receiver]
            assert len(stores) == 1, f"{host}: expected one rendezvous store: {extra}"
            extra.remove(stores[0])
        assert not extra, (f"{host}: internal sockets on its address {addr} (they belong "
                           f"on loopback): {', '.join(map(str, extra))}")
        if host in DECODERS:
            assert KV_PORT in ours, f"{host} advertises no KV receiver: {ours}"


async def test_greedy_parity_across_hosts(netstack: NetStack, fabric: Fabric,
                                          offline_reference: list[dict[str, Any]]) -> None:
    delayed = [fabric.shape(h, DELAY_MS, RATE_MBIT) for h in HOSTS]
    if not all(delayed):
        warnings.warn("this kernel has no netem qdisc: the links are rate-limited (tbf) "
                      "but not delayed", stacklevel=1)
    before = kv_bytes(netstack)
    async with netstack.client() as client:
        # Twice over: round_robin alternates the decode workers, and each prompt then
        # reaches both transports.
        for round_ in range(2):
            for ref in offline_reference:
                result = await client.generate(
                    token_ids=ref["prompt_token_ids"], temperature=0.0,
                    max_tokens=REFERENCE_MAX_TOKENS, timeout=300)
                assert result.token_ids == ref["token_ids"], (
                    f"round {round_}, {len(ref['prompt_token_ids'])}-token prompt")
    shipped = {h: n - before[h] for h, n in kv_bytes(netstack).items()}
    assert all(n > 0 for n in shipped.values()), f"KV bytes received per transport: {shipped}"


async def _stream(stack: NetStack, ids: list[int], n: int, got: list[int],
                  started: asyncio.Event | None = None, after: int = 0
                  ) -> grpc.StatusCode | int:
    """A greedy stream into `got`; sets `started` once `after` tokens arrived. How many
    times the request moved when it ended with its final message, else the status it
    ended with."""
    request = build_request(token_ids=ids, temperature=0.0, max_tokens=n, ignore_eos=True)
    async with stack.client() as client:
        try:
            async for r in client.call(request, timeout=300):
                if r.HasField("chunk"):
                    got += r.chunk.token_ids
                    if started is not None and len(got) >= after:
                        started.set()
                elif r.HasField("final"):
                    return int(r.final.migrations)
        except grpc.aio.AioRpcError as e:
            assert e.details(), "a failed stream must say why"
            return e.code()
        finally:
            if started is not None:
                started.set()
    raise AssertionError("the stream ended without a final message or a status")


def _decode_requests(stack: NetStack) -> dict[str, float]:
    counts = stack.labelled("router", "pdserve_router_worker_requests_total", "worker")
    return {h: counts.get(h, 0.0) for h in DECODERS}


async def test_decode_partitioned_mid_stream(netstack: NetStack, fabric: Fabric,
                                             tokenizer) -> None:  # type: ignore[no-untyped-def]
    n = 96
    streamed = prompt_of_length(tokenizer, 300, salt="partition: the stream")
    arriving = prompt_of_length(tokenizer, 200, salt="partition: sent during the cut")
    # The undisturbed run: the same requests through the same stack, before any cut.
    want_streamed: list[int] = []
    want_arriving: list[int] = []
    assert await _stream(netstack, streamed, n, want_streamed) == 0
    assert await _stream(netstack, arriving, 16, want_arriving) == 0

    before = _decode_requests(netstack)
    got: list[int] = []
    started = asyncio.Event()
    stream = asyncio.create_task(_stream(netstack, streamed, n, got, started, after=8))
    await asyncio.wait_for(started.wait(), 120)
    assert len(got) < n, "the stream ended before the cut: ask for a longer answer"
    serving = [h for h, c in _decode_requests(netstack).items() if c > before[h]]
    assert len(serving) == 1, f"decode requests per worker moved by {serving}"
    victim = serving[0]
    other = next(h for h in DECODERS if h != victim)

    fabric.cut(victim)
    cut_at = time.monotonic()
    try:
        # A request that arrives during the partition goes to what is reachable.
        await asyncio.sleep(1.0)
        during: list[int] = []
        code = await asyncio.wait_for(_stream(netstack, arriving, 16, during), 120)
        assert not isinstance(code, grpc.StatusCode) and during == want_arriving, (code, during)
        await asyncio.sleep(max(0.0, CUT_S - (time.monotonic() - cut_at)))
    finally:
        fabric.restore(victim)

    code = await asyncio.wait_for(stream, 300)
    if not isinstance(code, grpc.StatusCode):
        assert got == want_streamed, "the stream's tokens differ from the undisturbed run"
        assert code >= 1, "the stream finished on the cut worker: the cut came too late"
    else:  # one clear status, and only tokens of the undisturbed answer before it
        assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED,
                        grpc.StatusCode.DEADLINE_EXCEEDED), code
        assert got == want_streamed[:len(got)]
    # The surviving decode worker took over (or took the request that arrived).
    assert _decode_requests(netstack)[other] > before[other]

    await _nothing_left(netstack)

    # The cut worker is back in rotation and serves again.
    async def served_by_victim() -> bool:
        seen = _decode_requests(netstack)[victim]
        done: list[int] = []
        assert not isinstance(await _stream(netstack, arriving, 16, done), grpc.StatusCode)
        assert done == want_arriving
        return _decode_requests(netstack)[victim] > seen

    for _ in range(4):  # round_robin: within two requests once it is back in the view
        if await served_by_victim():
            break
        await asyncio.sleep(1.0)
    else:
        raise AssertionError(f"{victim} did not serve again after the partition")


async def _nothing_left(stack: NetStack) -> None:
    """Nothing stays staged, in flight or leased past its bound."""
    by = time.monotonic() + max(KV_LEASE_S, CLIENT_LEASE_S) + 15
    state: dict[str, Any] = {}
    while True:
        state = {h: stack.metrics(h).get("pdserve_kv_staged_transfers") for h in DECODERS}
        state["router inflight"] = stack.metrics("router").get("pdserve_router_inflight")
        state["client leases"] = _leases(stack)
        if all(v == 0 for v in state.values()) or time.monotonic() > by:
            break
        await asyncio.sleep(0.5)
    assert all(v == 0 for v in state.values()), state


def _leases(stack: NetStack) -> int:
    """Client slots held in Redis (lapsed ones are not counted)."""
    client = redis.Redis.from_url(stack.redis_url, socket_timeout=2)
    try:
        now_ms = int(time.time() * 1000)
        return sum(int(client.zcount(key, now_ms, "+inf"))
                   for key in client.scan_iter(match="pdserve:lease:*"))
    finally:
        client.close()



SLOW_MBIT = 200  # the prefill host's link while its KV must still be in flight at the cut
IN_FLIGHT_BYTES = 4 << 20  # received by a decode host: the transfer has begun


async def _receiver_of_transfer(fabric: Fabric, stream: asyncio.Task[Any],
                                before: dict[str, int], timeout: float = 120.0) -> str:
    """The decode host whose link has carried IN_FLIGHT_BYTES since `before`: the KV
    transfer to it is under way."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert not stream.done(), "the request ended before its KV transfer was seen"
        for host in DECODERS:
            if fabric.link_bytes(host)[1] - before[host] >= IN_FLIGHT_BYTES:
                return host
        await asyncio.sleep(0.02)
    raise TimeoutError(f"no KV transfer seen within {timeout:.0f} s")


async def test_prefill_decode_cut_during_a_transfer(netstack: NetStack, fabric: Fabric,
                                                    tokenizer) -> None:  # type: ignore[no-untyped-def]
    # A long prompt over a slowed prefill link, so that its KV takes seconds to cross;
    # once a decode host has received the first megabytes, the link between the two
    # (only) is cut for CUT_S. The undisturbed runs come after, on a whole network: run
    # first, the same prompt would find its KV cached and little left to transfer.
    n = 24
    long_prompt = prompt_of_length(tokenizer, 1500, salt="cut in transfer: the long one")
    arriving = prompt_of_length(tokenizer, 200, salt="cut in transfer: sent during the cut")
    fabric.shape("prefill", DELAY_MS, SLOW_MBIT)
    try:
        before = {h: fabric.link_bytes(h)[1] for h in DECODERS}
        got: list[int] = []
        stream = asyncio.create_task(_stream(netstack, long_prompt, n, got))
        receiver = await _receiver_of_transfer(fabric, stream, before)
        fabric.cut_between("prefill", receiver)
        cut_at = time.monotonic()
        try:
            # A request sent during the cut is served by what is reachable.
            during: list[int] = []
            code_during = await asyncio.wait_for(
                _stream(netstack, arriving, 16, during), 120)
            during_s = time.monotonic() - cut_at
            await asyncio.sleep(max(0.0, CUT_S - (time.monotonic() - cut_at)))
        finally:
            fabric.restore_between("prefill", receiver)
        code = await asyncio.wait_for(stream, 300)
    finally:
        fabric.shape("prefill", DELAY_MS, RATE_MBIT)

    want: list[int] = []
    want_arriving: list[int] = []
    assert await _stream(netstack, long_prompt, n, want) == 0
    assert await _stream(netstack, arriving, 16, want_arriving) == 0
    assert not isinstance(code_during, grpc.StatusCode), code_during
    assert during == want_arriving, "the request sent during the cut differs"
    print(f"cut prefill<->{receiver} in transfer: request sent during it served in "
          f"{during_s:.1f} s")
    if not isinstance(code, grpc.StatusCode):
        assert got == want, "the stream's tokens differ from the undisturbed run"
    else:  # one clear status, and only tokens of the undisturbed answer before it
        assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED,
                        grpc.StatusCode.DEADLINE_EXCEEDED), code
        assert got == want[:len(got)]
    await _nothing_left(netstack)


async def test_router_cut_from_redis(netstack: NetStack, fabric: Fabric,
                                     tokenizer) -> None:  # type: ignore[no-untyped-def]
    # The router loses Redis (its view of the workers, the client leases) for CUT_S
    # mid-stream: it keeps serving from its last view, and picks Redis up again after.
    n = 64
    streamed = prompt_of_length(tokenizer, 300, salt="redis cut: the stream")
    arriving = prompt_of_length(tokenizer, 200, salt="redis cut: sent during the cut")
    got: list[int] = []
    started = asyncio.Event()
    stream = asyncio.create_task(_stream(netstack, streamed, n, got, started, after=4))
    await asyncio.wait_for(started.wait(), 120)
    assert len(got) < n, "the stream ended before the cut: ask for a longer answer"
    fabric.cut_between("router", "redis")
    cut_at = time.monotonic()
    try:
        await asyncio.sleep(1.0)
        during: list[int] = []
        code_during = await asyncio.wait_for(_stream(netstack, arriving, 16, during), 120)
        during_s = time.monotonic() - cut_at
        await asyncio.sleep(max(0.0, CUT_S - (time.monotonic() - cut_at)))
    finally:
        fabric.restore_between("router", "redis")
    code = await asyncio.wait_for(stream, 300)

    want: list[int] = []
    want_arriving: list[int] = []
    assert await _stream(netstack, streamed, n, want) == 0
    assert await _stream(netstack, arriving, 16, want_arriving) == 0
    assert not isinstance(code, grpc.StatusCode), f"the stream ended with {code}"
    assert got == want, "the stream's tokens differ from the undisturbed run"
    await _nothing_left(netstack)
    assert not isinstance(code_during, grpc.StatusCode), (
        f"a request sent while the router could not reach Redis ended with {code_during}")
    assert during == want_arriving, "the request sent during the cut differs"
    # Sent 1 s into the cut: answered within 5 s of the cut's start, with a second for
    # the answer's own tokens.
    assert during_s <= 5.0 + 1.0, f"served {during_s:.1f} s after the cut began"


async def test_a_latency_burst_of_the_chaos_run(netstack: NetStack, fabric: Fabric,
                                                tokenizer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The chaos benchmark's own fault, end to end: its `FaultPlan` injects a latency
    # burst through `NetFaults` (every packet a host receives held 100 ms, by userspace
    # delayers, not netem) while streams run; each stream equals the undisturbed run, a
    # request sent at the burst's start is answered within 5 s, and nothing stays held.
    n = 40
    prompts = [prompt_of_length(tokenizer, 200, salt=f"latency burst {k}") for k in range(3)]
    probe_ids = prompt_of_length(tokenizer, 60, salt="latency burst: the probe")
    wants = []
    for ids in prompts:
        want: list[int] = []
        assert await _stream(netstack, ids, n, want) == 0
        wants.append(want)

    async def probe() -> float:
        got: list[int] = []
        first = asyncio.Event()
        task = asyncio.create_task(_stream(netstack, probe_ids, 4, got, first, after=1))
        await first.wait()
        at = time.time()
        code = await task
        if isinstance(code, grpc.StatusCode) or len(got) != 4:
            raise RuntimeError(f"the probe ended with {code} after {len(got)} tokens")
        return at

    async def connect_s() -> float:
        """A TCP handshake with the router from this machine: its SYN enters the router's
        host, where the burst holds it."""
        t = time.perf_counter()
        _, writer = await asyncio.open_connection(fabric.addr("router"), GRPC_PORT)
        took = time.perf_counter() - t
        writer.close()
        return took

    plan = FaultPlan(netstack, [Fault.parse("latency@1:8:100")], recover_timeout_s=60,
                     probe=probe, network=NetFaults(fabric, tmp_path))
    before = await connect_s()
    faulting = asyncio.create_task(plan.run(time.time()))
    await asyncio.sleep(2.0)
    during = await connect_s()
    results: list[tuple[int, grpc.StatusCode | int, list[int]]] = []
    while not faulting.done() or not results:
        k = len(results) % len(prompts)
        got: list[int] = []
        results.append((k, await _stream(netstack, prompts[k], n, got), got))
    [event] = await faulting
    if "NetfilterQueue" in event.error:
        pytest.skip(event.error)
    assert not event.error, event.error
    assert event.target == "every host's link"
    assert event.resumed_at is not None and event.resumed_at - event.at >= 8.0
    assert before < 0.05 and during >= 0.1, (before, during)
    for k, code, got in results:
        if isinstance(code, grpc.StatusCode):
            assert got == wants[k][:len(got)], f"stream {k} ({code}) differs before its end"
        else:
            assert got == wants[k], f"stream {k} differs from the undisturbed run"
    assert event.served_s is not None and event.served_s <= 5.0, event
    assert event.recovered_at is not None, "a worker did not heartbeat after the burst"
    await _nothing_left(netstack)
