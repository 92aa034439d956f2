"""What the MetaServer runs with (MetaConfig: its flags) and the store they name (open_store). Time is this
process's monotonic clock with the memory store and the wall clock with Redis (replicas on several machines must
agree on what "stale" means)."""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

from kvseal.errors import InvalidArgument, Unavailable, quote
from kvseal.meta.store import MemoryStore, MetaStore


@dataclass(frozen=True, slots=True)
class MetaConfig:
    listen: str = "127.0.0.1:50056"
    http_listen: str = "127.0.0.1:9092"
    store: str = "memory"  # or redis://HOST:PORT/DB
    stale_after_s: float = 10.0
    forget_after_s: float = 60.0
    token: str | None = None
    max_nodes: int = 4096
    max_blocks_per_node: int = 1 << 21
    max_blocks: int = 1 << 23  # every node's together (a MemoryStore needs ~0.6 KB per block)


def redacted(url: str) -> str:
    """A store URL without its password, for messages and logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def open_store(spec: str) -> tuple[MetaStore, Callable[[], float]]:
    """The store named by `spec` and the clock that goes with it."""
    if spec == "memory":
        return MemoryStore(), time.monotonic
    if spec.startswith("redis://"):
        from kvseal.meta.redis_store import RedisStore

        try:
            return RedisStore(spec), time.time
        except ConnectionError as e:
            if "closed by server" not in str(e):  # nothing listens there, or the name does not resolve
                parts = urllib.parse.urlsplit(spec)
                raise Unavailable(
                    f"cannot reach Redis at {redacted(spec)} (--store): {reason(e)}: start redis-server there (e.g. "
                    f"`redis-server --port {parts.port or 6379}`, from Debian's redis-server package), or pass "
                    "--store memory"
                ) from None
            answer: BaseException = e
        except Exception as e:  # something answered, but not as Redis does (an HTTP or SSH server, another port)
            answer = e
        raise Unavailable(
            f"{redacted(spec)} (--store) answers, but not as Redis does ({quote(reason(answer))}): point --store "
            "at a redis-server's port, or pass --store memory"
        )
    raise InvalidArgument(f"--store must be 'memory' or redis://HOST:PORT/DB, got {quote(spec)}")


def reason(e: BaseException) -> str:
    """The first line of an error, without redis' class-name prefixes."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.removeprefix("ConnectionError: ").removeprefix("TimeoutError: ").rstrip(".")
