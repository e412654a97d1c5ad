"""The one error model of pdserve.

Every refusal or failure that crosses a module boundary is a `PdserveError`. Its class
says what kind of failure it is (the client's fault, overload, a worker that broke, ...);
`grpc_status` and `http_status` map it to the answer each front end gives. Decisions
(retry, migrate, mark a worker suspect) read the class and its fields, never the text.

Where errors come from and what they become:

| raised as                 | gRPC                  | HTTP | counts against a worker |
| ---                       | ---                   | ---  | ---                     |
| `InvalidRequest`          | INVALID_ARGUMENT      | 400  | never                   |
| `Unauthenticated`         | UNAUTHENTICATED       | 401  | never                   |
| `PermissionDenied`        | PERMISSION_DENIED     | 403  | never                   |
| `ModelNotFound`           | NOT_FOUND             | 404  | never                   |
| `IncompatiblePair`        | FAILED_PRECONDITION   | 500  | never (a deployment bug)|
| `Overloaded`              | RESOURCE_EXHAUSTED    | 429  | never                   |
| `DeadlineExceeded`        | DEADLINE_EXCEEDED     | 504  | never                   |
| `Cancelled`               | CANCELLED             | 499  | never                   |
| `Aborted`                 | ABORTED               | 500  | no                      |
| `Unavailable`             | UNAVAILABLE           | 503  | no (nothing to serve)   |
| `EngineDead`              | UNAVAILABLE           | 503  | the engine's own worker |
| `WorkerFailure`           | UNAVAILABLE           | 503  | yes: `role`/`worker_id` |
| anything else             | INTERNAL              | 500  | logged with a traceback |
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

log = logging.getLogger(__name__)

RETRY_AFTER_KEY = "retry-after-ms"  # trailing metadata of RESOURCE_EXHAUSTED answers


class PdserveError(Exception):
    """Base of every error pdserve answers with a status. `message` names the field or
    the cause and says what to do; it is shown to the client as is."""

    status: grpc.StatusCode = grpc.StatusCode.INTERNAL
    http: int = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ClientError(PdserveError):
    """The request itself is at fault: answering it elsewhere gives the same answer, so
    it is never retried and never counts against the worker that found it."""


class InvalidRequest(ClientError):
    status, http = grpc.StatusCode.INVALID_ARGUMENT, 400


class Unauthenticated(ClientError):
    status, http = grpc.StatusCode.UNAUTHENTICATED, 401


class PermissionDenied(ClientError):
    status, http = grpc.StatusCode.PERMISSION_DENIED, 403


class ModelNotFound(ClientError):
    status, http = grpc.StatusCode.NOT_FOUND, 404


class DeadlineExceeded(ClientError):
    """The client's deadline passed (it chose it; another worker would miss it too)."""

    status, http = grpc.StatusCode.DEADLINE_EXCEEDED, 504


class Cancelled(ClientError):
    status, http = grpc.StatusCode.CANCELLED, 499


class IncompatiblePair(PdserveError):
    """A prefill and a decode worker whose KV layouts differ: KV is never shipped
    between them. A deployment mistake, not a worker failure."""

    status, http = grpc.StatusCode.FAILED_PRECONDITION, 500


class Overloaded(PdserveError):
    """No capacity now; the client should retry after `retry_after_ms`."""

    status, http = grpc.StatusCode.RESOURCE_EXHAUSTED, 429

    def __init__(self, message: str, retry_after_ms: int = 500) -> None:
        super().__init__(f"{message}; retry in {retry_after_ms} ms")
        self.retry_after_ms = retry_after_ms


class Aborted(PdserveError):
    """The engine ended the request without finishing it (it was aborted inside)."""

    status, http = grpc.StatusCode.ABORTED, 500


class Unavailable(PdserveError):
    """Nothing can serve the request now (no worker registered, the engine stopped)."""

    status, http = grpc.StatusCode.UNAVAILABLE, 503


class EngineDead(Unavailable):
    """This process's vLLM engine is gone: the worker must leave rotation."""


@dataclass(frozen=True, slots=True)
class FailedCall:
    """What the caller knows about a call to a worker that broke."""

    role: str  # "prefill" or "decode"
    worker_id: str
    code: grpc.StatusCode  # the status the worker's call ended with
    details: str


class WorkerFailure(Unavailable):
    """A worker broke while serving a request: a refused connection, a reset stream, a
    dead engine or an unexpected server error. The router decides from the fields
    whether to retry or migrate and which worker to take out of rotation."""

    def __init__(self, call: FailedCall, streamed: int = 0) -> None:
        super().__init__(f"{call.role} worker {call.worker_id or '?'} failed: "
                         f"{call.code.name}: {call.details}")
        self.role = call.role
        self.worker_id = call.worker_id
        self.code = call.code
        # Tokens of this request the client had already received when the worker broke.
        self.streamed = streamed


# Worker statuses that say "the request is wrong", not "the worker is broken".
_CLIENT_STATUSES: dict[grpc.StatusCode, type[PdserveError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: ModelNotFound,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.FAILED_PRECONDITION: IncompatiblePair,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
}


def from_worker_status(call: FailedCall, streamed: int = 0,
                       retry_after_ms: int = 500) -> PdserveError:
    """A worker call's status as the error the caller raises: the worker's client
    errors pass through unchanged (they are the client's), overload stays overload,
    and everything else is a `WorkerFailure` of that worker."""
    kind = _CLIENT_STATUSES.get(call.code)
    if kind is not None:
        return kind(call.details)
    if call.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Overloaded(f"{call.role} worker {call.worker_id}: {call.details}",
                          retry_after_ms)
    return WorkerFailure(call, streamed)


def grpc_status(e: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status a front end answers `e` with. Anything that is not a
    `PdserveError` is a bug: logged with its traceback, answered INTERNAL."""
    if isinstance(e, PdserveError):
        return e.status, e.message
    log.error("internal error", exc_info=e)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"


def http_status(e: BaseException) -> tuple[int, str]:
    """The HTTP status and message an HTTP front answers `e` with."""
    if isinstance(e, PdserveError):
        return e.http, e.message
    log.error("internal error", exc_info=e)
    return 500, f"internal error: {type(e).__name__}: {e}"


def retry_after_ms(e: BaseException) -> int | None:
    return e.retry_after_ms if isinstance(e, Overloaded) else None
