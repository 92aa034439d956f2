"""The error hierarchy and the one status table every adapter answers from.

Each class carries the status it maps to. `STATUSES` says what that status is on each wire: its gRPC code (which
is also the lane's status byte) and its HTTP code. `translate()` turns any exception raised under an adapter into
the status and message to answer; the gRPC servicers (kvseal.rpc), the lane, the HTTP endpoints and the router all
call it, and clients turn a status back into its class with `error_for_status()` / `error_for_code()`. Callers
catch classes, never compare status names.

Expected outcomes (a miss, a refused load, a full pool) are values, not exceptions.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Status:
    name: str  # grpc.StatusCode's name
    code: int  # grpc.StatusCode's value; the lane's status byte
    http: int  # what an HTTP endpoint answers


STATUSES: dict[str, Status] = {
    s.name: s
    for s in (
        Status("OK", 0, 200),
        Status("CANCELLED", 1, 499),
        Status("UNKNOWN", 2, 500),
        Status("INVALID_ARGUMENT", 3, 400),
        Status("DEADLINE_EXCEEDED", 4, 504),
        Status("NOT_FOUND", 5, 404),
        Status("ALREADY_EXISTS", 6, 409),
        Status("PERMISSION_DENIED", 7, 403),
        Status("RESOURCE_EXHAUSTED", 8, 429),
        Status("FAILED_PRECONDITION", 9, 409),
        Status("ABORTED", 10, 409),
        Status("OUT_OF_RANGE", 11, 400),
        Status("UNIMPLEMENTED", 12, 501),
        Status("INTERNAL", 13, 500),
        Status("UNAVAILABLE", 14, 503),
        Status("DATA_LOSS", 15, 500),
        Status("UNAUTHENTICATED", 16, 401),
    )
}
STATUS_OF_CODE: dict[int, Status] = {s.code: s for s in STATUSES.values()}
MAX_MESSAGE_CHARS = 1024  # an error message is cut there (gRPC carries it in a trailer, whose size has a hard limit)


class KvsealError(Exception):
    """Base class. `status` names the row of STATUSES an adapter answers with; `http`, when set on an instance,
    overrides the table's HTTP code (the router's gateway answers)."""

    status = "INTERNAL"
    http: int | None = None

    @property
    def http_status(self) -> int:
        return self.http if self.http is not None else STATUSES[self.status].http


class InvalidArgument(KvsealError):
    """The request itself is malformed: a field is missing, out of range or inconsistent with another field."""

    status = "INVALID_ARGUMENT"


class FailedPrecondition(KvsealError):
    """The request is well formed but the engine's state does not allow it (not sealed yet, layout conflict)."""

    status = "FAILED_PRECONDITION"


class NotFound(KvsealError):
    """The request names an instance, worker or lease the engine does not know."""

    status = "NOT_FOUND"


class AlreadyExists(KvsealError):
    """What the request would take is held by someone else: a MetaServer node id that another live session holds."""

    status = "ALREADY_EXISTS"


class PermissionDenied(KvsealError):
    """The caller is known but may not act on what it names: another session's worker, another user's instance."""

    status = "PERMISSION_DENIED"


class ResourceExhausted(KvsealError):
    """The engine cannot hold what is asked (a page larger than the pool, a MetaServer cap)."""

    status = "RESOURCE_EXHAUSTED"


class Unauthenticated(KvsealError):
    """The caller did not prove who it is (a missing or wrong bearer token)."""

    status = "UNAUTHENTICATED"


class Unavailable(KvsealError):
    """Something this side depends on cannot be reached: the engine (client side), the MetaServer's store."""

    status = "UNAVAILABLE"


class DeadlineExceeded(KvsealError):
    """No answer came within the caller's deadline."""

    status = "DEADLINE_EXCEEDED"


class ConfigError(InvalidArgument, ValueError):
    """A configuration that cannot run anywhere: a usage error. The message starts with the flag at fault."""


class DataLoss(KvsealError):
    """Stored bytes are not what was written (a torn or foreign SSD segment)."""

    status = "DATA_LOSS"


_CLASSES: dict[str, type[KvsealError]] = {
    cls.status: cls
    for cls in (
        InvalidArgument,
        FailedPrecondition,
        NotFound,
        AlreadyExists,
        PermissionDenied,
        ResourceExhausted,
        Unauthenticated,
        Unavailable,
        DeadlineExceeded,
        DataLoss,
    )
}


def error_for_status(status: str, message: str) -> KvsealError:
    """The exception a client raises for a status name (a gRPC status's name)."""
    cls = _CLASSES.get(status)
    return cls(message) if cls is not None else KvsealError(f"{status}: {message}")


def error_for_code(code: int, message: str) -> KvsealError:
    """The exception a client raises for a status code (the lane's status byte, a gRPC status's value)."""
    status = STATUS_OF_CODE.get(code)
    return error_for_status(status.name if status is not None else "INTERNAL", message)


def bounded(message: str) -> str:
    """`message` cut to MAX_MESSAGE_CHARS (client values in it are quoted already: quote())."""
    return message if len(message) <= MAX_MESSAGE_CHARS else message[:MAX_MESSAGE_CHARS] + "…"


def translate(error: BaseException, failed: str) -> tuple[Status, str]:
    """The status and message an adapter answers for `error`: a KvsealError answers its own status and message;
    anything else is a bug, INTERNAL, after `failed` (what failed where: "Query failed inside the engine").
    Messages are bounded."""
    if isinstance(error, KvsealError):
        return STATUSES.get(error.status, STATUSES["INTERNAL"]), bounded(str(error))
    return STATUSES["INTERNAL"], bounded(f"{failed}: {type(error).__name__}: {error}")


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


def did_you_mean(key: str, valid: Iterable[str], prefix: str = "") -> str:
    """' (did you mean 'KEY'?)' naming the known key closest to a misspelled `key` (difflib's), or '' when none is
    close: for an error that refuses an unknown key. A `prefix` that every key shares is left out of the likeness
    (else 'kvseal.xyzzy' is close to every 'kvseal.' key)."""
    names = {name.removeprefix(prefix): name for name in valid}
    close = difflib.get_close_matches(key.removeprefix(prefix), list(names), n=1)
    return f" (did you mean {names[close[0]]!r}?)" if close else ""
