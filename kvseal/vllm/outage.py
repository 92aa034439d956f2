"""What the connector does while its kvseal engine is unreachable: it keeps inference going without the cache.

Every engine call fails soft (no hit, no save), each within its deadline (`kvseal.timeout_s`). After a failure the
connectors of a process skip engine calls for 1 s, doubling with every further failure up to 30 s (reset by a
success), so a stopped or wedged engine costs one deadline per interval, not one per step. A warning is logged once
per outage, and one line when the engine is back.

Not every error is an outage: an engine that answers "this instance's workers are not (all) registered yet" or "I
do not know this worker" works. Telling them apart (by the error's class) is done here, in `Outage.on_query_error`,
`Outage.on_release_error` and `Outage.on_worker_error`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvseal.errors import DeadlineExceeded, FailedPrecondition, KvsealError, NotFound, PermissionDenied, Unavailable

log = logging.getLogger("kvseal.vllm")
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0

# answers of an engine that works, about the state of this instance: not an outage
INCOMPLETE = FailedPrecondition  # registration incomplete: other workers are not in yet
NOT_REGISTERED = (NotFound, PermissionDenied)  # the engine does not (or no longer) know this worker
UNREACHABLE = (Unavailable, DeadlineExceeded)  # no answer at all


class Outage:
    """The state of one engine target as the connectors of a process see it (scheduler and worker sides live in one
    process when vLLM runs without multiprocessing): logs one warning per outage and one line when the engine is
    back, and paces engine calls during an outage. After a failure no call is made for `backoff_s` seconds (1 s,
    doubling with each further failure up to 30 s; a success resets it), so a wedged engine, where every call waits
    out its deadline, costs one deadline per interval instead of one per step."""

    _by_target: dict[str, Outage] = {}

    @classmethod
    def of(cls, target: str) -> Outage:
        """The one Outage of `target` in this process, shared by every connector that calls it."""
        return cls._by_target.setdefault(target, cls(target))

    def __init__(self, target: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.target = target
        self.down = False
        self.backoff_s = 0.0  # 0 while the engine answers
        self.resume_at = 0.0
        self._clock = clock

    def allows_call(self) -> bool:
        return self._clock() >= self.resume_at

    def failed(self, what: str, error: Exception) -> None:
        if not self.down:
            log.warning(
                "kvseal engine at %s unavailable (%s: %s): continuing without the cache", self.target, what, error
            )
            self.down = True
        self.backoff_s = min(2 * self.backoff_s, BACKOFF_MAX_S) if self.backoff_s else BACKOFF_FIRST_S
        self.resume_at = self._clock() + self.backoff_s

    def ok(self) -> None:
        if self.down:
            log.warning("kvseal engine at %s is back", self.target)
            self.down = False
        self.backoff_s = 0.0
        self.resume_at = 0.0

    # ---------------------------------------------------------------- errors that are answers, not outages

    def on_query_error(self, error: KvsealError) -> None:
        """A scheduler's Query failed. The engine answering that the instance's workers are not (all) in yet is
        no outage."""
        if isinstance(error, INCOMPLETE | NotFound):
            self.ok()
        else:
            self.failed("query", error)

    def on_release_error(self, error: KvsealError) -> None:
        """A Release failed. Only no answer is an outage; otherwise the lease expired or the engine restarted: it is
        gone either way."""
        if isinstance(error, UNREACHABLE):
            self.failed("release", error)

    def on_worker_error(self, what: str, error: KvsealError) -> bool:
        """A registered worker's data-path call (`what`: load, save) failed. Returns whether the engine no longer
        knows this worker's registration (the worker registers again); that, and other workers not being in yet,
        are no outage."""
        if isinstance(error, NOT_REGISTERED):
            self.ok()
            return True
        if isinstance(error, INCOMPLETE):
            self.ok()
        else:
            self.failed(what, error)
        return False
