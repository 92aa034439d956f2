"""Eviction: which sealed pages stop holding their blocks, and the one way they do (`forget`).

The contract (vLLM kv_offload's): `evict(c, n, protected)` frees exactly n pages of size class c, none of them in
`protected`, or changes nothing and returns []. Only sealed unpinned pages can go: they are the ones in the class's
LRU ring (pages.py), so a page that is inflight, pinned by a lease, a load or an SSD write, is never evicted.

Three policies order each size class's ring (`EVICTION_POLICIES`, `kvseal serve --eviction`); pages leave from its
least recent end, and a save never evicts pages of hashes it names itself. Each is exactly its namesake in
kvseal.core.policies over keys: `kvseal bench hitrate` simulates them and tests/test_eviction_replay.py checks the
store hits what the simulation says, request by request.
- "prefix-lru": a prefix cache should lose a prompt's tail before its head (blocks past a missing one can never
  hit). Every batch that seals or unpins pages is linked in reverse, so its first block ends the most recent; a
  save pins the held blocks it names and, once its new pages are sealed, unpins them in the same order, so they
  end more recent than the new ones. A client that names the request's whole prompt in its save (the vLLM
  connector names the hit prefix in a request's first save; the engine copies nothing for it) leaves the request's
  blocks head first, tail last.
- "prefix-slru" (the default): prefix-lru in two segments of one ring (pages.py: a second sentinel between them).
  Sealed pages enter probation; the pages a counted query hits become hot and, once unpinned, join the protected
  segment, which holds at most PROTECTED_SHARE of the class's pages (its least recent pages go back to
  probation's most recent end); eviction takes probation's least recent pages first. A block hit once outlives
  every block never hit: one-off prompts and finished conversations cannot push out what prompts share. On the
  hit-ratio workloads it is 1.06-1.20 x prefix-lru at 1-2 % of the distinct blocks, 1.008-1.06 x at 5 % and
  0.994-1.013 x above (docs/benchmarks.md), hence the default.
- "lru": a hit (a query's lease or a load, once unpinned) or a seal makes a page the most recently used, in list
  order: a prompt's last block ends the most recent, its first is evicted first. A re-save of a held block does
  not refresh it.
Evicted pages stay counted as used in their slabs: the allocator (slabs.py) reuses them in place for the save that
asked, so a page id is never recycled through the slab's free list on the way.

`forget(pids)` is the one place a sealed page leaves: the namespace's index, the resident counts, the change log,
the ring and the page's state (pages.forget). LRU eviction, a slab's drain step and purge all go through it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence

from kvseal.core.index import ChangeLog, Namespaces
from kvseal.core.pages import PageTable

EVICTION_POLICIES = ("prefix-slru", "prefix-lru", "lru")  # the first is the default
PROTECTED_SHARE = 0.5  # prefix-slru: the share of a size class's pages its protected segment may hold
# the SSD tier (kvseal.ssd.tier) writes a block read back from it again when its record is in the oldest
# SSD_AGING_SHARE of its device's log: a FIFO log with this second chance hits 0.99-1.006 x what LRU of its size hits
# on `kvseal bench hitrate`'s workloads (0.94-1.0 with a half), for 0.16-2.4 writes again per block written
# (policies.SSDLog; docs/benchmarks.md)
SSD_AGING_SHARE = 0.75


class Eviction:
    def __init__(self, pages: PageTable, namespaces: Namespaces, changes: ChangeLog) -> None:
        self._pages = pages
        self._namespaces = namespaces
        self._changes = changes
        self.evictions = 0  # pages evicted (by the policy or a slab's drain; not purged ones)

    def evict(self, c: int, n: int, protected: Collection[int] = (), *, reuse: bool = False) -> list[int]:
        """Evicts exactly n of class c's least recent pages (in its ring's order) that are not in `protected` (page
        ids), least recent first, or none when it has fewer than n (returns [] and changes nothing). The pages come back
        FREE, still counted as used in their slabs: the caller reuses them in place or gives them back
        (Slabs.free). `reuse`: the caller opens them at once (pages.forget's `reused`)."""
        victims = self._pages.lru_victims(c, n, protected)
        if not victims:
            return []
        self.forget(victims, lru_tail=not protected, reused=reuse)
        return victims

    def forget(
        self, pids: Sequence[int], *, evicted: bool = True, lru_tail: bool = False, reused: bool = False
    ) -> None:
        """Sealed unpinned pages of one size class stop holding their blocks: out of their namespace's index, the
        resident counts and the LRU ring; FREE, with a change noted for each. They stay counted as used in their
        slabs: the caller gives them back (Slabs.free) or reuses them. `evicted`: whether they count as evictions
        (purged pages do not); `lru_tail`, `reused`: as pages.forget's."""
        if not pids:
            return
        pages, records = self._pages, self._namespaces.records
        ns_of, hash_of = pages.ns_of, pages.block_hash
        counts = Counter(map(ns_of.__getitem__, pids))
        if len(counts) == 1:  # mostly: one namespace, whose index drops them all in one map()
            record = records[ns_of[pids[0]]]
            hashes: list[bytes] = list(map(hash_of.__getitem__, pids))  # type: ignore[arg-type]
            record.index.remove(hashes)
            if evicted:
                record.what_if.evicted(hashes)
        else:
            for pid in pids:
                del records[ns_of[pid]].index[hash_of[pid]]  # type: ignore[arg-type]
            if evicted:
                for pid in pids:
                    records[ns_of[pid]].what_if.evicted((hash_of[pid],))  # type: ignore[arg-type]
        for ns_id, count in counts.items():
            self._namespaces.count_resident(ns_id, -count)
        self._changes.record(False, map(ns_of.__getitem__, pids), map(hash_of.__getitem__, pids))
        pages.forget(pids, lru_tail=lru_tail, reused=reused)
        if evicted:
            self.evictions += len(pids)
