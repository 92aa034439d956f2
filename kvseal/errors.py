"""The error hierarchy. Each class carries the gRPC status it maps to; the mapping happens in one place
(kvseal.server.grpc_service). Messages name the field at fault and, where there is one, the fix.

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


class AlreadyExists(KvsealError):
    """What the request would take is held by someone else: a MetaServer node id that another live session holds."""

    status = "ALREADY_EXISTS"


QUOTE_CHARS = 32  # of a client's value quoted in an error message


def quote(value: object) -> str:
    """A client's value for an error message: its repr, cut to about QUOTE_CHARS characters (bytes for bytes), with
    the full length said when cut, so a huge field never makes a huge message (gRPC drops details past its metadata
    limit, and the client would see that instead of the field's name)."""
    if isinstance(value, str | bytes | bytearray):
        text, cut = repr(value[:QUOTE_CHARS]), len(value) > QUOTE_CHARS
        size = f"{len(value)} {'characters' if isinstance(value, str) else 'bytes'}"
    else:
        text, cut, size = repr(value), False, "cut"
    if len(text) > 3 * QUOTE_CHARS:  # escapes, or another type's long repr
        text, cut = text[: 3 * QUOTE_CHARS], True
    return f"{text}... ({size})" if cut else text
