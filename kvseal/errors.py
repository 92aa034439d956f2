"""The error hierarchy. Each class carries the gRPC status it maps to; the mapping happens in one place
(kvseal.server.service). Messages name the field at fault and, where there is one, the fix.

Expected outcomes (a miss, a refused load, a full pool) are values, not exceptions.
"""

from __future__ import annotations


class KvsealError(Exception):
    """Base class. `status` is the name of the grpc.StatusCode the server answers with."""

    status = "INTERNAL"


class InvalidArgument(KvsealError):
    """The request itself is malformed: a field is missing, out of range or inconsistent with another field."""

    status = "INVALID_ARGUMENT"


class FailedPrecondition(KvsealError):
    """The request is well formed but the engine's state does not allow it (not sealed yet, layout conflict)."""

    status = "FAILED_PRECONDITION"


class NotFound(KvsealError):
    """The request names an instance, worker or lease the engine does not know."""

    status = "NOT_FOUND"


class PermissionDenied(KvsealError):
    """The caller is known but may not act on what it names: another session's worker, another user's instance."""

    status = "PERMISSION_DENIED"


class ResourceExhausted(KvsealError):
    """The engine cannot hold what is asked (a page larger than the pool)."""

    status = "RESOURCE_EXHAUSTED"


class Unauthenticated(KvsealError):
    status = "UNAUTHENTICATED"


class Unavailable(KvsealError):
    """The engine cannot be reached (client side)."""

    status = "UNAVAILABLE"


class DeadlineExceeded(KvsealError):
    status = "DEADLINE_EXCEEDED"


def error_for_status(status: str, message: str) -> KvsealError:
    """The exception a client raises for a gRPC status name."""
    for cls in (
        InvalidArgument,
        FailedPrecondition,
        NotFound,
        PermissionDenied,
        ResourceExhausted,
        Unauthenticated,
        Unavailable,
        DeadlineExceeded,
    ):
        if cls.status == status:
            return cls(message)
    err = KvsealError(f"{status}: {message}")
    return err
