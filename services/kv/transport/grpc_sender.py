"""Sender of the default KV transport: one gRPC client stream per transfer.

One thread per transfer owns the call; gRPC's blocking writes plus the sender's bounded
queue are the flow control. Success is one ACK frame from the receiver; anything else
ends the call with a status whose text becomes the transfer's error.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from services.kv.fingerprint import PeerIdentity
from services.kv.transport import frames
from services.kv.transport.frames import FrameKind
from services.kv.transport.grpc_channel import (
    PUSH,
    host_tensor,
    open_channel,
    rpc_error_text,
)
from services.kv.transport.heap import keep_frames_on_heap
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

PushCall = Callable[..., grpc.Future]  # channel.stream_unary(PUSH).future


@dataclass(eq=False)
class PushLink:
    """One transfer's work queue and, once the call started, its future."""

    items: queue.SimpleQueue[Item] = field(default_factory=queue.SimpleQueue)
    future: grpc.Future | None = None


class GrpcKVSender(SenderCore[PushLink]):
    """KVSender over per-transfer gRPC client streams."""

    def __init__(self, identity: PeerIdentity, config: TransportConfig) -> None:
        super().__init__(identity, config)
        keep_frames_on_heap()
        self._channels: dict[str, tuple[grpc.Channel, PushCall]] = {}
        self._channels_lock = threading.Lock()

    def _push_call(self, peer: str) -> PushCall:
        with self._channels_lock:  # channels (and their HTTP/2 connections) are reused per peer
            entry = self._channels.get(peer)
            if entry is None:
                channel = open_channel(peer, self.config)
                entry = (channel, channel.stream_unary(PUSH).future)
                self._channels[peer] = entry
            return entry[1]

    # -- SenderCore hooks ----------------------------------------------------------------
    def _start(self, out: Outgoing[PushLink]) -> None:
        out.link = PushLink()
        name = f"kv-send-{out.spec.transfer_id[:32]}"
        threading.Thread(target=self._run, args=(out,), name=name, daemon=True).start()

    def _enqueue(self, out: Outgoing[PushLink], item: Item) -> None:
        assert out.link is not None
        out.link.items.put(item)

    def _abort(self, out: Outgoing[PushLink]) -> None:
        assert out.link is not None
        if out.link.future is not None:
            out.link.future.cancel()  # reset the stream first: the receiver never sees an end
        out.link.items.put(STOP_ITEM)

    def _close_transport(self) -> None:
        with self._channels_lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel, _ in channels:
            channel.close()

    # -- per-transfer thread -------------------------------------------------------------
    def _run(self, out: Outgoing[PushLink]) -> None:
        link = out.link
        assert link is not None
        try:
            fut = self._push_call(out.peer)(self._frames(out, link))
            link.future = fut
            if out.done:
                fut.cancel()
            while True:
                try:
                    reply = fut.result(timeout=self._tick(out))
                except grpc.FutureTimeoutError:
                    idle = time.monotonic() - out.last_progress
                    if idle >= self.config.stall_timeout_s:
                        self.fail(out, f"no progress for {idle:.1f}s while {out.phase}")
                    continue
                except grpc.FutureCancelledError:
                    self.complete(out, False, out.error or "cancelled", 0)
                    return
                except grpc.RpcError as e:
                    self.complete(out, False, out.error or rpc_error_text(e), 0)
                    return
                tid, ok, error, nbytes = frames.decode_ack(reply)
                if ok and (tid != out.spec.transfer_id or nbytes != out.spec.total_nbytes):
                    ok, error = False, f"receiver acked {tid!r} with {nbytes} bytes"
                self.complete(out, ok, error, nbytes if ok else 0)
                return
        except Exception as e:  # never let a sender thread die silently
            logger.exception("KV sender thread for %s failed", out.spec.transfer_id)
            self.complete(out, False, f"sender error: {e}", 0)
        finally:
            while True:  # give back the slots of layers never sent
                try:
                    self.release_item(link.items.get_nowait())
                except queue.Empty:
                    break

    def _tick(self, out: Outgoing[PushLink]) -> float:
        left = self.config.stall_timeout_s - (time.monotonic() - out.last_progress)
        return max(left, 0.05)  # progress moves the deadline: re-check then

    def _frames(self, out: Outgoing[PushLink], link: PushLink) -> Iterator[bytes]:
        """The request stream; runs on gRPC's consumer thread, one frame per write."""
        spec, chunk_bytes = out.spec, self.config.chunk_bytes
        out.last_progress = time.monotonic()
        algorithm = self.config.checksum
        yield frames.encode_header(self.identity, spec, algorithm)
        chunks = 0
        while True:
            out.phase = "waiting for layers"
            item = link.items.get()
            if item == STOP_ITEM or out.done:
                self.release_item(item)
                return
            out.last_progress = time.monotonic()
            if item == END_ITEM:
                out.phase = "waiting for the receiver's ack"
                body = {"chunks": chunks, "nbytes": spec.total_nbytes}
                yield frames.encode_control(FrameKind.END, body)
                return
            if not isinstance(item, LayerItem):
                continue
            try:
                view = frames.byte_view(host_tensor(item.tensor, item.event))
                out.phase = f"sending layer {item.layer}"
                for idx, offset, n in frames.chunk_ranges(len(view), chunk_bytes):
                    frame = frames.encode_data(
                        item.layer, idx, offset, view[offset : offset + n], algorithm
                    )
                    if out.corrupt:  # fault injection: damage the payload after its checksum
                        out.corrupt, frame = False, frame[:-1] + bytes([frame[-1] ^ 0xFF])
                    yield frame
                    out.last_progress = time.monotonic()
                    chunks += 1
            except Exception as e:  # a bad tensor fails this transfer, nothing else
                self.fail(out, f"cannot encode layer {item.layer}: {e}")
                return
            finally:
                self.release_item(item)
