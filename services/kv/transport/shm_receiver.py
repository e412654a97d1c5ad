"""The receiving side of the same-host transport: the Shm method of a KV receiver.

One bidirectional stream per transfer, on the receiver's one gRPC server (so the decode
worker keeps one `kv_address`): HEADER -> SEGMENT {name, nbytes} (a segment from the
receiver's `SegmentPool`, which the transfer's staged layers are views of; `batches`
says this receiver takes several layers per LAYER frame), then LAYER {layers: [[layer,
nbytes, checksum], ...]} announcing the layers the sender has copied into the segment
since its previous LAYER frame (or the one-layer form {transfer_id, layer, nbytes,
checksum} of senders that predate `batches`), then END -> ACK. The receiver verifies
each layer's checksum over the segment (native code, GIL released) and never copies the
payload: the connector's copy into the paged cache is the one copy out. Any failure ends
the stream with a status.

A receiver on a GPU (`DeviceSlabs`, see `cuda_ipc`) lends a slab of device memory
instead, to a sender whose HEADER says `cuda_ipc: true`: SEGMENT then carries the slab's
CUDA IPC handle {cuda_ipc: {...}, checksum: "sum64", nbytes, batches}, and each layer is
verified on the GPU with `cuda_ipc.device_digest`. Other senders get a host segment, and
so does an offer the device staging has no room for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import torch

from services.kv.transport import checksum, cuda_ipc, frames
from services.kv.transport.frames import ControlFrame, FrameError, FrameKind
from services.kv.transport.shm_segments import SegmentPool
from services.kv.transport.staging import (
    NoStagingMemory,
    Staged,
    StagingTable,
    TransferFault,
    stream_failure,
)

logger = logging.getLogger(__name__)


class ShmInbound:
    """Serves Shm streams into `table`, staging in segments of `segments`."""

    batches = True  # offered in SEGMENT: several layers per LAYER frame are taken

    def __init__(
        self,
        table: StagingTable,
        segments: SegmentPool,
        first_frame: Callable[[Iterator[bytes], grpc.ServicerContext], bytes | None],
        device_slabs: cuda_ipc.DeviceSlabs | None = None,
    ) -> None:
        self.table, self.segments, self.first_frame = table, segments, first_frame
        self.device_slabs = device_slabs
        self._told_full = False  # warned once that device staging was full

    def handle(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        st: Staged | None = None
        try:
            first = self.first_frame(requests, context)
            frame = frames.decode_frame(first) if first is not None else None
            if not isinstance(frame, ControlFrame) or frame.kind is not FrameKind.HEADER:
                raise FrameError("a shm stream must start with HEADER")
            sender, spec, algorithm = frames.decode_header(frame.body)
            lender: SegmentPool | cuda_ipc.DeviceSlabs = self.segments
            st = None
            if self.device_slabs is not None and frame.body.get("cuda_ipc") is True:
                try:
                    st = self.table.open(sender, spec, algorithm, context.cancel,
                                         self.device_slabs)
                    lender = self.device_slabs
                except NoStagingMemory as e:  # GPU full: this one goes through the host
                    level = logging.DEBUG if self._told_full else logging.WARNING
                    self._told_full = True
                    logger.log(level, "KV transfer %s staged in host memory, not on the GPU "
                               "(later ones are logged at debug level): %s",
                               spec.transfer_id, e)
            if st is None:
                st = self.table.open(sender, spec, algorithm, context.cancel, lender)
            assert st.slab is not None
            body = {**lender.describe(st.slab), "nbytes": spec.total_nbytes,
                    "batches": self.batches}
            yield frames.encode_control(FrameKind.SEGMENT, body)
            for raw in requests:
                frame = frames.decode_frame(raw)
                if not isinstance(frame, ControlFrame):
                    raise FrameError("DATA frames do not belong on a shm stream")
                if frame.kind is FrameKind.LAYER:
                    self._verify_all(st, frame.body)
                elif frame.kind is FrameKind.END:
                    chunks = frames.field(frame.body, "chunks", int)
                    nbytes = frames.field(frame.body, "nbytes", int)
                    got = self.table.finish(st, chunks, nbytes)
                    yield frames.encode_ack(spec.transfer_id, True, None, got)
                    return
                else:
                    raise FrameError(f"unexpected {frame.kind.name} frame on a shm stream")
            self.table.check_live(st)  # released mid-way: the sender hears that, not "truncated"
            raise TransferFault("truncated: stream ended before the end frame", data_loss=True)
        except Exception as e:
            failure = stream_failure(e)
            if failure is None:
                raise
            code, reason = failure
        self.table.fail(st, reason)
        context.abort(code, reason)

    def _verify_all(self, st: Staged, body: dict[str, Any]) -> None:
        if "layers" not in body:
            fields = [frames.field(body, k, int) for k in ("layer", "nbytes", "checksum")]
            self._verify(st, *fields)
            return
        announced = frames.field(body, "layers", list)
        if not announced or len(announced) > st.spec.num_layers:
            raise FrameError(f"LAYER frame announces {len(announced)} layers")
        for entry in announced:
            if not (isinstance(entry, list) and len(entry) == 3
                    and all(type(x) is int for x in entry)):
                raise FrameError("a LAYER entry must be [layer, nbytes, checksum] (ints)")
            self._verify(st, *entry)

    def _verify(self, st: Staged, layer: int, nbytes: int, value: int) -> None:
        buf = self.table.layer_buffer(st, layer, nbytes)
        t0 = time.perf_counter()
        intact = _digest(st.checksum, buf) == value
        checksum_s = time.perf_counter() - t0
        if not intact:
            raise TransferFault(f"checksum mismatch in layer {layer}", data_loss=True)
        self.table.layer_received(st, layer, checksum_s)


def _digest(algorithm: str, buf: torch.Tensor) -> int:
    """The header's algorithm over a host segment; the GPU's digest over a device slab."""
    if buf.is_cuda:
        return cuda_ipc.device_digest(buf)
    return checksum.digest(algorithm, frames.byte_view(buf))
