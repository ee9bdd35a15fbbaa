"""The error tree, and its one mapping to the wire.

Owns: the root exception, its few kinds, and their conversion to an HTTP status, a gRPC status
code, a Tinker failure category, and back from the bus. Does not own: deciding *when* something
is an error; each service raises the kind that fits.

Permanent errors reach the SDK as 400/404/422 with ``{"detail": ...}``: the SDK retries
408/409/429/5xx for minutes, so a permanent error must never use those codes. A full queue is a
429 (``Overloaded``).
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar


class Category(StrEnum):
    """Who is at fault, as the Tinker SDK's ``RequestFailedError.category`` spells it."""

    USER = "user"
    SERVER = "server"


class TinsmithError(Exception):
    """The root of every error tinsmith raises on purpose. ``detail`` is one clear sentence."""

    kind: ClassVar[str] = "internal"
    http_status: ClassVar[int] = 500
    grpc_code: ClassVar[str] = "INTERNAL"
    category: ClassVar[Category] = Category.SERVER

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class InvalidRequest(TinsmithError):
    """The request is malformed or asks for something that is not offered (HTTP 400)."""

    kind = "invalid_request"
    http_status = 400
    grpc_code = "INVALID_ARGUMENT"
    category = Category.USER


class Unauthenticated(TinsmithError):
    """The call carries no API key, or one that is not valid (unknown, malformed or revoked):
    HTTP 401, gRPC UNAUTHENTICATED. The SDK does not retry it."""

    kind = "unauthenticated"
    http_status = 401
    grpc_code = "UNAUTHENTICATED"
    category = Category.USER


class NotFound(TinsmithError):
    """The request names a session, run, sampler, future or checkpoint that does not exist."""

    kind = "not_found"
    http_status = 404
    grpc_code = "NOT_FOUND"
    category = Category.USER


class QuotaExceeded(TinsmithError):
    """The caller's tenant holds as much of something as its quota allows (runs, sessions,
    stored checkpoints): HTTP 403, gRPC RESOURCE_EXHAUSTED. Not retried: it frees up only when
    the tenant lets go of something, or the operator raises the quota."""

    kind = "quota_exceeded"
    http_status = 403
    grpc_code = "RESOURCE_EXHAUSTED"
    category = Category.USER


class Forbidden(TinsmithError):
    """The caller's key may not do this at all (an operator's view asked with a tenant's key):
    HTTP 403, gRPC PERMISSION_DENIED. Not retried."""

    kind = "forbidden"
    http_status = 403
    grpc_code = "PERMISSION_DENIED"
    category = Category.USER


class Unprocessable(TinsmithError):
    """Well-formed, but cannot be applied to the current state (HTTP 422)."""

    kind = "unprocessable"
    http_status = 422
    grpc_code = "FAILED_PRECONDITION"
    category = Category.USER


class Unavailable(TinsmithError):
    """A transient condition: a dependency is down or still starting. Retrying is right."""

    kind = "unavailable"
    http_status = 503
    grpc_code = "UNAVAILABLE"
    category = Category.SERVER


class Overloaded(TinsmithError):
    """Accepting more now would queue it past the bound: back off and send it again (HTTP 429,
    which the SDK answers by waiting and resubmitting, without raising)."""

    kind = "overloaded"
    http_status = 429
    grpc_code = "RESOURCE_EXHAUSTED"
    category = Category.SERVER


class TooLarge(TinsmithError):
    """The request is larger than one request may be (HTTP 413): it must be split, not sent
    again as it is."""

    kind = "too_large"
    http_status = 413
    grpc_code = "RESOURCE_EXHAUSTED"
    category = Category.USER


class Cancelled(TinsmithError):
    """The request was cancelled before it finished (its gRPC call was cancelled, or its deadline
    passed): it will never have a result. A repeat of it gets this again (HTTP 410, which the SDK
    does not retry); new work needs a new seq_id."""

    kind = "cancelled"
    http_status = 410
    grpc_code = "CANCELLED"
    category = Category.USER


class InternalError(TinsmithError):
    """A bug or an unexpected failure inside tinsmith."""


_KINDS: dict[str, type[TinsmithError]] = {
    cls.kind: cls
    for cls in (
        InvalidRequest,
        Unauthenticated,
        NotFound,
        QuotaExceeded,
        Forbidden,
        Unprocessable,
        Unavailable,
        Overloaded,
        TooLarge,
        Cancelled,
        InternalError,
    )
}


def from_kind(kind: str, detail: str) -> TinsmithError:
    """Rebuild an error that crossed the bus as ``(kind, detail)``."""
    return _KINDS.get(kind, InternalError)(detail)


def http_body(error: TinsmithError) -> dict[str, str]:
    """The JSON body of an HTTP error: FastAPI's convention, which the SDK's CLI parses."""
    return {"detail": error.detail}


def future_failure(kind: str, detail: str) -> dict[str, str]:
    """The JSON a failed future resolves to: the SDK raises ``RequestFailedError`` from it."""
    return {"error": detail, "category": from_kind(kind, detail).category.value}
