"""The engine lock, timed: how long each hold lasted, as a histogram, and the longest hold with where it happened.

Every hold is timed (two perf_counter_ns calls and a bisect, ~0.3 µs); the bookkeeping happens while the lock is
still held, so the counts need no lock of their own. The longest hold names the function that held it (looked up
only when a new longest hold is seen, which is rare), so /metrics says which critical section to look at.
"""

from __future__ import annotations

import sys
import threading
from bisect import bisect_left
from dataclasses import dataclass
from time import perf_counter_ns

# upper bounds of the histogram buckets, in seconds (the last bucket, +Inf, is implicit)
HOLD_BUCKETS = (10e-6, 100e-6, 1e-3, 5e-3, 10e-3, 50e-3, 100e-3, 1.0)
_BOUNDS_NS = tuple(round(b * 1e9) for b in HOLD_BUCKETS)


@dataclass(frozen=True, slots=True)
class LockStatistics:
    holds: int
    total_seconds: float
    bucket_counts: tuple[int, ...]  # per bucket of HOLD_BUCKETS, then +Inf (not cumulative)
    max_seconds: float
    max_where: str  # the function that held the lock longest ("" before the first hold)


class TimedLock:
    """A non-reentrant lock for `with` blocks that records how long it was held."""

    __slots__ = ("_lock", "_t0", "_counts", "_total_ns", "_max_ns", "_max_where")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._t0 = 0
        self._counts = [0] * (len(_BOUNDS_NS) + 1)
        self._total_ns = 0
        self._max_ns = 0
        self._max_where = ""

    def __enter__(self) -> None:
        self._lock.acquire()
        self._t0 = perf_counter_ns()

    def __exit__(self, *exc: object) -> None:
        held = perf_counter_ns() - self._t0
        self._counts[bisect_left(_BOUNDS_NS, held)] += 1
        self._total_ns += held
        if held > self._max_ns:
            self._max_ns = held
            frame = sys._getframe(1)
            self._max_where = f"{frame.f_code.co_name}:{frame.f_lineno}"
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def statistics(self) -> LockStatistics:
        """A snapshot (taken without the lock: each field is read atomically, together they may be one hold
        apart)."""
        counts = tuple(self._counts)
        return LockStatistics(
            holds=sum(counts),
            total_seconds=self._total_ns / 1e9,
            bucket_counts=counts,
            max_seconds=self._max_ns / 1e9,
            max_where=self._max_where,
        )
