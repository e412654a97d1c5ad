"""The receiving side of the `nixl` transport: the Nixl method of a KV receiver, and the
receiver that serves it (plus gRPC Push and, where on, same-host Shm).

Control goes over one bidirectional gRPC stream per transfer on the receiver's one
server, so internal mTLS decides who may ask for a region; the payload goes by NIXL
one-sided WRITEs straight into the receiver's registered arena, layer by layer:

    sender                                   receiver
    HEADER {sender, spec, checksum,    ->    checks layout, epoch, id (as every transport)
            nixl: {agent}}                   takes a region of its registered arena
                                       <-    SEGMENT {nixl: {agent, metadata, addr, nbytes,
                                                     device, mem, tag}, nbytes}
    WRITE layer i, notification "tag:i" ~~>  (UCX: lands in the region, then the note)
    LAYER {layers: [[i, nbytes, sum]]} ->    waits for the note from the agent the HEADER
                                             named, verifies the checksum over the region
    END {chunks, nbytes}               ->    COMPLETE
                                       <-    ACK

Integrity: the sender checksums each layer over the bytes it wrote and announces it on
the authenticated stream; the receiver verifies it over what landed. A one-sided WRITE
is not self-checking: UCX moves bytes over transports (TCP, RDMA, CMA) that pdserve
neither authenticates nor sees, the notification only says a WRITE finished, and a late
WRITE of an abandoned transfer could land in a reused region. The tag is fresh per
transfer, so notes of another or an earlier transfer never count.

A full arena answers RESOURCE_EXHAUSTED before any byte moved, and the sender sends that
transfer over gRPC instead. Any other failure ends the stream with a status, as Shm does.
"""

from __future__ import annotations

import base64
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import torch

from services.kv.fingerprint import PeerIdentity
from services.kv.transport import checksum, cuda_ipc, frames
from services.kv.transport.frames import ControlFrame, FrameError, FrameKind
from services.kv.transport.grpc_receiver import GrpcKVReceiver
from services.kv.transport.nixl_agent import Agent, Arena, agent
from services.kv.transport.spec import TransportConfig
from services.kv.transport.staging import (
    NoStagingMemory,
    Staged,
    StagingTable,
    TransferFault,
    stream_failure,
)

logger = logging.getLogger(__name__)

MAX_AGENT_NAME = 128


class NixlInbound:
    """Serves Nixl streams into `table`, staging in regions of `arena`."""

    def __init__(self, receiver: GrpcKVReceiver, owner: Agent, arena: Arena) -> None:
        self.table: StagingTable = receiver.table
        self.config = receiver.config
        self.first_frame = receiver.first_frame
        self.agent, self.arena = owner, arena
        self.metadata = base64.b64encode(owner.metadata()).decode()  # after registering

    def handle(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        st: Staged | None = None
        peer, tag = "", uuid.uuid4().hex
        try:
            first = self.first_frame(requests, context)
            frame = frames.decode_frame(first) if first is not None else None
            if not isinstance(frame, ControlFrame) or frame.kind is not FrameKind.HEADER:
                raise FrameError("a nixl stream must start with HEADER")
            sender, spec, algorithm = frames.decode_header(frame.body)
            peer = _sender_agent(frame.body)
            try:
                st = self.table.open(sender, spec, algorithm, context.cancel, self.arena)
            except NoStagingMemory as e:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"nixl staging full: {e}")
            assert st is not None and st.slab is not None
            self.agent.expect(peer, tag)
            offer = {
                **self.arena.describe(st.slab),
                "agent": self.agent.name,
                "metadata": self.metadata,
                "tag": tag,
            }
            if st.slab.is_cuda:  # verified where it landed, with the device digest
                offer["checksum"] = cuda_ipc.DEVICE_CHECKSUM
            yield frames.encode_control(
                FrameKind.SEGMENT, {"nixl": offer, "nbytes": spec.total_nbytes}
            )
            for raw in requests:
                frame = frames.decode_frame(raw)
                if not isinstance(frame, ControlFrame):
                    raise FrameError("DATA frames do not belong on a nixl stream")
                if frame.kind is FrameKind.LAYER:
                    self._verify_all(st, peer, tag, frame.body)
                elif frame.kind is FrameKind.END:
                    chunks = frames.field(frame.body, "chunks", int)
                    nbytes = frames.field(frame.body, "nbytes", int)
                    got = self.table.finish(st, chunks, nbytes)
                    yield frames.encode_ack(spec.transfer_id, True, None, got)
                    return
                else:
                    raise FrameError(f"unexpected {frame.kind.name} frame on a nixl stream")
            self.table.check_live(st)  # released mid-way: the sender hears that, not "truncated"
            raise TransferFault("truncated: stream ended before the end frame", data_loss=True)
        except Exception as e:
            failure = stream_failure(e)
            if failure is None:
                raise
            code, reason = failure
        finally:
            if peer:
                self.agent.unexpect(peer, tag)
        self.table.fail(st, reason)
        context.abort(code, reason)

    def _verify_all(self, st: Staged, peer: str, tag: str, body: dict[str, Any]) -> None:
        announced = frames.field(body, "layers", list)
        if not announced or len(announced) > st.spec.num_layers:
            raise FrameError(f"LAYER frame announces {len(announced)} layers")
        for entry in announced:
            if not (
                isinstance(entry, list) and len(entry) == 3 and all(type(x) is int for x in entry)
            ):
                raise FrameError("a LAYER entry must be [layer, nbytes, checksum] (ints)")
            layer, nbytes, value = entry
            buf = self.table.layer_buffer(st, layer, nbytes)
            note = f"{tag}:{layer}".encode()
            # The note follows its WRITE by microseconds; half the stall timeout leaves
            # the refusal its own reason rather than the stall guard's.
            wait_s = self.config.stall_timeout_s / 2
            if not self.agent.wait_note(peer, tag, note, wait_s):
                raise TransferFault(
                    f"layer {layer} announced, but agent {peer} sent no NIXL notification "
                    f"for it within {wait_s:g}s",
                    data_loss=True,
                )
            t0 = time.perf_counter()
            intact = _digest(st.checksum, buf) == value
            if not intact:
                raise TransferFault(f"checksum mismatch in layer {layer}", data_loss=True)
            self.table.layer_received(st, layer, time.perf_counter() - t0)


def _digest(algorithm: str, buf: torch.Tensor) -> int:
    """The header's algorithm over host memory; the GPU's digest over device memory."""
    if buf.is_cuda:
        return cuda_ipc.device_digest(buf)
    return checksum.digest(algorithm, frames.byte_view(buf))


def _sender_agent(body: dict[str, Any]) -> str:
    offer = frames.field(body, "nixl", dict)
    name = frames.field(offer, "agent", str)
    if not name or len(name) > MAX_AGENT_NAME or ":" in name:
        raise FrameError("a nixl HEADER must name the sender's agent")
    return name


class NixlKVReceiver(GrpcKVReceiver):
    """KVReceiver that takes NIXL WRITEs into an arena registered once at start; serves
    gRPC Push (the fallback of nixl senders, and grpc senders) and Shm too."""

    def __init__(
        self, identity: PeerIdentity, config: TransportConfig, host: str, port: int
    ) -> None:
        self.agent = agent()  # raises NixlUnavailable with what to do
        self.arena = Arena(
            self.agent, config.pool_bytes, torch.device(config.gpu or "cpu"),
            quarantine_s=config.lease_s,
        )
        super().__init__(identity, config, host, port)
        logger.info(
            "KV receiver %s takes NIXL writes as agent %s (%d MiB registered)",
            identity.worker_id,
            self.agent.name,
            self.arena.nbytes >> 20,
        )

    def _methods(self) -> dict[str, grpc.RpcMethodHandler]:
        methods = super()._methods()
        inbound = NixlInbound(self, self.agent, self.arena)
        methods["Nixl"] = grpc.stream_stream_rpc_method_handler(inbound.handle)
        return methods

    def close(self) -> None:
        super().close()
        self.arena.close()
