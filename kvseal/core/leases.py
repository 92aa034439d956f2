"""Leases: a query's hits pinned for the workers that will load them.

A lease holds a pin on each of its pages (the store pins them when it opens the lease) and ends when every worker
consumed its share, when its owner releases it (or unregisters), or at its deadline. This module keeps the books
only: every way a lease ends returns the Lease, and the store unpins its pages (pages.py writes pin counts).
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass


@dataclass(slots=True)
class Lease:
    lease_id: int
    owner: str  # instance id
    pages: tuple[int, ...]
    shares: int
    consumed: set[tuple[int, int]]
    deadline: float
    mixed: bool = False  # pages of several size classes (a hybrid query's groups): unpinned class by class


class Leases:
    def __init__(self) -> None:
        self._leases: dict[int, Lease] = {}
        self._heap: list[tuple[float, int]] = []  # (deadline, lease id); ended leases stay until popped
        self._owners: dict[str, set[int]] = {}
        self._next_id = 1
        self.expired = 0  # leases ended by their deadline

    def __len__(self) -> int:
        return len(self._leases)

    def open(self, owner: str, pages: tuple[int, ...], shares: int, deadline: float, mixed: bool = False) -> int:
        """A new lease over pages the caller pinned. Returns its id (never 0)."""
        lease_id = self._next_id
        self._next_id += 1
        self._leases[lease_id] = Lease(lease_id, owner, pages, shares, set(), deadline, mixed)
        heapq.heappush(self._heap, (deadline, lease_id))
        self._owners.setdefault(owner, set()).add(lease_id)
        return lease_id

    def get(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    def end(self, lease: Lease) -> Lease:
        """Ends an open lease. Returns it: the caller unpins its pages."""
        del self._leases[lease.lease_id]
        owned = self._owners.get(lease.owner)
        if owned is not None:
            owned.discard(lease.lease_id)
            if not owned:
                del self._owners[lease.owner]
        return lease

    def end_owner(self, owner: str) -> list[Lease]:
        """Ends every lease of an instance; returns them, for the caller to unpin in this order."""
        ids = self._owners.pop(owner, set())
        return [self.end(self._leases[lease_id]) for lease_id in ids]

    def consume(self, lease_id: int, worker_key: tuple[int, int]) -> Lease | None:
        """A worker loaded its share of the lease (a worker counts once). Returns the lease if that was the last
        share (it has ended: the caller unpins it), else None; None too for a lease that is not open."""
        lease = self._leases.get(lease_id) if lease_id else None
        if lease is None:
            return None
        lease.consumed.add(worker_key)
        return self.end(lease) if len(lease.consumed) >= lease.shares else None

    def expire(self, now: float) -> list[Lease]:
        """Ends the leases whose deadline is at or before `now`; returns them in deadline order, to unpin."""
        out = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, lease_id = heapq.heappop(heap)
            lease = self._leases.get(lease_id)
            if lease is not None:
                out.append(self.end(lease))
                self.expired += 1
        return out

    def pins(self) -> Counter[int]:
        """The pins the open leases hold, per page (for the store's invariant checks)."""
        return Counter(pid for lease in self._leases.values() for pid in lease.pages)
