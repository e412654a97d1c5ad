"""The status a KV receiver ends a stream with when receiving it failed: one mapping for
the gRPC and the shared-memory paths."""

from __future__ import annotations

import grpc

from services.kv.transport.frames import FrameError
from services.kv.transport.staged import Refused, TransferFault


def stream_failure(e: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status for `e`; None for an error that is not a transfer's fault (the
    receiver's own bug)."""
    if isinstance(e, Refused):
        return grpc.StatusCode.FAILED_PRECONDITION, f"refused: {e}"
    if isinstance(e, TransferFault):
        code = grpc.StatusCode.DATA_LOSS if e.data_loss else grpc.StatusCode.INVALID_ARGUMENT
        return code, str(e)
    if isinstance(e, FrameError):
        return grpc.StatusCode.INVALID_ARGUMENT, f"malformed frame: {e}"
    if isinstance(e, grpc.RpcError):
        return grpc.StatusCode.CANCELLED, "stream dropped: sender gone or cancelled"
    return None
