"""One error vocabulary for Ferry, mapped to gRPC status and to OpenAI error
JSON here and nowhere else."""

from __future__ import annotations

import enum

import grpc


class Code(enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    UNAUTHENTICATED = "unauthenticated"
    PERMISSION_DENIED = "permission_denied"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    TOO_LARGE = "request_too_large"
    FAILED_PRECONDITION = "failed_precondition"
    UNAVAILABLE = "unavailable"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    CLIENT_TIMEOUT = "client_timeout"  # the client was too slow to send its request
    ABORTED = "aborted"
    INTERNAL = "internal"


class FerryError(Exception):
    code: Code = Code.INTERNAL

    def __init__(self, message: str, *, param: str | None = None, code: Code | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class InvalidArgument(FerryError):
    code = Code.INVALID_ARGUMENT


class NotFound(FerryError):
    code = Code.NOT_FOUND


class Unauthenticated(FerryError):
    code = Code.UNAUTHENTICATED


class PermissionDenied(FerryError):
    """Authenticated (or anonymous), but not allowed to ask for this."""

    code = Code.PERMISSION_DENIED


class ResourceExhausted(FerryError):
    """Over a bound (requests in flight, queued work): try again later."""

    code = Code.RESOURCE_EXHAUSTED


class ClientTimeout(FerryError):
    code = Code.CLIENT_TIMEOUT


class TooLarge(FerryError):
    """The request itself is bigger than the server accepts."""

    code = Code.TOO_LARGE


class FailedPrecondition(FerryError):
    code = Code.FAILED_PRECONDITION


class Unavailable(FerryError):
    code = Code.UNAVAILABLE


class Aborted(FerryError):
    code = Code.ABORTED


_GRPC = {
    Code.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Code.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Code.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Code.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    Code.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Code.TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Code.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    Code.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Code.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    Code.CLIENT_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    Code.ABORTED: grpc.StatusCode.ABORTED,
    Code.INTERNAL: grpc.StatusCode.INTERNAL,
}
_FROM_GRPC = {v: k for k, v in _GRPC.items()}
_FROM_GRPC[grpc.StatusCode.RESOURCE_EXHAUSTED] = Code.RESOURCE_EXHAUSTED
_FROM_GRPC[grpc.StatusCode.DEADLINE_EXCEEDED] = Code.DEADLINE_EXCEEDED
_FROM_GRPC[grpc.StatusCode.CANCELLED] = Code.ABORTED

# HTTP status and OpenAI error "type" for each code.
_HTTP = {
    Code.INVALID_ARGUMENT: (400, "invalid_request_error"),
    Code.NOT_FOUND: (404, "not_found_error"),
    Code.UNAUTHENTICATED: (401, "authentication_error"),
    Code.PERMISSION_DENIED: (403, "permission_error"),
    Code.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    Code.TOO_LARGE: (413, "invalid_request_error"),
    Code.FAILED_PRECONDITION: (400, "invalid_request_error"),
    Code.UNAVAILABLE: (503, "service_unavailable_error"),
    Code.DEADLINE_EXCEEDED: (504, "timeout_error"),
    Code.CLIENT_TIMEOUT: (408, "timeout_error"),
    Code.ABORTED: (409, "aborted_error"),
    Code.INTERNAL: (500, "internal_error"),
}


def grpc_status(err: FerryError) -> grpc.StatusCode:
    return _GRPC[err.code]


def from_grpc(err: grpc.RpcError) -> FerryError:
    """A FerryError for a failed call (keeps the remote message)."""
    status = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    return FerryError(details or str(status), code=_FROM_GRPC.get(status, Code.INTERNAL))


async def abort_with(context: grpc.aio.ServicerContext, err: FerryError):
    """End a gRPC call with the status of ``err``."""
    await context.abort(grpc_status(err), err.message)


# How long a client told to come back later (429, 503) waits, in seconds.
RETRY_AFTER_S = 1


def openai_error(err: FerryError) -> tuple[int, dict]:
    """(HTTP status, OpenAI error JSON) for ``err``."""
    status, kind = _HTTP[err.code]
    return status, {
        "error": {"message": err.message, "type": kind, "param": err.param, "code": err.code.value}
    }


def openai_headers(err: FerryError) -> dict[str, str]:
    """The HTTP headers that go with ``err``'s response: ``Retry-After`` for
    what may succeed later (429 over a bound, 503 nothing can take it)."""
    if err.code in (Code.RESOURCE_EXHAUSTED, Code.UNAVAILABLE):
        return {"Retry-After": str(RETRY_AFTER_S)}
    return {}


def is_unavailable(err: grpc.RpcError | FerryError) -> bool:
    """The callee did not answer (down, or not in time), as a failed call or
    as a FerryError carried in a reply."""
    if isinstance(err, FerryError):
        return err.code in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED)
    code = err.code() if hasattr(err, "code") else None
    return code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
