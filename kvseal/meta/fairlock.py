"""The MetaServer's FairLock: a MemoryStore is used under one lock, and that lock is FIFO (a waiting request goes
before the holder's next step), so a large batch applied in steps (kvseal.meta.service) hands it over between
steps instead of starving the small requests (heartbeats, lookups) that wait. Every hold is measured
(kvseal_meta_lock_hold_seconds, kvseal_meta_lock_hold_max_seconds)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable


class FairLock:
    """A FIFO lock that measures its holds: a releasing holder hands it to the longest waiter, so a thread applying
    a batch in steps cannot take it straight back while a small request waits."""

    def __init__(self, on_hold: Callable[[float], None] = lambda seconds: None) -> None:
        self._mutex = threading.Lock()
        self._waiters: deque[threading.Lock] = deque()
        self._held = False
        self._since = 0.0
        self._on_hold = on_hold
        self.longest_s = 0.0  # the longest hold since start

    def acquire(self) -> None:
        with self._mutex:
            if not self._held:
                self._held = True
                self._since = time.perf_counter()
                return
            waiter = threading.Lock()
            waiter.acquire()
            self._waiters.append(waiter)
        waiter.acquire()  # released by the holder that hands the lock over
        self._since = time.perf_counter()

    def release(self) -> None:
        held_s = time.perf_counter() - self._since
        with self._mutex:
            self.longest_s = max(self.longest_s, held_s)
            if self._waiters:
                self._waiters.popleft().release()
            else:
                self._held = False
        self._on_hold(held_s)

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
