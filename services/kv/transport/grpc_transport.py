"""The default KV transport: one gRPC client stream per transfer, raw-bytes frames.

The sender runs one thread per transfer that owns the call; gRPC's blocking writes plus
the sender's bounded queue are the flow control. The receiver is a plain gRPC server
whose handlers verify each frame and copy its payload straight into the transfer's
staging buffers (services.kv.transport.staging). Failures end the call with a status
(FAILED_PRECONDITION for a refused peer, DATA_LOSS for corrupt or missing bytes,
INVALID_ARGUMENT for protocol violations); success returns one ACK frame.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import torch

from services.kv import frames
from services.kv.fingerprint import PeerIdentity
from services.kv.frames import ControlFrame, DataFrame, FrameError, FrameKind
from services.kv.transport.base import (
    END_ITEM,
    STOP_ITEM,
    KVReceiver,
    Outgoing,
    ReceivedKV,
    ReceiveState,
    SenderCore,
    TransportConfig,
)
from services.kv.transport.staging import Refused, Staged, StagingTable, TransferFault

logger = logging.getLogger(__name__)

SERVICE = "pdserve.v1.KVTransfer"
PUSH = f"/{SERVICE}/Push"


def channel_options(config: TransportConfig) -> list[tuple[str, Any]]:
    """Client options: explicit message limits (the default receive limit is 4 MiB) and
    keepalive pings so a peer that vanished without closing its socket is noticed."""
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options(config: TransportConfig) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.so_reuseport", 0),  # two receivers must never share a port silently
    ]


def rpc_error_text(err: grpc.RpcError) -> str:
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    return f"{code.name if code else 'UNKNOWN'}: {details}"


def host_tensor(tensor: torch.Tensor, event: Any) -> torch.Tensor:
    """A contiguous CPU copy-or-view of a layer, waiting for the producer's CUDA work."""
    if tensor.is_cuda:  # untested here: needs a GPU; the event orders us after index_select
        event.synchronize()
        return tensor.to("cpu").contiguous()
    return tensor.contiguous()


class GrpcKVSender(SenderCore):
    """KVSender over per-transfer gRPC client streams."""

    def __init__(self, identity: PeerIdentity, config: TransportConfig) -> None:
        super().__init__(identity, config)
        self._channels: dict[str, tuple[grpc.Channel, Any]] = {}

    def _push_call(self, peer: str) -> Any:
        with self._lock:  # channels (and their HTTP/2 connections) are reused per peer
            entry = self._channels.get(peer)
            if entry is None:
                channel = grpc.insecure_channel(peer, options=channel_options(self.config))
                entry = (channel, channel.stream_unary(PUSH))
                self._channels[peer] = entry
            return entry[1]

    # -- SenderCore hooks ----------------------------------------------------------------
    def _start(self, out: Outgoing) -> None:
        out.queue = queue.SimpleQueue()
        name = f"kv-send-{out.spec.transfer_id[:32]}"
        threading.Thread(target=self._run, args=(out,), name=name, daemon=True).start()

    def _enqueue(self, out: Outgoing, item: Any) -> None:
        out.queue.put(item)

    def _abort(self, out: Outgoing) -> None:
        fut = out.call
        if fut is not None:
            fut.cancel()  # reset the stream first, so the receiver never sees a clean end
        out.queue.put(STOP_ITEM)

    def _close_transport(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel, _ in channels:
            channel.close()

    # -- per-transfer thread -------------------------------------------------------------
    def _run(self, out: Outgoing) -> None:
        try:
            fut = self._push_call(out.peer).future(self._frames(out))
            out.call = fut
            if out.done:
                fut.cancel()
            while True:
                try:
                    reply = fut.result(timeout=self._tick(out))
                except grpc.FutureTimeoutError:
                    idle = time.monotonic() - out.last_progress
                    if idle >= self.config.stall_timeout_s:
                        self._fail(out, f"no progress for {idle:.1f}s while {out.phase}")
                    continue
                except grpc.FutureCancelledError:
                    self._complete(out, False, out.error or "cancelled", 0)
                    return
                except grpc.RpcError as e:
                    self._complete(out, False, out.error or rpc_error_text(e), 0)
                    return
                tid, ok, error, nbytes = frames.decode_ack(reply)
                if ok and (tid != out.spec.transfer_id or nbytes != out.spec.total_nbytes):
                    ok, error = False, f"receiver acked {tid!r} with {nbytes} bytes"
                self._complete(out, ok, error, nbytes if ok else 0)
                return
        except Exception as e:  # never let a sender thread die silently
            logger.exception("KV sender thread for %s failed", out.spec.transfer_id)
            self._complete(out, False, f"sender error: {e}", 0)
        finally:
            self._drain(out)

    def _drain(self, out: Outgoing) -> None:
        while True:
            try:
                self._release_item(out.queue.get_nowait())
            except queue.Empty:
                return

    def _tick(self, out: Outgoing) -> float:
        left = self.config.stall_timeout_s - (time.monotonic() - out.last_progress)
        return max(left, 0.05)  # progress moves the deadline: re-check then

    def _frames(self, out: Outgoing) -> Iterator[bytes]:
        """The request stream; runs on gRPC's consumer thread, one frame per write."""
        spec, chunk_bytes = out.spec, self.config.chunk_bytes
        out.first_send_ts = out.last_progress = time.monotonic()
        yield frames.encode_header(self.identity, spec)
        chunks = 0
        while True:
            out.phase = "waiting for layers"
            item = out.queue.get()
            if item == STOP_ITEM or out.done:
                self._release_item(item)
                return
            out.last_progress = time.monotonic()
            if item == END_ITEM:
                out.phase = "waiting for the receiver's ack"
                body = {"chunks": chunks, "nbytes": spec.total_nbytes}
                yield frames.encode_control(FrameKind.END, body)
                return
            layer_idx, tensor, event = item
            try:
                view = frames.byte_view(host_tensor(tensor, event))
                out.phase = f"sending layer {layer_idx}"
                for idx, offset, n in frames.chunk_ranges(len(view), chunk_bytes):
                    frame = frames.encode_data(layer_idx, idx, offset, view[offset : offset + n])
                    if out.corrupt:  # fault injection: damage the payload after its crc
                        out.corrupt, frame = False, frame[:-1] + bytes([frame[-1] ^ 0xFF])
                    yield frame
                    out.last_progress = time.monotonic()
                    chunks += 1
            except Exception as e:  # a bad tensor fails this transfer, nothing else
                self._fail(out, f"cannot encode layer {layer_idx}: {e}")
                return
            finally:
                self._release_item(item)


class GrpcKVReceiver(KVReceiver):
    """KVReceiver serving the Push method; subclasses add methods via `_methods()`."""

    def __init__(
        self, identity: PeerIdentity, config: TransportConfig, host: str, port: int
    ) -> None:
        self.identity, self.config = identity, config
        self.table = StagingTable(identity, config)
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=config.max_streams, thread_name_prefix="kv-recv"),
            handlers=[grpc.method_handlers_generic_handler(SERVICE, self._methods())],
            options=server_options(config),
            maximum_concurrent_rpcs=config.max_streams,
        )
        bracketed = f"[{host}]" if ":" in host and not host.startswith("[") else host
        bound = self._server.add_insecure_port(f"{bracketed}:{port}")
        if not bound:
            raise OSError(f"cannot bind KV receiver to {bracketed}:{port}")
        self.address = f"{bracketed}:{bound}"
        self._stop = threading.Event()
        self._server.start()
        self._reaper = threading.Thread(target=self._reap, name="kv-reaper", daemon=True)
        self._reaper.start()
        logger.info("KV receiver %s listening on %s", identity.worker_id, self.address)

    def _methods(self) -> dict[str, grpc.RpcMethodHandler]:
        return {"Push": grpc.stream_unary_rpc_method_handler(self._push)}

    def _reap(self) -> None:
        delay = 0.1
        while not self._stop.wait(delay):  # sleeps until the next stall or lease is due
            delay = self.table.sweep()

    # -- KVReceiver ----------------------------------------------------------------------
    def state(self, transfer_id: str) -> ReceiveState:
        return self.table.state(transfer_id)

    def error(self, transfer_id: str) -> str | None:
        return self.table.error(transfer_id)

    def take(self, transfer_id: str) -> ReceivedKV | None:
        return self.table.take(transfer_id)

    def discard(self, transfer_id: str) -> None:
        self.table.discard(transfer_id)

    def release(self, kv: ReceivedKV) -> None:
        self.table.release(kv)

    def wait(self, transfer_id: str, timeout: float) -> ReceiveState:
        """Block until COMPLETE or FAILED, or `timeout` passes (for tools and tests)."""
        return self.table.wait(transfer_id, timeout)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._server.stop(grace=0.5).wait()
        self.table.clear()

    # -- the Push handler ----------------------------------------------------------------
    def _push(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        st: Staged | None = None
        peer = context.peer()
        try:
            first = next(requests, None)
            if first is None:
                code, reason = grpc.StatusCode.INVALID_ARGUMENT, "empty stream: no header"
            else:
                frame = frames.decode_frame(first)
                if not (isinstance(frame, ControlFrame) and frame.kind is FrameKind.HEADER):
                    kind = "DATA" if isinstance(frame, DataFrame) else frame.kind.name
                    code = grpc.StatusCode.INVALID_ARGUMENT
                    reason = f"{kind} frame before any header: unknown transfer"
                else:
                    sender, spec = frames.decode_header(frame.body)
                    st = self.table.open(sender, spec, on_stall=context.cancel)
                    return self._receive(st, requests)
        except Refused as e:
            code, reason = grpc.StatusCode.FAILED_PRECONDITION, f"refused: {e}"
        except TransferFault as e:
            code = grpc.StatusCode.DATA_LOSS if e.data_loss else grpc.StatusCode.INVALID_ARGUMENT
            reason = str(e)
        except FrameError as e:
            code, reason = grpc.StatusCode.INVALID_ARGUMENT, f"malformed frame: {e}"
        except grpc.RpcError:
            code, reason = grpc.StatusCode.CANCELLED, "stream dropped: sender gone or cancelled"
        except Exception as e:
            logger.exception("KV receive from %s failed unexpectedly", peer)
            code, reason = grpc.StatusCode.INTERNAL, f"receiver error: {e}"
        if st is not None:
            self.table.fail(st, reason)
        else:
            logger.warning("KV stream from %s rejected: %s", peer, reason)
        context.abort(code, reason)
        raise AssertionError("unreachable: abort raises")

    def _receive(self, st: Staged, requests: Iterator[bytes]) -> bytes:
        for raw in requests:
            frame = frames.decode_frame(raw)
            if isinstance(frame, DataFrame):
                self.table.write_chunk(st, frame)
                continue
            if frame.kind is FrameKind.END:
                chunks = frames.field(frame.body, "chunks", int)
                nbytes = frames.field(frame.body, "nbytes", int)
                got = self.table.finish(st, chunks, nbytes)
                return frames.encode_ack(st.spec.transfer_id, True, None, got)
            raise TransferFault(f"unexpected {frame.kind.name} frame inside a transfer")
        # A killed sender often shows up as a plain end of stream rather than an error.
        raise TransferFault(
            "truncated: stream ended before the end frame (sender closed it or vanished)",
            data_loss=True,
        )
