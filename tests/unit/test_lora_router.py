"""The router's LoRA logic in process: the router code is real, the workers are FAKES
(scripted gRPC servicers on loopback that record what they were asked). A request under
an adapter reaches both workers of its pair with the adapter's name, the workers that
lack it load it first (counted), an admin load reaches every worker or, when one refuses
the folder, none; unload reaches every holder."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import grpc
import pytest
from prometheus_client import REGISTRY

from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2_grpc as wpb_grpc
from services.errors import InvalidRequest, ModelNotFound
from services.registry.records import WorkerRecord
from services.router.config import RouterConfig
from services.router.router import RouterBackend
from services.router.view import FixedView
from tests.unit.test_pair_run import (
    FakeDecodeWorker,
    FakePrefillWorker,
    FakeTokenizer,
    collect,
    record,
    request,
)


@dataclass
class FakeAdapterWorker(FakeDecodeWorker):
    """A FAKE worker's DecodeService that also keeps a table of LoRA adapters; refuses
    folders named in `refuse`."""

    adapters: dict[str, str] = field(default_factory=dict)
    loads: list[tuple[str, str]] = field(default_factory=list)
    unloads: list[str] = field(default_factory=list)
    refuse: tuple[str, ...] = ()

    async def LoadLoraAdapter(self, req: pb.LoadLoraAdapterRequest,
                              context: grpc.aio.ServicerContext
                              ) -> pb.LoadLoraAdapterResponse:
        if req.lora_path in self.refuse:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lora_path: bad folder")
        self.loads.append((req.lora_name, req.lora_path))
        self.adapters[req.lora_name] = req.lora_path
        return pb.LoadLoraAdapterResponse(message="loaded")

    async def UnloadLoraAdapter(self, req: pb.UnloadLoraAdapterRequest,
                                context: grpc.aio.ServicerContext
                                ) -> pb.UnloadLoraAdapterResponse:
        if self.adapters.pop(req.lora_name, None) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "not loaded")
        self.unloads.append(req.lora_name)
        return pb.UnloadLoraAdapterResponse(message="unloaded")


@dataclass
class Workers:
    prefill: FakePrefillWorker
    decodes: dict[str, FakeAdapterWorker]  # by worker id; p1's own DecodeService too
    backend: RouterBackend


def loads(reason: str) -> float:
    return REGISTRY.get_sample_value("pdserve_router_lora_loads_total",
                                     {"reason": reason}) or 0.0


@pytest.fixture
async def workers() -> AsyncIterator[Workers]:
    """One prefill worker p1 that holds `sql`, one decode worker d1 that does not."""
    servers = []
    prefill, p1_decode = FakePrefillWorker(), FakeAdapterWorker(adapters={"sql": "/a/sql"})
    d1 = FakeAdapterWorker(refuse=("/a/bad",))
    addresses = {}
    for worker_id, servicers in (("p1", (prefill, p1_decode)), ("d1", (d1,))):
        server = grpc.aio.server()
        for servicer in servicers:
            if isinstance(servicer, FakePrefillWorker):
                wpb_grpc.add_PrefillServiceServicer_to_server(servicer, server)
            else:
                wpb_grpc.add_DecodeServiceServicer_to_server(servicer, server)
        addresses[worker_id] = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        servers.append(server)
    records: list[WorkerRecord] = [
        replace(record("p1", "prefill", addresses["p1"]), loras=(("sql", "/a/sql"),)),
        record("d1", "decode", addresses["d1"])]
    backend = RouterBackend(RouterConfig(), FixedView(records), FakeTokenizer(), "")  # type: ignore[arg-type]
    await backend.start(0)
    try:
        yield Workers(prefill, {"p1": p1_decode, "d1": d1}, backend)
    finally:
        await backend.close()
        for server in servers:
            await server.stop(None)


async def test_a_request_loads_its_adapter_where_missing_and_carries_it(
        workers: Workers) -> None:
    before = loads("request")
    for _ in range(2):
        tokens, last = await collect(workers.backend.generate(replace(request(), lora="sql")))
        assert last.finished and tokens
    d1 = workers.decodes["d1"]
    assert d1.loads == [("sql", "/a/sql")]  # once: the second request found it there
    assert workers.decodes["p1"].loads == []
    assert loads("request") == before + 1
    assert [r.lora_name for r in workers.prefill.requests] == ["sql", "sql"]
    assert [r.lora_name for r in d1.requests] == ["sql", "sql"]
    tokens, _ = await collect(workers.backend.generate(request()))
    assert workers.prefill.requests[-1].lora_name == d1.requests[-1].lora_name == ""


async def test_an_unknown_adapter_is_not_found(workers: Workers) -> None:
    with pytest.raises(ModelNotFound, match="'chat' is not served here"):
        await collect(workers.backend.generate(replace(request(), lora="chat")))
    assert workers.prefill.requests == []


async def test_admin_load_reaches_every_worker_or_none(workers: Workers) -> None:
    before = loads("admin")
    await workers.backend.load_adapter("poet", "/a/poet")
    assert all(w.loads == [("poet", "/a/poet")] for w in workers.decodes.values())
    assert loads("admin") == before + 2
    assert workers.backend.adapter_paths() == {"poet": "/a/poet", "sql": "/a/sql"}
    with pytest.raises(InvalidRequest, match="already loaded"):
        await workers.backend.load_adapter("poet", "/a/poet")
    # d1 refuses the folder: p1, which took it, unloads it again.
    with pytest.raises(InvalidRequest, match="bad folder"):
        await workers.backend.load_adapter("bad", "/a/bad")
    assert workers.decodes["p1"].unloads == ["bad"]
    assert "bad" not in workers.backend.adapter_paths()


async def test_unload_reaches_every_holder_then_not_found(workers: Workers) -> None:
    await workers.backend.load_adapter("poet", "/a/poet")
    await workers.backend.unload_adapter("poet")
    assert all(w.unloads == ["poet"] for w in workers.decodes.values())
    assert "poet" not in workers.backend.adapter_paths()
    with pytest.raises(ModelNotFound):
        await workers.backend.unload_adapter("poet")
    with pytest.raises(ModelNotFound):
        await collect(workers.backend.generate(replace(request(), lora="poet")))
    await workers.backend.unload_adapter("sql")  # named at start: p1 held it
    assert workers.decodes["p1"].unloads == ["poet", "sql"]

