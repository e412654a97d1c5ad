"""The sending side of the same-host transport (see `shm_receiver` for the protocol).

Per transfer, one thread opens a Shm stream to the receiver, maps the segment it names
(mappings are cached per segment name: the receiver reuses segments, so a reused one is
already mapped and paged in), copies each layer in (the one copy in) and checksums it
there, and announces the layers written with a LAYER frame: as soon as no further layer
is waiting (while the model computes the next one), else once `ANNOUNCE_BYTES` are
written. Each message costs the receiver about as much CPU as verifying a layer, so a
transfer whose layers are all ready takes a few messages, not one per layer.

A transfer that cannot start over shared memory (the receiver does not serve Shm, the
segment cannot be mapped: another container's /dev/shm, another user) is handed to the
`fallback` network sender before any layer was written, so it is not lost; the reason is
reported once per transfer by `poll_fallbacks()`. CUDA layers are copied to the host
segment (one device-to-host copy), unless both workers run on GPUs (`ipc_device` set on
both): the sender then offers `cuda_ipc` in its HEADER, the receiver lends a slab of its
GPU's memory, and layers go device to device (see `cuda_ipc`).
"""

from __future__ import annotations

import collections
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from services.kv.fingerprint import PeerIdentity
from services.kv.transport import checksum, cuda_ipc, frames, shm_segments
from services.kv.transport.base import KVSender
from services.kv.transport.frames import ControlFrame, FrameError, FrameKind
from services.kv.transport.grpc_channel import SHM, host_tensor, open_channel, rpc_error_text
from services.kv.transport.sender_core import (
    END_ITEM,
    STOP_ITEM,
    Item,
    LayerItem,
    Outgoing,
    SenderCore,
)
from services.kv.transport.spec import TransportConfig

logger = logging.getLogger(__name__)

REASON_REFUSED = "receiver_refuses_shm"  # the receiver does not serve Shm (off there)
REASON_SETUP = "shm_setup_failed"  # no segment, or it cannot be mapped here
MAX_MAPPINGS = 16  # segments kept mapped for reuse


class _Fallback(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


ANNOUNCE_BYTES = 4 << 20  # announce at least this often while layers queue up


@dataclass(eq=False)
class ShmLink:
    items: queue.SimpleQueue[Item] = field(default_factory=queue.SimpleQueue)
    control: queue.SimpleQueue[bytes | None] = field(default_factory=queue.SimpleQueue)
    call: Any = None  # the Shm stream (an iterator of replies with cancel())
    segment: str = ""  # the segment's name once the receiver named it
    batches: bool = False  # the receiver takes several layers per LAYER frame


class ShmKVSender(SenderCore[ShmLink]):
    """KVSender through receiver-owned shared-memory segments, for same-host receivers."""

    def __init__(self, identity: PeerIdentity, config: TransportConfig, fallback: KVSender):
        super().__init__(identity, config)
        self.fallback = fallback
        self._channels: dict[str, grpc.Channel] = {}
        # segment name -> our mapping of it, most recently used last; bounded, since a
        # receiver unlinks failed and evicted segments and their pages live while mapped
        self._maps: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
        self._mine_lock = threading.Lock()
        self._fallbacks: list[tuple[str, str, str]] = []  # (peer, reason, detail)
        self._told_host: set[str] = set()  # peers that answered a cuda_ipc offer with host memory

    def poll_fallbacks(self) -> list[tuple[str, str, str]]:
        """(peer, reason, detail) of each transfer handed to the fallback since last call."""
        with self._mine_lock:
            out, self._fallbacks = self._fallbacks, []
        return out

    # -- SenderCore hooks ----------------------------------------------------------------
    def _start(self, out: Outgoing[ShmLink]) -> None:
        out.link = ShmLink()
        name = f"kv-shm-{out.spec.transfer_id[:32]}"
        threading.Thread(target=self._run, args=(out,), name=name, daemon=True).start()

    def _enqueue(self, out: Outgoing[ShmLink], item: Item) -> None:
        assert out.link is not None
        out.link.items.put(item)

    def _abort(self, out: Outgoing[ShmLink]) -> None:
        assert out.link is not None
        if out.link.call is not None:
            out.link.call.cancel()
        out.link.items.put(STOP_ITEM)

    def _close_transport(self) -> None:
        with self._mine_lock:
            channels, self._channels = list(self._channels.values()), {}
            self._maps.clear()
        for channel in channels:
            channel.close()

    # -- per-transfer thread -------------------------------------------------------------
    def _channel(self, peer: str) -> grpc.Channel:
        with self._mine_lock:
            if peer not in self._channels:
                self._channels[peer] = open_channel(peer, self.config)
            return self._channels[peer]

    def _segment(self, name: str, nbytes: int, open_it: Callable[[], torch.Tensor],
                 always_open: bool = False) -> torch.Tensor:
        """The mapping of segment `name`, from the cache unless `always_open` (CUDA IPC:
        torch caches the mapping itself, and each opening balances the reference the
        receiver's export of the slab for this transfer took)."""
        with self._mine_lock:
            seg = self._maps.get(name)
            if seg is not None:
                self._maps.move_to_end(name)
        if seg is None or seg.numel() < nbytes or always_open:
            seg = open_it()
            with self._mine_lock:
                self._maps[name] = seg
                while len(self._maps) > MAX_MAPPINGS:
                    self._maps.popitem(last=False)
        return seg

    def _unmap(self, name: str) -> None:
        with self._mine_lock:
            self._maps.pop(name, None)

    def _next_raw(self, out: Outgoing[ShmLink]) -> bytes:
        assert out.link is not None
        call = out.link.call
        timer = threading.Timer(self.config.stall_timeout_s, call.cancel)
        timer.start()  # a receiver that never answers must not hang this thread
        try:
            return bytes(next(call))
        finally:
            timer.cancel()

    def _next_reply(self, out: Outgoing[ShmLink]) -> ControlFrame:
        frame = frames.decode_frame(self._next_raw(out))
        if not isinstance(frame, ControlFrame):
            raise FrameError("expected a control frame")
        return frame

    def _run(self, out: Outgoing[ShmLink]) -> None:
        link = out.link
        assert link is not None
        try:
            seg = self._setup(out, link)
            self._ship(out, link, seg)
        except _Fallback as e:
            self._hand_over(out, link, e.reason, str(e))
        except grpc.RpcError as e:
            self.complete(out, False, out.error or rpc_error_text(e), 0)
        except Exception as e:  # never let a sender thread die silently
            logger.exception("KV shm sender thread for %s failed", out.spec.transfer_id)
            self.complete(out, False, f"sender error: {e}", 0)
        finally:
            if link.segment and (out.error or not out.done):
                self._unmap(link.segment)  # the receiver unlinks a failed transfer's segment
            link.control.put(None)
            while True:  # give back the slots of layers never sent
                try:
                    self.release_item(link.items.get_nowait())
                except queue.Empty:
                    break

    def _setup(self, out: Outgoing[ShmLink], link: ShmLink) -> torch.Tensor:
        """Open the stream and map the segment; _Fallback where shm cannot be used."""
        requests: Iterator[bytes] = iter(link.control.get, None)
        link.call = self._channel(out.peer).stream_stream(SHM)(requests)
        out.last_progress = time.monotonic()
        out.phase = "waiting for a segment"
        offers = {"cuda_ipc": True} if self.config.ipc_device else {}
        link.control.put(
            frames.encode_header(self.identity, out.spec, self.config.checksum, **offers))
        try:
            reply = self._next_reply(out)
        except grpc.RpcError as e:
            if e.code() is grpc.StatusCode.UNIMPLEMENTED:
                raise _Fallback(REASON_REFUSED, rpc_error_text(e)) from None
            raise  # a refusal (layout, epoch, staging) is the transfer's outcome
        if reply.kind is not FrameKind.SEGMENT:
            raise FrameError(f"expected SEGMENT, got {reply.kind.name}")
        nbytes = frames.field(reply.body, "nbytes", int)
        if nbytes != out.spec.total_nbytes:
            raise FrameError(f"segment of {nbytes} bytes for {out.spec.total_nbytes}")
        link.batches = reply.body.get("batches") is True
        open_it: Callable[[], torch.Tensor]
        if self.config.ipc_device and "cuda_ipc" in reply.body:  # a slab of its GPU
            if reply.body.get("checksum") != cuda_ipc.DEVICE_CHECKSUM:
                raise FrameError("a cuda_ipc SEGMENT must name the sum64 checksum")
            fields = reply.body["cuda_ipc"]
            name = cuda_ipc.mapping_key(fields)
            device = torch.device(self.config.ipc_device)
            open_it = functools.partial(cuda_ipc.open_slab, fields, nbytes, device)
            always_open = True  # torch caches the mapping; each opening settles a reference
        else:
            always_open = False
            name = frames.field(reply.body, "name", str)
            open_it = functools.partial(shm_segments.map_segment, name, nbytes)
            if self.config.ipc_device and out.peer not in self._told_host:
                self._told_host.add(out.peer)  # once per peer: it may be every transfer
                logger.warning("KV to %s goes through host shared memory, not GPU to GPU: "
                               "its device staging is full, or it runs without CUDA IPC",
                               out.peer)
        link.segment = name
        try:
            return self._segment(name, nbytes, open_it, always_open)
        except (OSError, ValueError, RuntimeError) as e:
            # End the stream and wait for the receiver to fail the transfer: the network
            # sender reuses its id, which the receiver refuses while it is still open.
            link.control.put(None)
            try:
                self._next_raw(out)
            except grpc.RpcError as answer:
                # A refusal (the receiver released the transfer, and so unlinked its
                # segment) is the outcome: the network would be refused too, and shm to
                # this peer is fine.
                if answer.code() is grpc.StatusCode.FAILED_PRECONDITION:
                    raise
            except StopIteration:
                pass
            raise _Fallback(REASON_SETUP, f"cannot map segment {name}: {e}") from None

    def _ship(self, out: Outgoing[ShmLink], link: ShmLink, seg: torch.Tensor) -> None:
        spec, step = out.spec, out.spec.layer_nbytes
        written: list[list[int]] = []  # [layer, nbytes, checksum] not announced yet
        while True:
            if written and (link.items.empty() or len(written) * step >= ANNOUNCE_BYTES
                            or not link.batches):
                self._announce(link, spec.transfer_id, written)
                written = []
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
                self._announce(link, spec.transfer_id, written)
                out.phase = "waiting for the receiver's ack"
                body = {"chunks": spec.num_layers, "nbytes": spec.total_nbytes}
                link.control.put(frames.encode_control(FrameKind.END, body))
                tid, ok, error, nbytes = frames.decode_ack(self._next_raw(out))
                if ok and (tid != spec.transfer_id or nbytes != spec.total_nbytes):
                    ok, error = False, f"receiver acked {tid!r} with {nbytes} bytes"
                self.complete(out, ok, error, nbytes if ok else 0)
                return
            if not isinstance(item, LayerItem):
                continue
            try:
                out.phase = f"writing layer {item.layer}"
                region = seg[item.layer * step : (item.layer + 1) * step]
                if seg.is_cuda:
                    value = _write_device(region, item)
                else:
                    flat = host_tensor(item.tensor, item.event).reshape(-1).view(torch.uint8)
                    region.copy_(flat)  # the one copy in
                    value = checksum.digest(self.config.checksum, frames.byte_view(region))
                if out.corrupt:  # fault injection: damage the payload after its checksum
                    out.corrupt = False
                    region[0] ^= 0xFF
                    if region.is_cuda:  # landed before the layer is announced
                        torch.cuda.synchronize(region.device)
            finally:
                self.release_item(item)
            written.append([item.layer, step, value])

    @staticmethod
    def _announce(link: ShmLink, transfer_id: str, written: list[list[int]]) -> None:
        """LAYER frames for the layers in `written`: one, or one per layer for a receiver
        that did not say it takes several per frame (older than this protocol)."""
        if link.batches and written:
            link.control.put(frames.encode_control(FrameKind.LAYER, {"layers": written}))
            return
        for layer, nbytes, value in written:
            body = {"transfer_id": transfer_id, "layer": layer, "nbytes": nbytes,
                    "checksum": value}
            link.control.put(frames.encode_control(FrameKind.LAYER, body))

    def _hand_over(self, out: Outgoing[ShmLink], link: ShmLink, reason: str, detail: str) -> None:
        """Ship `out` over the fallback sender instead: forward every item to it."""
        tid = out.spec.transfer_id
        with self._mine_lock:
            self._fallbacks.append((out.peer, reason, detail))
        self.fallback.begin(out.peer, out.spec)
        if out.corrupt:
            self.fallback.corrupt_after_checksum(tid)
        while True:
            item = link.items.get()
            try:
                if isinstance(item, LayerItem):
                    self.fallback.send_layer(tid, item.layer, item.tensor)
                    continue
                if item == END_ITEM:
                    self.fallback.end(tid)
                elif item == STOP_ITEM:
                    self.fallback.cancel(tid)
                else:
                    continue
            finally:
                self.release_item(item)
            self.forget(out)  # the fallback reports this transfer's outcome
            return


def _write_device(region: torch.Tensor, item: LayerItem) -> int:
    """Copy a layer into a lent device slab on this thread's stream (after the producer's
    event) and return its device digest, computed over the source; the digest's read
    back synchronizes the stream, so the copy has landed before the layer is announced."""
    stream = torch.cuda.current_stream(region.device)
    if item.event is not None:
        stream.wait_event(item.event)
    src = item.tensor.reshape(-1).view(torch.uint8)
    region.copy_(src, non_blocking=True)  # device to device (peer access), or host to device
    value = cuda_ipc.device_digest(item.tensor)
    stream.synchronize()
    return value
