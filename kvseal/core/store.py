"""The block store: pool accounting, block index, page lifecycle, leases and eviction. Pure: offsets only, no
bytes, no threads (the engine serialises calls and does the copies). Time comes from an injected clock.

Page lifecycle (the only transitions there are)
-----------------------------------------------

    FREE --begin_save--> INFLIGHT --finish_save(all cells written)--> SEALED <--pin/unpin--> SEALED+pinned
      ^                     |                                            |
      +-- finish_save(fail, nothing written) / inflight timeout ---------+-- eviction (unpinned only)

- INFLIGHT pages are in the index (so workers of one instance fill the same page) but never answer queries.
- A SEALED page is pinned while a lease holds it or a load copies from it; pinned pages are not in any LRU
  list, so eviction can only ever see unpinned sealed pages.

Arena layout
------------

    arena = | slab 0 | slab 1 | ... | slab N-1 |        each slab: slab_bytes, free or owned by one size class
    slab of class c = | page | page | ... | page | tail |   pages of class_bytes[c] (page bytes rounded to 64)

A size class takes a free slab when its slabs are full. When none is free, the class evicts its own least
recently used unpinned page; a class with nothing to evict empties a whole slab of another class whose pages
are all evictable (or fails without evicting anything). A slab whose pages are all free goes back to the pool.

Accounting: free_bytes + inflight_bytes + sealed_bytes == arena_bytes at all times (check_invariants()).

Per page metadata lives in typed arrays indexed by page id (no object per page) to keep a resident block
under 256 bytes of engine memory, index entry included.
"""

from __future__ import annotations

import heapq
import time
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvseal.core.layout import Layout
from kvseal.errors import NotFound

FREE, INFLIGHT, SEALED, SENTINEL = 0, 1, 2, 3
PAGE_ALIGN = 64
NO_PAGE = -1


@dataclass(slots=True)
class NamespaceStats:
    namespace_final: str
    layout_id: int
    index: dict[bytes, int] = field(default_factory=dict, repr=False)  # block hash -> page id (inflight or sealed)
    resident_blocks: int = 0
    resident_bytes: int = 0
    hits: int = 0
    misses: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    last_used: float = 0.0  # wall clock (unix seconds)


@dataclass(slots=True)
class _Inflight:
    mask: int
    writers: int
    deadline: float


@dataclass(slots=True)
class Lease:
    lease_id: int
    owner: str  # instance id
    pages: tuple[int, ...]
    shares: int
    consumed: set[tuple[int, int]]
    deadline: float


@dataclass(frozen=True, slots=True)
class SavePlan:
    """Pages one worker must now write: entries[i] = (index into the request's hashes, page id, byte offset)."""

    namespace_id: int
    cell_mask: int
    entries: tuple[tuple[int, int, int], ...]
    skipped: int
    not_stored: int


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Pages to copy out, in request order, pinned until finish_load. outcome: loaded | missing | refused."""

    namespace_id: int
    entries: tuple[tuple[int, int], ...]  # (page id, byte offset)
    outcome: str
    reason: str = ""
    message: str = ""
    lease_id: int = 0
    worker_key: tuple[int, int] = (0, 0)


@dataclass(frozen=True, slots=True)
class QueryResult:
    hits: int
    lease_id: int


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    arena_bytes: int
    slab_bytes: int
    free_bytes: int
    inflight_bytes: int
    sealed_bytes: int
    pinned_bytes: int
    resident_blocks: int
    inflight_blocks: int
    pinned_blocks: int
    leases: int
    evictions: int
    inflight_reclaimed: int
    leases_expired: int


class BlockStore:
    def __init__(
        self,
        arena_bytes: int,
        *,
        slab_bytes: int = 64 << 20,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        inflight_timeout_s: float = 60.0,
        lease_ttl_s: float = 30.0,
    ) -> None:
        slab_bytes = min(slab_bytes, arena_bytes) // PAGE_ALIGN * PAGE_ALIGN
        if slab_bytes <= 0:
            raise ValueError(f"arena of {arena_bytes} bytes is too small")
        self.slab_bytes = slab_bytes
        self.n_slabs = arena_bytes // slab_bytes
        self.arena_bytes = self.n_slabs * slab_bytes
        self._clock = clock
        self._wall_clock = wall_clock
        self.inflight_timeout_s = inflight_timeout_s
        self.lease_ttl_s = lease_ttl_s

        # slabs
        self._free_slabs = list(range(self.n_slabs - 1, -1, -1))
        self._slab_class = [-1] * self.n_slabs
        self._slab_free_ids: list[list[int]] = [[] for _ in range(self.n_slabs)]
        self._slab_carved = [0] * self.n_slabs
        self._slab_used = [0] * self.n_slabs
        self._slab_busy = [0] * self.n_slabs  # inflight or pinned pages: a slab with none can be emptied

        # size classes
        self._class_of_size: dict[int, int] = {}
        self._class_bytes: list[int] = []
        self._class_capacity: list[int] = []
        self._class_partial: list[dict[int, None]] = []  # slabs with room, as an ordered set
        self._class_lru: list[int] = []  # sentinel page id of the class's LRU ring

        # pages (typed arrays indexed by page id)
        self._offset = array("q")
        self._slab_of = array("i")
        self._state = array("b")
        self._pins = array("i")
        self._prev = array("i")
        self._next = array("i")
        self._ns_of = array("i")
        self._hash: list[bytes | None] = []
        self._free_page_ids: list[int] = []

        self._layouts: list[Layout] = []
        self._layout_ids: dict[bytes, int] = {}
        self._namespaces: list[NamespaceStats] = []
        self._namespace_ids: dict[str, int] = {}
        self._inflight: dict[int, _Inflight] = {}
        self._leases: dict[int, Lease] = {}
        self._lease_heap: list[tuple[float, int]] = []
        self._owner_leases: dict[str, set[int]] = {}
        self._next_lease_id = 1

        self._inflight_bytes = 0
        self._sealed_bytes = 0
        self._pinned_bytes = 0
        self._pinned_blocks = 0
        self._resident_blocks = 0
        self._evictions = 0
        self._reclaimed = 0
        self._leases_expired = 0

    # ---------------------------------------------------------------- namespaces and layouts

    def namespace(self, namespace_final: str, layout: Layout) -> int:
        """The id of a final namespace, created on first use. The first layout seen under a namespace is the one
        it holds; a different layout under the same name (a fingerprint collision) gets its pages refused."""
        ns_id = self._namespace_ids.get(namespace_final)
        if ns_id is None:
            layout_id = self._layout_ids.setdefault(layout.digest, len(self._layouts))
            if layout_id == len(self._layouts):
                self._layouts.append(layout)
            ns_id = len(self._namespaces)
            self._namespaces.append(NamespaceStats(namespace_final, layout_id))
            self._namespace_ids[namespace_final] = ns_id
        return ns_id

    def namespace_stats(self) -> list[tuple[NamespaceStats, Layout]]:
        return [(ns, self._layouts[ns.layout_id]) for ns in self._namespaces]

    def layout_of(self, ns_id: int) -> Layout:
        return self._layouts[self._namespaces[ns_id].layout_id]

    # ---------------------------------------------------------------- save (two-phase)

    def begin_save(self, ns_id: int, layout: Layout, hashes: Sequence[bytes], cell_mask: int) -> SavePlan:
        """Reserves the pages a worker writes for `hashes`. The caller copies its slots into every entry and then
        calls finish_save. Sealed hashes and cells this worker already wrote are skipped; when the pool is full
        of pinned or inflight pages the remaining hashes are not stored."""
        self.expire()
        ns = self._namespaces[ns_id]
        if self._layouts[ns.layout_id].digest != layout.digest:  # a fingerprint collision: never mix layouts
            ns.refused["digest"] += 1
            return SavePlan(ns_id, cell_mask, (), 0, len(hashes))
        size_class = self._size_class(layout.page_bytes)
        now = self._clock()
        entries: list[tuple[int, int, int]] = []
        skipped = not_stored = 0
        exhausted = False
        for i, block_hash in enumerate(hashes):
            pid = ns.index.get(block_hash)
            if pid is not None:
                if self._state[pid] == SEALED:
                    skipped += 1
                    continue
                inflight = self._inflight[pid]
                if inflight.mask & cell_mask == cell_mask:
                    skipped += 1
                    continue
                inflight.writers += 1
                entries.append((i, pid, self._offset[pid]))
                continue
            pid = NO_PAGE if exhausted else self._allocate(size_class)
            if pid == NO_PAGE:
                exhausted = True
                not_stored += 1
                continue
            self._state[pid] = INFLIGHT
            self._ns_of[pid] = ns_id
            self._hash[pid] = block_hash
            ns.index[block_hash] = pid
            self._inflight[pid] = _Inflight(mask=0, writers=1, deadline=now + self.inflight_timeout_s)
            self._inflight_bytes += self._class_bytes[size_class]
            self._slab_busy[self._slab_of[pid]] += 1
            entries.append((i, pid, self._offset[pid]))
        return SavePlan(ns_id, cell_mask, tuple(entries), skipped, not_stored)

    def finish_save(self, plan: SavePlan, ok: bool) -> int:
        """Records the copies of a SavePlan. Returns how many pages became sealed.

        A page seals (or, with nothing written, is dropped) only when its last writer finishes: every plan entry
        holds a writer, so no plan can still be copying into a page that became evictable, and a page id cannot
        be recycled for another hash while a plan naming it is open."""
        ns = self._namespaces[plan.namespace_id]
        full_mask = (1 << self._layouts[ns.layout_id].num_slots) - 1
        completed = 0
        for _, pid, _ in plan.entries:
            inflight = self._inflight.get(pid)
            if inflight is None:  # only if the plan was finished twice (a caller bug)
                continue
            inflight.writers -= 1
            if ok:
                inflight.mask |= plan.cell_mask
            if inflight.writers == 0:
                if inflight.mask == full_mask:
                    self._seal(pid, ns)
                    completed += 1
                elif inflight.mask == 0:
                    self._drop_inflight(pid)
        return completed

    def _seal(self, pid: int, ns: NamespaceStats) -> None:
        del self._inflight[pid]
        size = self._page_bytes(pid)
        self._inflight_bytes -= size
        self._sealed_bytes += size
        self._state[pid] = SEALED
        self._slab_busy[self._slab_of[pid]] -= 1
        self._link_mru(pid)
        self._resident_blocks += 1
        ns.resident_blocks += 1
        ns.resident_bytes += self._layouts[ns.layout_id].page_bytes

    def _drop_inflight(self, pid: int) -> None:
        del self._inflight[pid]
        self._inflight_bytes -= self._page_bytes(pid)
        self._slab_busy[self._slab_of[pid]] -= 1
        ns = self._namespaces[self._ns_of[pid]]
        del ns.index[self._hash[pid]]  # type: ignore[arg-type]
        self._free(pid)

    # ---------------------------------------------------------------- query and leases

    def query(
        self, ns_id: int, layout: Layout, hashes: Sequence[bytes], owner: str, shares: int, ttl_s: float | None = None
    ) -> QueryResult:
        """Counts the leading sealed hashes and pins them under a lease of `shares` loads (one per worker)."""
        self.expire()
        ns = self._namespaces[ns_id]
        ns.last_used = self._wall_clock()
        pages: list[int] = []
        if self._layouts[ns.layout_id].digest != layout.digest:
            ns.refused["digest"] += 1
        else:
            for block_hash in hashes:
                pid = ns.index.get(block_hash)
                if pid is None or self._state[pid] != SEALED:
                    break
                pages.append(pid)
        ns.hits += len(pages)
        ns.misses += len(hashes) - len(pages)
        if not pages:
            return QueryResult(0, 0)
        lease_id = self._next_lease_id
        self._next_lease_id += 1
        deadline = self._clock() + (self.lease_ttl_s if ttl_s is None else ttl_s)
        for pid in pages:
            self._pin(pid)
        self._leases[lease_id] = Lease(lease_id, owner, tuple(pages), shares, set(), deadline)
        heapq.heappush(self._lease_heap, (deadline, lease_id))
        self._owner_leases.setdefault(owner, set()).add(lease_id)
        return QueryResult(len(pages), lease_id)

    def release(self, lease_id: int, owner: str) -> None:
        lease = self._leases.get(lease_id)
        if lease is None or lease.owner != owner:
            raise NotFound(f"lease_id {lease_id} is not an open lease of instance {owner!r} (released or expired)")
        self._end_lease(lease)

    def release_owner(self, owner: str) -> int:
        """Ends every lease of an instance (it unregistered or a worker's session dropped)."""
        ids = self._owner_leases.pop(owner, set())
        for lease_id in ids:
            self._end_lease(self._leases[lease_id])
        return len(ids)

    def _end_lease(self, lease: Lease) -> None:
        del self._leases[lease.lease_id]
        owned = self._owner_leases.get(lease.owner)
        if owned is not None:
            owned.discard(lease.lease_id)
            if not owned:
                del self._owner_leases[lease.owner]
        for pid in lease.pages:
            self._unpin(pid)

    def lease(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    # ---------------------------------------------------------------- load (two-phase)

    def begin_load(
        self,
        ns_id: int,
        layout: Layout,
        hashes: Sequence[bytes],
        *,
        lease_id: int = 0,
        owner: str = "",
        worker_key: tuple[int, int] = (0, 0),
    ) -> LoadPlan:
        """Resolves and pins the leading resident pages of `hashes`, each validated against the instance's layout
        (slot count, every slot's size, full digest). The caller copies them out and calls finish_load."""
        self.expire()
        ns = self._namespaces[ns_id]
        ns.last_used = self._wall_clock()
        stored = self._layouts[ns.layout_id]
        refusal = _compare_layouts(stored, layout)
        entries: list[tuple[int, int]] = []
        outcome, reason, message = "loaded", "", ""
        if refusal is not None and hashes:
            outcome = "refused"
            reason, message = refusal
            ns.refused[reason] += 1
        else:
            for block_hash in hashes:
                pid = ns.index.get(block_hash)
                if pid is None or self._state[pid] != SEALED:
                    outcome = "missing"
                    message = f"block {len(entries)} of the request ({block_hash.hex()[:16]}…) is not resident"
                    break
                self._pin(pid)
                entries.append((pid, self._offset[pid]))
        if lease_id and (lease := self._leases.get(lease_id)) is not None and lease.owner != owner:
            lease_id = 0
        return LoadPlan(ns_id, tuple(entries), outcome, reason, message, lease_id, worker_key)

    def finish_load(self, plan: LoadPlan) -> None:
        for pid, _ in plan.entries:
            self._unpin(pid)
        lease = self._leases.get(plan.lease_id) if plan.lease_id else None
        if lease is not None:
            lease.consumed.add(plan.worker_key)
            if len(lease.consumed) >= lease.shares:
                self._end_lease(lease)

    # ---------------------------------------------------------------- time

    def expire(self) -> None:
        """Reclaims inflight pages past their timeout and ends expired leases."""
        now = self._clock()
        if self._inflight:
            stale = []
            for pid, inflight in self._inflight.items():
                if inflight.deadline > now:
                    break  # deadlines grow with insertion order
                if inflight.writers == 0:
                    stale.append(pid)
            for pid in stale:
                self._drop_inflight(pid)
                self._reclaimed += 1
        while self._lease_heap and self._lease_heap[0][0] <= now:
            _, lease_id = heapq.heappop(self._lease_heap)
            lease = self._leases.get(lease_id)
            if lease is not None:
                self._end_lease(lease)
                self._leases_expired += 1

    # ---------------------------------------------------------------- pool

    def _size_class(self, page_bytes: int) -> int:
        aligned = -(-page_bytes // PAGE_ALIGN) * PAGE_ALIGN
        c = self._class_of_size.get(aligned)
        if c is None:
            if aligned > self.slab_bytes:
                raise ValueError(f"page of {page_bytes} bytes exceeds the slab size {self.slab_bytes}")
            c = len(self._class_bytes)
            self._class_of_size[aligned] = c
            self._class_bytes.append(aligned)
            self._class_capacity.append(self.slab_bytes // aligned)
            self._class_partial.append({})
            sentinel = self._new_page_id()
            self._state[sentinel] = SENTINEL
            self._prev[sentinel] = self._next[sentinel] = sentinel
            self._slab_of[sentinel] = c  # a sentinel's slab field holds its class
            self._class_lru.append(sentinel)
        return c

    def max_page_bytes(self) -> int:
        return self.slab_bytes

    def _page_bytes(self, pid: int) -> int:
        return self._class_bytes[self._slab_class[self._slab_of[pid]]]

    def _new_page_id(self) -> int:
        if self._free_page_ids:
            return self._free_page_ids.pop()
        pid = len(self._hash)
        for arr in (self._offset, self._slab_of, self._pins, self._prev, self._next, self._ns_of):
            arr.append(0)
        self._state.append(FREE)
        self._hash.append(None)
        return pid

    def _allocate(self, c: int) -> int:
        while True:
            partial = self._class_partial[c]
            if partial:
                return self._take_from_slab(next(iter(partial)), c)
            if self._free_slabs:
                slab = self._free_slabs.pop()
                self._slab_class[slab] = c
                partial[slab] = None
                continue
            if not self._evict_for(c):
                return NO_PAGE

    def _take_from_slab(self, slab: int, c: int) -> int:
        free_ids = self._slab_free_ids[slab]
        if free_ids:
            pid = free_ids.pop()
        else:
            pid = self._new_page_id()
            self._offset[pid] = slab * self.slab_bytes + self._slab_carved[slab] * self._class_bytes[c]
            self._slab_of[pid] = slab
            self._slab_carved[slab] += 1
        self._slab_used[slab] += 1
        if self._slab_used[slab] == self._class_capacity[c]:
            del self._class_partial[c][slab]
        return pid

    def _free(self, pid: int) -> None:
        self._state[pid] = FREE
        self._hash[pid] = None
        slab = self._slab_of[pid]
        c = self._slab_class[slab]
        self._slab_free_ids[slab].append(pid)
        self._slab_used[slab] -= 1
        self._class_partial[c][slab] = None
        if self._slab_used[slab] == 0:  # give the whole slab back so any class can use it
            del self._class_partial[c][slab]
            self._free_page_ids.extend(self._slab_free_ids[slab])
            self._slab_free_ids[slab] = []
            self._slab_carved[slab] = 0
            self._slab_class[slab] = -1
            self._free_slabs.append(slab)

    def _evict_for(self, c: int) -> bool:
        """Frees room for one page of class c, or changes nothing and returns False."""
        sentinel = self._class_lru[c]
        victim = self._prev[sentinel]
        if victim != sentinel:
            self._evict(victim)
            return True
        # Nothing evictable in this class: empty the emptiest slab of another class whose pages are all evictable.
        candidates = [s for s in range(self.n_slabs) if self._slab_class[s] not in (-1, c) and self._slab_busy[s] == 0]
        if not candidates:
            return False
        slab = min(candidates, key=self._slab_used.__getitem__)
        in_slab = np.frombuffer(self._slab_of, dtype=np.int32) == slab
        victims = np.flatnonzero(in_slab & (np.frombuffer(self._state, dtype=np.int8) == SEALED)).tolist()
        del in_slab  # the arrays may not grow while numpy views of them exist
        for pid in victims:
            self._evict(pid)
        return True

    def _evict(self, pid: int) -> None:
        self._unlink(pid)
        ns = self._namespaces[self._ns_of[pid]]
        del ns.index[self._hash[pid]]  # type: ignore[arg-type]
        ns.resident_blocks -= 1
        ns.resident_bytes -= self._layouts[ns.layout_id].page_bytes
        self._resident_blocks -= 1
        self._sealed_bytes -= self._page_bytes(pid)
        self._evictions += 1
        self._free(pid)

    # LRU ring per class: sentinel.next is the most recently used page, sentinel.prev the least.
    def _link_mru(self, pid: int) -> None:
        sentinel = self._class_lru[self._slab_class[self._slab_of[pid]]]
        first = self._next[sentinel]
        self._prev[pid] = sentinel
        self._next[pid] = first
        self._prev[first] = pid
        self._next[sentinel] = pid

    def _unlink(self, pid: int) -> None:
        prev, nxt = self._prev[pid], self._next[pid]
        self._next[prev] = nxt
        self._prev[nxt] = prev

    def _pin(self, pid: int) -> None:
        if self._pins[pid] == 0:
            self._unlink(pid)
            self._slab_busy[self._slab_of[pid]] += 1
            self._pinned_blocks += 1
            self._pinned_bytes += self._page_bytes(pid)
        self._pins[pid] += 1

    def _unpin(self, pid: int) -> None:
        self._pins[pid] -= 1
        if self._pins[pid] == 0:
            self._link_mru(pid)
            self._slab_busy[self._slab_of[pid]] -= 1
            self._pinned_blocks -= 1
            self._pinned_bytes -= self._page_bytes(pid)

    # ---------------------------------------------------------------- introspection

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(
            arena_bytes=self.arena_bytes,
            slab_bytes=self.slab_bytes,
            free_bytes=self.arena_bytes - self._inflight_bytes - self._sealed_bytes,
            inflight_bytes=self._inflight_bytes,
            sealed_bytes=self._sealed_bytes,
            pinned_bytes=self._pinned_bytes,
            resident_blocks=self._resident_blocks,
            inflight_blocks=len(self._inflight),
            pinned_blocks=self._pinned_blocks,
            leases=len(self._leases),
            evictions=self._evictions,
            inflight_reclaimed=self._reclaimed,
            leases_expired=self._leases_expired,
        )

    def lru_order(self, page_bytes: int) -> list[bytes]:
        """Hashes of the class holding `page_bytes` pages, least recently used first (for tests)."""
        c = self._class_of_size.get(-(-page_bytes // PAGE_ALIGN) * PAGE_ALIGN)
        out: list[bytes] = []
        if c is None:
            return out
        sentinel = self._class_lru[c]
        pid = self._prev[sentinel]
        while pid != sentinel:
            out.append(self._hash[pid])  # type: ignore[arg-type]
            pid = self._prev[pid]
        return out

    def check_invariants(self) -> None:
        """Recounts everything from the page table and asserts it matches the running totals."""
        counted = Counter[int]()
        by_state_bytes = Counter[int]()
        pinned = 0
        slab_used = [0] * self.n_slabs
        slab_busy = [0] * self.n_slabs
        for pid in range(len(self._hash)):
            state = self._state[pid]
            if state == SENTINEL:
                continue
            slab = self._slab_of[pid]
            if state == FREE:
                assert self._pins[pid] == 0
                continue
            counted[state] += 1
            by_state_bytes[state] += self._page_bytes(pid)
            slab_used[slab] += 1
            ns = self._namespaces[self._ns_of[pid]]
            assert ns.index.get(self._hash[pid]) == pid  # type: ignore[arg-type]
            if state == INFLIGHT:
                assert pid in self._inflight and self._pins[pid] == 0
                slab_busy[slab] += 1
            elif self._pins[pid] > 0:
                pinned += 1
                slab_busy[slab] += 1
        assert counted[INFLIGHT] == len(self._inflight)
        assert counted[SEALED] == self._resident_blocks
        assert by_state_bytes[INFLIGHT] == self._inflight_bytes
        assert by_state_bytes[SEALED] == self._sealed_bytes
        assert pinned == self._pinned_blocks
        assert slab_used == self._slab_used and slab_busy == self._slab_busy
        free = len(self._free_slabs) * self.slab_bytes
        for s in range(self.n_slabs):
            if self._slab_class[s] >= 0:
                assert self._slab_used[s] > 0
                free += self.slab_bytes - self._slab_used[s] * self._class_bytes[self._slab_class[s]]
        assert free + self._inflight_bytes + self._sealed_bytes == self.arena_bytes
        lru_pages = sum(len(self.lru_order(b)) for b in self._class_bytes)
        assert lru_pages == self._resident_blocks - self._pinned_blocks
        pins_by_leases = Counter(pid for lease in self._leases.values() for pid in lease.pages)
        for pid, n in pins_by_leases.items():
            assert self._pins[pid] >= n
        assert sum(ns.resident_blocks for ns in self._namespaces) == self._resident_blocks


def _compare_layouts(stored: Layout, instance: Layout) -> tuple[str, str] | None:
    """Why pages of `stored` may not be loaded by an instance of `instance`, or None when they may."""
    if stored.num_slots != instance.num_slots:
        return "slot_count", f"stored block has {stored.num_slots} slots but instance expects {instance.num_slots}"
    for slot, (have, want) in enumerate(zip(stored.slot_sizes, instance.slot_sizes, strict=True)):
        if have != want:
            layer = instance.layers[slot // instance.tp_size].name
            return "slot_bytes", (
                f"stored block's slot {slot} ({layer!r}, tp_rank {slot % instance.tp_size}) holds {have} bytes "
                f"but instance expects {want}"
            )
    if stored.digest != instance.digest:
        return "digest", (
            f"stored block was written under layout digest {stored.digest.hex()} but instance has "
            f"{instance.digest.hex()}"
        )
    return None
