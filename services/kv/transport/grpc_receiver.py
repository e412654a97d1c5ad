"""Receiver of the KV transports: a gRPC server whose handlers verify each frame and copy
its payload straight into the transfer's staging buffers (`staging.StagingTable`).

Failures end the call with a status (FAILED_PRECONDITION for a refused peer, DATA_LOSS
for corrupt or missing bytes, INVALID_ARGUMENT for protocol violations); success returns
one ACK frame. Subclasses add methods through `_methods()` (the torch transport's Pair).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from services.kv.fingerprint import PeerIdentity
from services.kv.transport import frames, shm_segments
from services.kv.transport.base import KVReceiver
from services.kv.transport.cuda_ipc import DeviceSlabs
from services.kv.transport.frames import ControlFrame, DataFrame, FrameKind
from services.kv.transport.grpc_channel import SERVICE, bind, server_options
from services.kv.transport.heap import keep_frames_on_heap
from services.kv.transport.shm_receiver import ShmInbound
from services.kv.transport.shm_segments import SegmentPool
from services.kv.transport.spec import ReceivedKV, ReceiveState, TransportConfig
from services.kv.transport.staging import Staged, StagingTable, TransferFault, stream_failure

logger = logging.getLogger(__name__)


class GrpcKVReceiver(KVReceiver):
    """KVReceiver serving the Push method; subclasses add methods via `_methods()`."""

    def __init__(
        self, identity: PeerIdentity, config: TransportConfig, host: str, port: int
    ) -> None:
        self.identity, self.config = identity, config
        keep_frames_on_heap()
        self.table = StagingTable(identity, config)
        # Same-host senders write into shared segments (the Shm method); off by config,
        # or where /dev/shm is missing, and then such senders fall back to the network.
        self.segments: SegmentPool | None = None
        self.device_slabs: DeviceSlabs | None = None  # same-host GPU senders (CUDA IPC)
        if config.shm and shm_segments.available():
            self.segments = SegmentPool(config.pool_bytes)
            if config.ipc_device:
                self.device_slabs = DeviceSlabs(torch.device(config.ipc_device),
                                                config.pool_bytes)
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=config.max_streams, thread_name_prefix="kv-recv"),
            handlers=[grpc.method_handlers_generic_handler(SERVICE, self._methods())],
            options=server_options(config),
            maximum_concurrent_rpcs=config.max_streams,
        )
        self.address = bind(self._server, host, port, config)
        self._stop = threading.Event()
        self._server.start()
        self._reaper = threading.Thread(target=self._reap, name="kv-reaper", daemon=True)
        self._reaper.start()
        logger.info("KV receiver %s listening on %s", identity.worker_id, self.address)

    def _methods(self) -> dict[str, grpc.RpcMethodHandler]:
        methods = {"Push": grpc.stream_unary_rpc_method_handler(self._push)}
        if self.segments is not None:
            shm = ShmInbound(self.table, self.segments, self.first_frame, self.device_slabs)
            methods["Shm"] = grpc.stream_stream_rpc_method_handler(shm.handle)
        return methods

    def first_frame(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes | None:
        """A stream's first frame, or None; a peer that sends nothing within
        `header_timeout_s` has its stream cancelled, so idle streams cannot hold the
        handler threads."""
        timer = threading.Timer(self.config.header_timeout_s, context.cancel)
        timer.start()
        try:
            return next(requests, None)
        finally:
            timer.cancel()

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

    def staged(self) -> tuple[int, int]:
        return self.table.staged()

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
        if self.segments is not None:
            self.segments.close()

    # -- the Push handler ----------------------------------------------------------------
    def _push(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        st: Staged | None = None
        peer = context.peer()
        try:
            first = self.first_frame(requests, context)
            if first is None:
                code, reason = grpc.StatusCode.INVALID_ARGUMENT, "empty stream: no header"
            else:
                frame = frames.decode_frame(first)
                if not (isinstance(frame, ControlFrame) and frame.kind is FrameKind.HEADER):
                    kind = "DATA" if isinstance(frame, DataFrame) else frame.kind.name
                    code = grpc.StatusCode.INVALID_ARGUMENT
                    reason = f"{kind} frame before any header: unknown transfer"
                else:
                    sender, spec, algorithm = frames.decode_header(frame.body)
                    st = self.table.open(sender, spec, algorithm, on_stall=context.cancel)
                    return self._receive(st, requests)
        except Exception as e:
            failure = stream_failure(e)
            if failure is None:
                logger.exception("KV receive from %s failed unexpectedly", peer)
                failure = grpc.StatusCode.INTERNAL, f"receiver error: {e}"
            code, reason = failure
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
        self.table.check_live(st)  # released mid-way: the sender hears that, not "truncated"
        # A killed sender often shows up as a plain end of stream rather than an error.
        raise TransferFault(
            "truncated: stream ended before the end frame (sender closed it or vanished)",
            data_loss=True,
        )
