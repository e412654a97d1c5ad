"""The sending side of the `nixl` transport (see `nixl_receiver` for the protocol).

Per transfer, one thread opens a Nixl stream to the receiver, which answers with a region
of its registered arena and its agent's metadata (both only over that authenticated
stream). For each layer the engine hands over, the thread checksums the layer in this
process's registered arena, WRITEs it into the receiver's region with a notification,
and once the WRITE is done announces the layer and its checksum on the stream. END is
answered by the receiver's ACK. Layers the engine handed over faster than they are
written are announced together (up to `ANNOUNCE_MAX` a frame): the receiver pays per
control message, and one that verifies a few layers at a time keeps up with the WRITEs.

The layers are in the registered arena already when the producer made its private copy
of each layer's blocks there: `begin` reserves a region for the whole transfer and
`layer_memory` lends it (registering the engine's per-request tensors instead would cost
a registration per request). A layer handed over from elsewhere is copied into that
region first; when the arena has no room for a whole transfer, into a one-layer region.

A transfer that cannot start over NIXL (the receiver does not serve Nixl, its arena or
this one is full) is handed to the `fallback` gRPC sender before any byte moved, so it is
not lost; each (peer, reason) is logged once and counted in `poll_fallbacks()`. The
fallback belongs to this sender: its outcomes come out of this sender's
`poll_finished()`, and closing this sender closes it.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from services.kv.fingerprint import PeerIdentity
from services.kv.transport import checksum, cuda_ipc, frames
from services.kv.transport.base import KVSender
from services.kv.transport.frames import ControlFrame, FrameError, FrameKind
from services.kv.transport.grpc_channel import SERVICE, host_tensor, open_channel, rpc_error_text
from services.kv.transport.nixl_agent import Arena, agent
from services.kv.transport.sender_core import (
    END_ITEM,
    STOP_ITEM,
    Item,
    LayerItem,
    Outgoing,
    SenderCore,
)
from services.kv.transport.spec import TransferOutcome, TransportConfig

logger = logging.getLogger(__name__)

NIXL = f"/{SERVICE}/Nixl"  # bidirectional control stream of a NIXL transfer
REASON_REFUSED = "receiver_refuses_nixl"  # the receiver does not serve Nixl
REASON_FULL = "nixl_staging_full"  # no free region in the receiver's or this arena
ANNOUNCE_MAX = 8  # layers per LAYER frame, at most


class _Fallback(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Target:
    """The receiver's region for one transfer, as its SEGMENT answer described it."""

    agent: str  # the receiver's NIXL agent
    metadata: bytes  # its agent metadata (loaded once per receiver)
    addr: int
    nbytes: int
    device: int
    mem: str  # "DRAM" or "VRAM"
    tag: str  # fresh per transfer: prefixes each notification
    device_digest: bool  # the receiver verifies with cuda_ipc.device_digest


@dataclass(eq=False)
class NixlLink:
    items: queue.SimpleQueue[Item] = field(default_factory=queue.SimpleQueue)
    control: queue.SimpleQueue[bytes | None] = field(default_factory=queue.SimpleQueue)
    call: Any = None  # the Nixl stream (an iterator of replies with cancel())
    lent: torch.Tensor | None = None  # the whole transfer's region, lent by layer_memory
    source: torch.Tensor | None = None  # else: a one-layer region, reused layer by layer
    handed: bool = False  # being handed to the fallback: the producer may still write


class NixlKVSender(SenderCore[NixlLink]):
    """KVSender by NIXL WRITEs into receiver-registered memory."""

    def __init__(self, identity: PeerIdentity, config: TransportConfig, fallback: KVSender):
        super().__init__(identity, config)
        self.fallback = fallback
        self.agent = agent()  # raises NixlUnavailable with what to do
        device = torch.device(config.gpu or "cpu")
        self.arena = Arena(self.agent, config.pool_bytes, device, quarantine_s=config.lease_s)
        self._channels: dict[str, grpc.Channel] = {}
        self._mine_lock = threading.Lock()
        self._fallbacks: list[tuple[str, str, str]] = []  # (peer, reason, detail)
        self._logged: set[tuple[str, str]] = set()
        self._agents: dict[str, str] = {}  # receiver address -> its NIXL agent

    def poll_finished(self, wait_s: float = 0.0) -> list[TransferOutcome]:
        """Outcomes since the last call, those of transfers handed to the fallback
        included (this sender owns it: nobody else polls it)."""
        handed = self.fallback.poll_finished()
        if handed:
            return super().poll_finished() + handed
        return super().poll_finished(wait_s) + self.fallback.poll_finished()

    def poll_fallbacks(self) -> list[tuple[str, str, str]]:
        """(peer, reason, detail) of each transfer handed to the fallback since last call."""
        with self._mine_lock:
            out, self._fallbacks = self._fallbacks, []
        return out

    def layer_memory(self, transfer_id: str) -> torch.Tensor | None:
        out = self._get(transfer_id)
        return None if out is None or out.link is None else out.link.lent

    # -- SenderCore hooks ----------------------------------------------------------------
    def _start(self, out: Outgoing[NixlLink]) -> None:
        out.link = NixlLink()
        # No room for the whole transfer: its thread takes a one-layer region instead.
        with contextlib.suppress(RuntimeError):
            out.link.lent = self.arena.get(out.spec.total_nbytes)
        name = f"kv-nixl-{out.spec.transfer_id[:32]}"
        threading.Thread(target=self._run, args=(out,), name=name, daemon=True).start()

    def _enqueue(self, out: Outgoing[NixlLink], item: Item) -> None:
        assert out.link is not None
        out.link.items.put(item)

    def _abort(self, out: Outgoing[NixlLink]) -> None:
        assert out.link is not None
        if out.link.call is not None:
            out.link.call.cancel()
        out.link.items.put(STOP_ITEM)

    def _close_transport(self) -> None:
        with self._mine_lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()
        self.fallback.close()

    # -- per-transfer thread -------------------------------------------------------------
    def _channel(self, peer: str) -> grpc.Channel:
        with self._mine_lock:
            if peer not in self._channels:
                self._channels[peer] = open_channel(peer, self.config)
            return self._channels[peer]

    def _next_raw(self, out: Outgoing[NixlLink]) -> bytes:
        assert out.link is not None
        call, stall = out.link.call, self.config.stall_timeout_s
        # A receiver that never answers must not hang this thread: the failure cancels
        # the call, which ends the wait.
        timer = threading.Timer(
            stall, self.fail, (out, f"no answer from the receiver for {stall:g}s while {out.phase}")
        )
        timer.start()
        try:
            return bytes(next(call))
        finally:
            timer.cancel()

    def _run(self, out: Outgoing[NixlLink]) -> None:
        link = out.link
        assert link is not None
        try:
            target = self._setup(out, link)
            self._ship(out, link, target)
        except _Fallback as e:
            self._hand_over(out, link, e.reason, str(e))
        except grpc.RpcError as e:
            self.complete(out, False, out.error or rpc_error_text(e), 0)
        except FrameError as e:
            self.complete(out, False, out.error or f"receiver's answer refused: {e}", 0)
        except StopIteration:
            self.complete(out, False, out.error or "receiver ended the stream unanswered", 0)
        except Exception as e:  # never let a sender thread die silently
            logger.exception("KV nixl sender thread for %s failed", out.spec.transfer_id)
            self.complete(out, False, f"sender error: {e}", 0)
        finally:
            link.control.put(None)
            # After a failure a WRITE from a region may still be in flight, and the
            # producer may still be copying later layers of a lent one.
            clean = out.error is None and out.done and not link.handed
            for region in (link.lent, link.source):
                if region is not None:
                    (self.arena.put if clean else self.arena.retire)(region)
            while True:  # give back the slots of layers never sent
                try:
                    self.release_item(link.items.get_nowait())
                except queue.Empty:
                    break

    def _setup(self, out: Outgoing[NixlLink], link: NixlLink) -> Target:
        """Take a source region (unless one was lent), open the stream, read the
        receiver's region."""
        if link.lent is None:
            try:
                link.source = self.arena.get(out.spec.layer_nbytes)
            except RuntimeError as e:
                raise _Fallback(REASON_FULL, f"sender: {e}") from None
        requests: Iterator[bytes] = iter(link.control.get, None)
        link.call = self._channel(out.peer).stream_stream(NIXL)(requests)
        out.last_progress = time.monotonic()
        out.phase = "waiting for a region"
        link.control.put(
            frames.encode_header(
                self.identity, out.spec, self.config.checksum, nixl={"agent": self.agent.name}
            )
        )
        try:
            raw = self._next_raw(out)
        except grpc.RpcError as e:
            if e.code() is grpc.StatusCode.UNIMPLEMENTED:
                raise _Fallback(REASON_REFUSED, rpc_error_text(e)) from None
            if e.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "nixl staging" in str(
                e.details()
            ):
                raise _Fallback(REASON_FULL, rpc_error_text(e)) from None
            raise  # a refusal (layout, epoch, released id) is the transfer's outcome
        reply = frames.decode_frame(raw)
        if not isinstance(reply, ControlFrame) or reply.kind is not FrameKind.SEGMENT:
            raise FrameError("expected a SEGMENT frame")
        target = _target(reply.body, out.spec.total_nbytes)
        if target.agent != self.agent.name:  # else sender and receiver share this process
            if not self.agent.remote(target.metadata, target.agent):
                raise FrameError(f"SEGMENT names agent {target.agent!r}, its metadata another")
            with self._mine_lock:  # a restarted receiver has a new agent: drop the old one
                old = self._agents.get(out.peer)
                self._agents[out.peer] = target.agent
            if old is not None and old != target.agent:
                self.agent.retire_peer(old)
        return target

    def _ship(self, out: Outgoing[NixlLink], link: NixlLink, target: Target) -> None:
        spec, step = out.spec, out.spec.layer_nbytes
        written: list[list[int]] = []  # [layer, nbytes, checksum] not yet announced
        while True:
            out.phase = "waiting for layers"
            try:
                item = link.items.get(timeout=self.config.stall_timeout_s)
            except queue.Empty:
                stall = self.config.stall_timeout_s
                self.fail(out, f"no progress for {stall:.1f}s while waiting for layers")
                return
            if item == STOP_ITEM or out.done:
                self.release_item(item)
                return
            out.last_progress = time.monotonic()
            if item == END_ITEM:
                out.phase = "waiting for the receiver's ack"
                if written:
                    link.control.put(frames.encode_control(FrameKind.LAYER, {"layers": written}))
                body = {"chunks": spec.num_layers, "nbytes": spec.total_nbytes}
                link.control.put(frames.encode_control(FrameKind.END, body))
                tid, ok, error, nbytes = frames.decode_ack(self._next_raw(out))
                if ok and (tid != spec.transfer_id or nbytes != spec.total_nbytes):
                    ok, error = False, f"receiver acked {tid!r} with {nbytes} bytes"
                self.complete(out, ok, error, nbytes if ok else 0)
                return
            if not isinstance(item, LayerItem):
                continue
            if link.lent is not None:
                source = link.lent[item.layer * step : (item.layer + 1) * step]
            else:
                assert link.source is not None
                source = link.source[:step]
            try:
                out.phase = f"writing layer {item.layer}"
                value = self._copy_in(source, item, target)
                if out.corrupt:  # fault injection: damage the payload after its checksum
                    out.corrupt = False
                    source[0] ^= 0xFF
                    if source.is_cuda:
                        torch.cuda.synchronize(source.device)
            except Exception as e:  # a bad tensor fails this transfer, nothing else
                self.fail(out, f"cannot copy layer {item.layer} into registered memory: {e}")
                return
            finally:
                self.release_item(item)
            local = self.agent.descs(
                [(source.data_ptr(), step, self.arena.device_id)], self.arena.mem
            )
            remote = self.agent.descs(
                [(target.addr + item.layer * step, step, target.device)], target.mem
            )
            started = time.monotonic()

            def going(started: float = started) -> bool:
                return not out.done and time.monotonic() - started < self.config.stall_timeout_s

            problem = self.agent.write(
                local, remote, target.agent, f"{target.tag}:{item.layer}".encode(), going
            )
            if problem is not None:
                self.fail(out, f"NIXL WRITE of layer {item.layer} to {target.agent}: {problem}")
                return
            out.last_progress = time.monotonic()
            written.append([item.layer, step, value])
            if len(written) >= ANNOUNCE_MAX or link.items.empty():
                link.control.put(frames.encode_control(FrameKind.LAYER, {"layers": written}))
                written = []

    def _copy_in(self, source: torch.Tensor, item: LayerItem, target: Target) -> int:
        """Copy a layer into the registered source region, unless the producer made it
        there; its checksum over the region."""
        tensor = item.tensor
        there = (
            tensor.device == source.device
            and tensor.data_ptr() == source.data_ptr()
            and tensor.is_contiguous()
        )
        if source.is_cuda:
            stream = torch.cuda.current_stream(source.device)
            if item.event is not None:  # orders the digest and WRITE after its producer
                stream.wait_event(item.event)
            if not there:
                source.copy_(tensor.reshape(-1).view(torch.uint8))
        elif not there:
            source.copy_(host_tensor(tensor, item.event).reshape(-1).view(torch.uint8))
        if target.device_digest or source.is_cuda:
            value = cuda_ipc.device_digest(source)  # synchronizes the copy's stream
        else:
            value = checksum.digest(self.config.checksum, frames.byte_view(source))
        return value

    def _hand_over(self, out: Outgoing[NixlLink], link: NixlLink, reason: str, detail: str) -> None:
        """Ship `out` over the fallback sender instead: forward every item to it."""
        tid, link.handed = out.spec.transfer_id, True
        with self._mine_lock:
            self._fallbacks.append((out.peer, reason, detail))
            first = (out.peer, reason) not in self._logged
            self._logged.add((out.peer, reason))
        if first:
            logger.warning(
                "KV to %s goes over gRPC, not NIXL (%s): %s; later transfers "
                "that fall back for this reason are not logged",
                out.peer,
                reason,
                detail,
            )
        self.fallback.begin(out.peer, out.spec)
        if out.corrupt:
            self.fallback.corrupt_after_checksum(tid)
        while True:
            item = link.items.get()
            try:
                if isinstance(item, LayerItem):
                    tensor = item.tensor
                    if link.lent is not None and self.arena.owns(tensor):
                        # the fallback may outlive the region (see `_run`)
                        tensor = tensor.clone()
                    self.fallback.send_layer(tid, item.layer, tensor)
                    continue
                if item == END_ITEM:
                    self.fallback.end(tid)
                    # Every layer is in, those from `lent` as clones: nothing reads or
                    # writes the regions now, so they go back at once.
                    link.handed = False
                elif item == STOP_ITEM:
                    self.fallback.cancel(tid)
                else:
                    continue
            finally:
                self.release_item(item)
            self.forget(out)  # the fallback reports this transfer's outcome
            return


def _target(body: dict[str, Any], total: int) -> Target:
    """The receiver's region from a SEGMENT body; FrameError unless it is well formed and
    exactly as large as the transfer."""
    nbytes = frames.field(body, "nbytes", int)
    offer = frames.field(body, "nixl", dict)
    region = frames.field(offer, "nbytes", int)
    if nbytes != total or region < total:
        raise FrameError(
            f"a region of {region} bytes (SEGMENT says {nbytes}) for a transfer of {total}"
        )
    mem = frames.field(offer, "mem", str)
    if mem not in ("DRAM", "VRAM"):
        raise FrameError(f"region in unknown memory {mem!r}")
    tag = frames.field(offer, "tag", str)
    if not tag or ":" in tag or len(tag) > 64:
        raise FrameError("a SEGMENT must carry a transfer tag")
    try:
        metadata = base64.b64decode(frames.field(offer, "metadata", str), validate=True)
    except binascii.Error:
        raise FrameError("agent metadata is not base64") from None
    return Target(
        agent=frames.field(offer, "agent", str),
        metadata=metadata,
        addr=frames.field(offer, "addr", int),
        nbytes=frames.field(offer, "nbytes", int),
        device=frames.field(offer, "device", int),
        mem=mem,
        tag=tag,
        device_digest=offer.get("checksum") == cuda_ipc.DEVICE_CHECKSUM,
    )
