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
recently used unpinned page and reuses it in place; a class with nothing to evict empties a whole slab of another
class whose pages are all evictable (or fails without evicting anything). A slab whose pages are all free goes
back to the pool. Page ids are carved from a slab on first use and the slab keeps the list of its ids, so
emptying it costs its own pages only.

Emptying a slab is done in bounded steps (a slab of 64-byte pages holds a million of them): the slab is *drained*,
at most `reclaim_step_pages` of its page ids looked at per call, and handed back to the pool when its last page
goes. One slab drains at a time, and only a slab with no pinned or inflight page starts. While it drains it takes
no new pages (it is in no class's partial set), and its pages stay what they were until their step comes: sealed
ones answer queries and may be pinned, its own class may still reuse its least recently used ones in place. A step
evicts only sealed unpinned pages; a page that is pinned or inflight when the step passes it is left, and a pass
that ends with pages left starts another if it evicted anything (at most DRAIN_PASSES passes: a lease's pins are
mostly short), else the drain stops and the slab goes back to its class with whatever is free in it.
`reclaim()` is the engine's way in: it takes one step when a save would need another class's slab, and says
whether to call again (the engine releases its lock between calls); `begin_save` itself spends at most one step's
worth of page ids on it (a refill has no loop around it), and `reclaim_step()` continues a drain begun there.

Accounting: free_bytes + inflight_bytes + sealed_bytes == arena_bytes at all times (check_invariants()).

Per page metadata lives in typed arrays indexed by page id (no object per page) to keep a resident block
under 256 bytes of engine memory, index entry included; the arrays grow PAGE_TABLE_CHUNK ids at a time. An
inflight page's open writers are counted in `_writers`; the cells it has written (a mask may be wider than 64
bits) and its reclaim deadline live in dicts that hold inflight pages only.

The hot calls work per batch, not per block where they can: a save allocates, evicts and opens all its new
pages at once (dict.update, list slices, one walk of the LRU tail), lookups go through map() over the index, and
a query's or load's hashes are first checked against the run of pages after the first hash's page (a prompt's
blocks are mostly saved together, so mostly on consecutive page ids) before the index is asked for each.
"""

from __future__ import annotations

import heapq
import itertools
import time
from array import array
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from kvseal.core.layout import Layout
from kvseal.errors import NotFound, quote

FREE, INFLIGHT, SEALED, SENTINEL = 0, 1, 2, 3
PAGE_ALIGN = 64
PAGE_TABLE_CHUNK = 4096  # page ids the page table grows by when none is free
# page ids a slab's drain looks at per step: ~0.7 µs each when evicted (CPython 3.11, 2 vCPUs), so ~1.5 ms a step,
# well under the interpreter's 5 ms switch interval (a step that outlasts it may wait that long again for the GIL)
RECLAIM_STEP_PAGES = 2048
DRAIN_PASSES = 3  # passes over a draining slab before it is given up (pages pinned or written meanwhile)


INDEX_SHARDS = 256  # dicts per namespace index (see BlockIndex), a power of two
_SHARD_MASK = INDEX_SHARDS - 1


class BlockIndex:
    """A namespace's block hash -> page id map, split into INDEX_SHARDS dicts by the hash of the key. A dict that
    fills doubles its table and copies every entry in one go: at 700 k entries that took 42 ms, under the engine
    lock; a shard's resize copies 1/INDEX_SHARDS of that. Keys are block hashes (bytes cache their hash)."""

    __slots__ = ("_shards",)

    def __init__(self) -> None:
        self._shards: list[dict[bytes, int]] = [{} for _ in range(INDEX_SHARDS)]

    def get(self, key: bytes) -> int | None:
        return self._shards[hash(key) & _SHARD_MASK].get(key)

    def get_many(self, keys: Sequence[bytes]) -> list[int | None]:
        return list(map(dict.get, self._shards_of(keys), keys))

    def _shards_of(self, keys: Iterable[bytes]) -> Iterator[dict[bytes, int]]:
        # maps of builtins only: no Python bytecode per key
        return map(self._shards.__getitem__, map(_SHARD_MASK.__and__, map(hash, keys)))

    def __getitem__(self, key: bytes) -> int:
        return self._shards[hash(key) & _SHARD_MASK][key]

    def __contains__(self, key: bytes) -> bool:
        return key in self._shards[hash(key) & _SHARD_MASK]

    def __delitem__(self, key: bytes) -> None:
        del self._shards[hash(key) & _SHARD_MASK][key]

    def update(self, keys: Sequence[bytes], pids: Sequence[int]) -> None:
        deque(map(dict.__setitem__, self._shards_of(keys), keys, pids), maxlen=0)

    def __len__(self) -> int:
        return sum(map(len, self._shards))

    def items(self) -> Iterator[tuple[bytes, int]]:
        return itertools.chain.from_iterable(shard.items() for shard in self._shards)

    def values(self) -> Iterator[int]:
        return itertools.chain.from_iterable(shard.values() for shard in self._shards)


@dataclass(slots=True)
class NamespaceStats:
    namespace_final: str
    layout_id: int
    tenant: int = 0  # whose blocks these are: the same final namespace of two tenants shares nothing
    index: BlockIndex = field(default_factory=BlockIndex, repr=False)  # block hash -> page id (inflight or sealed)
    resident_blocks: int = 0
    resident_bytes: int = 0
    hits: int = 0
    misses: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    last_used: float = 0.0  # wall clock (unix seconds)


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
    """Pages one worker must now write, as columns: positions[k] indexes the request's hashes, pages[k] is the
    page id written for it and offsets[k] that page's byte offset in the arena."""

    namespace_id: int
    cell_mask: int
    positions: list[int]
    pages: list[int]
    offsets: list[int]
    skipped: int
    not_stored: int

    @property
    def entries(self) -> list[tuple[int, int, int]]:
        return list(zip(self.positions, self.pages, self.offsets, strict=True))


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Pages to copy out, in request order, pinned until finish_load. outcome: loaded | missing | refused."""

    namespace_id: int
    pages: list[int]
    offsets: list[int]
    outcome: str
    reason: str = ""
    message: str = ""
    lease_id: int = 0
    worker_key: tuple[int, int] = (0, 0)

    @property
    def entries(self) -> list[tuple[int, int]]:
        return list(zip(self.pages, self.offsets, strict=True))


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
        reclaim_step_pages: int = RECLAIM_STEP_PAGES,
    ) -> None:
        """`reclaim_step_pages`: the most page ids one call looks at while emptying a slab for another class."""
        if reclaim_step_pages < 1:
            raise ValueError(f"reclaim_step_pages must be >= 1, got {reclaim_step_pages}")
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
        self.reclaim_step_pages = reclaim_step_pages

        # slabs
        self._free_slabs = list(range(self.n_slabs - 1, -1, -1))
        self._slab_class = [-1] * self.n_slabs
        self._slab_pages = [array("i") for _ in range(self.n_slabs)]  # ids carved from the slab, in offset order
        # carved ids not in use; arrays, like the lists of ids, so that a slab changes hands in a memcpy
        self._slab_free_ids = [array("i") for _ in range(self.n_slabs)]
        self._slab_used = [0] * self.n_slabs
        self._slab_busy = [0] * self.n_slabs  # inflight or pinned pages: a slab with none can be emptied
        self._drain = -1  # the slab being emptied for another class, in steps (-1: none)
        self._drain_at = 0  # its next page, as an index into its page ids
        self._drain_pass = 0  # passes over it begun so far
        self._drain_evicted = False  # whether the current pass evicted anything

        # size classes
        self._class_of_size: dict[int, int] = {}
        self._class_bytes: list[int] = []
        self._class_capacity: list[int] = []
        self._class_partial: list[dict[int, None]] = []  # slabs with room, as an ordered set
        self._class_lru: list[int] = []  # sentinel page id of the class's LRU ring
        self._lru_len: list[int] = []  # pages in the class's LRU ring (its evictable pages)

        # pages (typed arrays indexed by page id)
        self._offset = array("q")
        self._slab_of = array("i")
        self._state = array("b")
        self._pins = array("i")
        self._prev = array("i")
        self._next = array("i")
        self._ns_of = array("i")
        self._writers = array("i")  # open save plans naming an inflight page
        self._hash: list[bytes | None] = []
        self._free_page_ids = array("i")  # ids in no slab, popped from the end

        self._layouts: list[Layout] = []
        self._layout_ids: dict[bytes, int] = {}
        self._namespaces: list[NamespaceStats] = []
        self._namespace_ids: dict[tuple[int, str], int] = {}
        self._inflight: dict[int, int] = {}  # inflight page id -> cells written so far
        self._inflight_deadline: dict[int, float] = {}  # the same pages -> when one without writers is reclaimed
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
        self._changes: list[tuple[bool, int, bytes]] | None = None  # see track_changes

    # ---------------------------------------------------------------- namespaces and layouts

    def namespace(self, namespace_final: str, layout: Layout, tenant: int = 0) -> int:
        """The id of a tenant's final namespace, created on first use. The first layout seen under a namespace is
        the one it holds; a different layout under the same name (a fingerprint collision) gets its pages refused.
        Tenants never share a namespace: one could otherwise read another's prompts by hash, or poison them."""
        key = (tenant, namespace_final)
        ns_id = self._namespace_ids.get(key)
        if ns_id is None:
            layout_id = self._layout_ids.setdefault(layout.digest, len(self._layouts))
            if layout_id == len(self._layouts):
                self._layouts.append(layout)
            ns_id = len(self._namespaces)
            self._namespaces.append(NamespaceStats(namespace_final, layout_id, tenant))
            self._namespace_ids[key] = ns_id
        return ns_id

    def namespace_id(self, tenant: int, namespace_final: str) -> int | None:
        return self._namespace_ids.get((tenant, namespace_final))

    def namespace_stats(self) -> list[tuple[NamespaceStats, Layout]]:
        return [(ns, self._layouts[ns.layout_id]) for ns in self._namespaces]

    def layout_of(self, ns_id: int) -> Layout:
        return self._layouts[self._namespaces[ns_id].layout_id]

    # ---------------------------------------------------------------- save (two-phase)

    def begin_save(self, ns_id: int, layout: Layout, hashes: Sequence[bytes], cell_mask: int) -> SavePlan:
        """Reserves the pages a worker writes for `hashes`. The caller copies its slots into every entry and then
        calls finish_save. Sealed hashes and cells this worker already wrote are skipped; when the pool is full
        of pinned or inflight pages the remaining new hashes are not stored."""
        self.expire()
        ns = self._namespaces[ns_id]
        if self._layouts[ns.layout_id].digest != layout.digest:  # a fingerprint collision: never mix layouts
            ns.refused["digest"] += 1
            return SavePlan(ns_id, cell_mask, [], [], [], 0, len(hashes))
        lookup = ns.index.get_many
        found = lookup(hashes)
        c = self._size_class(layout.page_bytes)
        n = len(hashes)
        if found.count(None) == n and len(set(hashes)) == n:  # the common case: every hash new, none repeated
            pids = self._allocate_many(c, n)
            self._open_pages(ns_id, c, hashes[: len(pids)], pids, writers=1)
            offsets = list(map(self._offset.__getitem__, pids))
            return SavePlan(ns_id, cell_mask, list(range(len(pids))), pids, offsets, 0, n - len(pids))
        while None in found:
            new = list(dict.fromkeys(h for h, pid in zip(hashes, found, strict=True) if pid is None))
            pids = self._allocate_many(c, len(new))
            self._open_pages(ns_id, c, new[: len(pids)], pids)
            # None is left for hashes the pool had no room for, and for sealed hashes of this request whose pages
            # were just evicted to make that room (they are stored again, like any new hash)
            found = lookup(hashes)
            if len(pids) < len(new):
                break
        state, inflight, writers, offset = self._state, self._inflight, self._writers, self._offset
        positions: list[int] = []
        pages: list[int] = []
        skipped = not_stored = 0
        for i, pid in enumerate(found):
            if pid is None:
                not_stored += 1
            elif state[pid] == SEALED or inflight[pid] & cell_mask == cell_mask:
                skipped += 1
            else:
                writers[pid] += 1
                positions.append(i)
                pages.append(pid)
        return SavePlan(ns_id, cell_mask, positions, pages, list(map(offset.__getitem__, pages)), skipped, not_stored)

    def _open_pages(self, ns_id: int, c: int, hashes: Sequence[bytes], pids: list[int], writers: int = 0) -> None:
        """Makes freshly allocated pages of class c inflight, pids[k] for hashes[k], each with `writers` open
        plans."""
        state, ns_of, hash_of, writer_count = self._state, self._ns_of, self._hash, self._writers
        for pid, block_hash in zip(pids, hashes, strict=True):
            state[pid] = INFLIGHT
            ns_of[pid] = ns_id
            hash_of[pid] = block_hash
            writer_count[pid] = writers
        slab_busy = self._slab_busy
        for slab, count in Counter(map(self._slab_of.__getitem__, pids)).items():
            slab_busy[slab] += count
        self._namespaces[ns_id].index.update(hashes, pids)
        self._inflight.update(dict.fromkeys(pids, 0))
        self._inflight_deadline.update(dict.fromkeys(pids, self._clock() + self.inflight_timeout_s))
        self._inflight_bytes += len(pids) * self._class_bytes[c]

    def finish_save(self, plan: SavePlan, ok: bool) -> int:
        """Records the copies of a SavePlan. Returns how many pages became sealed (finish_save_pages: which)."""
        return len(self.finish_save_pages(plan, ok))

    def finish_save_pages(self, plan: SavePlan, ok: bool) -> list[int]:
        """Records the copies of a SavePlan. Returns the pages that became sealed.

        A page seals (or, with nothing written, is dropped) only when its last writer finishes: every plan entry
        holds a writer, so no plan can still be copying into a page that became evictable, and a page id cannot
        be recycled for another hash while a plan naming it is open."""
        ns = self._namespaces[plan.namespace_id]
        full_mask = (1 << self._layouts[ns.layout_id].num_slots) - 1
        written = plan.cell_mask if ok else 0
        inflight, deadlines, writers = self._inflight, self._inflight_deadline, self._writers
        complete: list[int] = []
        for pid in plan.pages:
            mask = inflight.get(pid)
            if mask is None:  # only if the plan was finished twice (a caller bug)
                continue
            mask |= written
            left = writers[pid] - 1
            writers[pid] = left
            if left == 0 and mask == full_mask:
                del inflight[pid], deadlines[pid]
                complete.append(pid)
            elif left == 0 and mask == 0:
                self._drop_inflight(pid)
            else:  # other writers still copying, or cells left for another worker
                inflight[pid] = mask
        if complete:
            self._seal(complete, ns)
        return complete

    def _seal(self, pids: list[int], ns: NamespaceStats) -> None:
        """Seals inflight pages of one namespace (already out of `_inflight`), each the new most recently used."""
        state, slab_of, slab_busy = self._state, self._slab_of, self._slab_busy
        for pid in pids:
            state[pid] = SEALED
            slab_busy[slab_of[pid]] -= 1
        c = self._slab_class[slab_of[pids[0]]]
        self._link_mru(pids, c)
        if self._changes is not None:
            ns_id, hash_of = self._ns_of[pids[0]], self._hash
            self._changes.extend((True, ns_id, hash_of[pid]) for pid in pids)  # type: ignore[misc]
        n = len(pids)
        size = n * self._class_bytes[c]
        self._inflight_bytes -= size
        self._sealed_bytes += size
        self._resident_blocks += n
        ns.resident_blocks += n
        ns.resident_bytes += n * self._layouts[ns.layout_id].page_bytes

    def _drop_inflight(self, pid: int) -> None:
        del self._inflight[pid], self._inflight_deadline[pid]
        self._inflight_bytes -= self._page_bytes(pid)
        self._slab_busy[self._slab_of[pid]] -= 1
        ns = self._namespaces[self._ns_of[pid]]
        del ns.index[self._hash[pid]]  # type: ignore[arg-type]
        self._free(pid)

    # ---------------------------------------------------------------- query and leases

    def query(
        self,
        ns_id: int,
        layout: Layout,
        hashes: Sequence[bytes],
        owner: str,
        shares: int,
        ttl_s: float | None = None,
        *,
        count: bool = True,
    ) -> QueryResult:
        """Counts the leading sealed hashes and pins them under a lease of `shares` loads (one per worker).
        `count`: whether the namespace's hits and misses count it (not for another node's fetch)."""
        self.expire()
        ns = self._namespaces[ns_id]
        ns.last_used = self._wall_clock()
        pages: list[int] = []
        if self._layouts[ns.layout_id].digest != layout.digest:
            ns.refused["digest"] += 1
        else:
            pages = self._resident_prefix(ns_id, hashes)
        if count:
            ns.hits += len(pages)
            ns.misses += len(hashes) - len(pages)
        if not pages:
            return QueryResult(0, 0)
        lease_id = self._next_lease_id
        self._next_lease_id += 1
        deadline = self._clock() + (self.lease_ttl_s if ttl_s is None else ttl_s)
        self._pin(pages)
        self._leases[lease_id] = Lease(lease_id, owner, tuple(pages), shares, set(), deadline)
        heapq.heappush(self._lease_heap, (deadline, lease_id))
        self._owner_leases.setdefault(owner, set()).add(lease_id)
        return QueryResult(len(pages), lease_id)

    def _resident_prefix(self, ns_id: int, hashes: Sequence[bytes]) -> list[int]:
        """Page ids of the leading hashes that are sealed in the namespace.

        A prompt's blocks are mostly saved in one batch, so their pages mostly have consecutive ids: the run of
        pages after the first hash's is compared first (adjacent entries of the page table), and the index, whose
        lookups each touch cold memory once a pool holds millions of blocks, answers only when that run does not
        match."""
        if not hashes:
            return []
        index = self._namespaces[ns_id].index
        first = index.get(hashes[0])
        if first is None:
            return []
        n = len(hashes)
        if self._hash[first : first + n] == list(hashes) and self._ns_of[first : first + n].count(ns_id) == n:
            found = list(range(first, first + n))
        else:
            found = index.get_many(hashes)
            if None in found:
                del found[found.index(None) :]
        states = bytes(map(self._state.__getitem__, found))
        if states.count(SEALED) != len(found):  # an inflight page ends the resident prefix too
            del found[next(i for i, st in enumerate(states) if st != SEALED) :]
        return found

    def release(self, lease_id: int, owner: str) -> None:
        lease = self._leases.get(lease_id)
        if lease is None or lease.owner != owner:
            raise NotFound(f"lease_id {lease_id} is not an open lease of instance {quote(owner)} (released or expired)")
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
        self._unpin(lease.pages)

    def lease(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    def purge(self, ns_id: int) -> tuple[int, int]:
        """Frees the namespace's sealed pages that nothing pins. Returns (freed, left): pages pinned by a lease or a
        copy, or still inflight, stay until they are released (and are then evicted like any page)."""
        ns = self._namespaces[ns_id]
        state, pins, prev, nxt = self._state, self._pins, self._prev, self._next
        freed = [pid for pid in ns.index.values() if state[pid] == SEALED and pins[pid] == 0]
        if freed:
            self._lru_len[self._slab_class[self._slab_of[freed[0]]]] -= len(freed)  # one namespace: one class
        for pid in freed:
            p, q = prev[pid], nxt[pid]
            nxt[p] = q
            prev[q] = p
            if self._changes is not None:
                self._changes.append((False, ns_id, self._hash[pid]))  # type: ignore[arg-type]
            del ns.index[self._hash[pid]]  # type: ignore[arg-type]
            self._sealed_bytes -= self._page_bytes(pid)
            self._free(pid)
        n = len(freed)
        self._resident_blocks -= n
        ns.resident_blocks -= n
        ns.resident_bytes -= n * self._layouts[ns.layout_id].page_bytes
        return n, len(ns.index)

    # ---------------------------------------------------------------- changes, for the MetaServer

    def track_changes(self) -> None:
        """From now on, record every block that becomes sealed or stops being resident (take_changes)."""
        if self._changes is None:
            self._changes = []

    def take_changes(self) -> list[tuple[bool, int, bytes]]:
        """(sealed, namespace id, hash) of every change since the last call, in order: True = now resident,
        False = no longer resident (evicted or purged)."""
        changes, self._changes = self._changes or [], [] if self._changes is not None else None
        return changes

    def sealed_hashes(self, ns_id: int) -> list[bytes]:
        """The hashes of the namespace's sealed pages (a node announcing everything it holds)."""
        state = self._state
        return [h for h, pid in self._namespaces[ns_id].index.items() if state[pid] == SEALED]

    # ---------------------------------------------------------------- pages for other tiers

    def page(self, ns_id: int, block_hash: bytes) -> int | None:
        """The page id holding `block_hash` in the namespace (inflight or sealed), or None."""
        return self._namespaces[ns_id].index.get(block_hash)

    def pin_pages(self, pids: Sequence[int]) -> None:
        """Pins sealed pages of one namespace (an SSD write reads them): they cannot be evicted until unpinned."""
        self._pin(pids)

    def unpin_pages(self, pids: Sequence[int]) -> None:
        self._unpin(pids)

    def page_offset(self, pid: int) -> int:
        return self._offset[pid]

    def page_hash(self, pid: int) -> bytes:
        block_hash = self._hash[pid]
        assert block_hash is not None, "a page in use has a hash"
        return block_hash

    def split_plan(self, plan: SavePlan, keep: Sequence[bool]) -> tuple[SavePlan, SavePlan]:
        """The plan's entries where `keep` is true, and the others (a refill whose records partly failed their
        checks finishes the first as written and the second as not)."""
        parts: tuple[list[int], list[int]] = ([], [])
        for k, flag in enumerate(keep):
            parts[0 if flag else 1].append(k)
        out = []
        for ks in parts:
            out.append(
                SavePlan(
                    plan.namespace_id,
                    plan.cell_mask,
                    [plan.positions[k] for k in ks],
                    [plan.pages[k] for k in ks],
                    [plan.offsets[k] for k in ks],
                    0,
                    0,
                )
            )
        return out[0], out[1]

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
        pages: list[int] = []
        outcome, reason, message = "loaded", "", ""
        if refusal is not None and hashes:
            outcome = "refused"
            reason, message = refusal
            ns.refused[reason] += 1
        else:
            pages = self._resident_prefix(ns_id, hashes)
            resident = len(pages)
            if resident < len(hashes):
                outcome = "missing"
                message = f"block {resident} of the request ({hashes[resident].hex()[:16]}…) is not resident"
            self._pin(pages)
        if lease_id and (lease := self._leases.get(lease_id)) is not None and lease.owner != owner:
            lease_id = 0
        offsets = list(map(self._offset.__getitem__, pages))
        return LoadPlan(ns_id, pages, offsets, outcome, reason, message, lease_id, worker_key)

    def finish_load(self, plan: LoadPlan) -> None:
        self._unpin(plan.pages)
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
            writers = self._writers
            stale = []
            for pid, deadline in self._inflight_deadline.items():
                if deadline > now:
                    break  # deadlines grow with insertion order
                if writers[pid] == 0:
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
        aligned = page_stride(page_bytes)
        c = self._class_of_size.get(aligned)
        if c is None:
            if aligned > self.slab_bytes:
                raise ValueError(f"page of {page_bytes} bytes exceeds the slab size {self.slab_bytes}")
            c = len(self._class_bytes)
            self._class_of_size[aligned] = c
            self._class_bytes.append(aligned)
            self._class_capacity.append(self.slab_bytes // aligned)
            self._class_partial.append({})
            self._lru_len.append(0)
            (sentinel,) = self._new_page_ids(1)
            self._state[sentinel] = SENTINEL
            self._prev[sentinel] = self._next[sentinel] = sentinel
            self._slab_of[sentinel] = c  # a sentinel's slab field holds its class
            self._class_lru.append(sentinel)
        return c

    def max_page_bytes(self) -> int:
        return self.slab_bytes

    def _page_bytes(self, pid: int) -> int:
        return self._class_bytes[self._slab_class[self._slab_of[pid]]]

    def _new_page_ids(self, n: int) -> list[int]:
        while len(self._free_page_ids) < n:
            start = len(self._hash)
            for arr in (
                self._offset,
                self._slab_of,
                self._state,  # zero is FREE
                self._pins,
                self._prev,
                self._next,
                self._ns_of,
                self._writers,
            ):
                arr.frombytes(bytes(PAGE_TABLE_CHUNK * arr.itemsize))
            self._hash.extend([None] * PAGE_TABLE_CHUNK)
            self._free_page_ids.extend(range(start + PAGE_TABLE_CHUNK - 1, start - 1, -1))
        pids = self._free_page_ids[-n:].tolist()
        del self._free_page_ids[-n:]
        pids.reverse()  # popped from the end: the lowest ids first
        return pids

    def _allocate_many(self, c: int, n: int) -> list[int]:
        """Up to n pages of class c, counted as used in their slabs (their state is the caller's to set); fewer
        only when the pool has no more room for the class. In order of preference: free pages of slabs the class
        holds, free slabs, the class's own least recently used pages (evicted and reused in place), whole slabs of
        other classes (emptied, looking at no more than reclaim_step_pages of their page ids in this call: the rest
        of a big slab is left to reclaim() or reclaim_step(), and fewer pages come back meanwhile)."""
        out: list[int] = []
        partial, capacity = self._class_partial[c], self._class_capacity[c]
        budget = self.reclaim_step_pages
        while len(out) < n:
            if partial:
                slab = next(iter(partial))
                free_ids = self._slab_free_ids[slab]
                room = min(n - len(out), capacity - self._slab_used[slab])
                if free_ids:
                    took = free_ids[-room:].tolist()
                    del free_ids[-len(took) :]
                    took.reverse()  # the most recently freed first
                else:
                    took = self._carve(slab, c, room)
                out += took
                used = self._slab_used[slab] + len(took)
                self._slab_used[slab] = used
                if used == capacity:
                    del partial[slab]
            elif self._free_slabs:
                slab = self._free_slabs.pop()
                self._slab_class[slab] = c
                partial[slab] = None
            elif victims := self._evict_lru(c, n - len(out)):
                out += victims
            elif budget > 0 and (spent := self._reclaim_for(c, budget)):
                budget -= spent
            else:
                break
        return out

    def _carve(self, slab: int, c: int, n: int) -> list[int]:
        """The slab's next n page ids, at the next page offsets."""
        pages = self._slab_pages[slab]
        size = self._class_bytes[c]
        at = slab * self.slab_bytes + len(pages) * size
        pids = self._new_page_ids(n)
        offset, slab_of = self._offset, self._slab_of
        for pid in pids:
            offset[pid] = at
            slab_of[pid] = slab
            at += size
        pages.extend(pids)
        return pids

    def _free(self, pid: int) -> None:
        self._state[pid] = FREE
        self._hash[pid] = None
        slab = self._slab_of[pid]
        self._slab_free_ids[slab].append(pid)
        self._slab_used[slab] -= 1
        if self._slab_used[slab] == 0:  # give the whole slab back so any class can use it
            self._release_slab(slab)
        elif slab != self._drain:  # a draining slab takes no new pages
            self._class_partial[self._slab_class[slab]][slab] = None

    def _release_slab(self, slab: int) -> None:
        """Returns a slab none of whose pages is in use to the pool, and its page ids to the page table."""
        self._class_partial[self._slab_class[slab]].pop(slab, None)
        self._free_page_ids.extend(self._slab_pages[slab])
        self._slab_pages[slab] = array("i")
        self._slab_free_ids[slab] = array("i")
        self._slab_class[slab] = -1
        self._free_slabs.append(slab)
        if slab == self._drain:
            self._drain = -1

    # ---------------------------------------------------------------- emptying slabs for other classes, in steps

    def reclaim(self, ns_id: int, layout: Layout, hashes: Sequence[bytes]) -> bool:
        """Makes room for a begin_save of `hashes` one bounded step at a time: True when it looked at up to
        reclaim_step_pages page ids of a slab of another class that it is emptying, and more may be needed (call
        again; the engine releases its lock in between, and begin_save goes ahead when this says False). False
        when the class already has room (free pages of its slabs, free slabs, its own evictable pages) for the
        hashes not yet in the namespace, or when no other class has a slab that can be emptied; begin_save then
        stores what fits, as it always did."""
        self.expire()
        ns = self._namespaces[ns_id]
        if self._layouts[ns.layout_id].digest != layout.digest:
            return False  # refused by begin_save: nothing is stored
        c = self._size_class(layout.page_bytes)
        if self._room(c, len(hashes)):
            return False
        index = ns.index
        new = len({h for h in hashes if h not in index})
        if not new or self._room(c, new):
            return False
        return self._reclaim_for(c, self.reclaim_step_pages) > 0

    def reclaim_step(self) -> bool:
        """Continues the slab being emptied (one begun by a begin_save that had no reclaim() before it) by one
        bounded step. Returns whether one is still being emptied."""
        if self._drain >= 0:
            self._drain_step(self.reclaim_step_pages)
        return self._drain >= 0

    def reclaiming(self) -> int:
        """The slab being emptied for another class, or -1."""
        return self._drain

    def _room(self, c: int, n: int) -> bool:
        """Whether class c can have n pages without emptying a slab of another class."""
        room = self._lru_len[c] + len(self._free_slabs) * self._class_capacity[c]
        if room >= n:
            return True
        capacity, used = self._class_capacity[c], self._slab_used
        for slab in self._class_partial[c]:
            room += capacity - used[slab]
            if room >= n:
                return True
        return False

    def _reclaim_for(self, c: int, budget: int) -> int:
        """One step, of at most `budget` page ids, of emptying a slab of another class than c: the one being
        emptied, or else the emptiest whose pages are all evictable. Returns the page ids looked at (0: there is
        none, or the one being emptied is c's own, which gives c nothing)."""
        if self._drain >= 0:
            if self._slab_class[self._drain] == c:
                return 0
        else:
            slab_class, busy = self._slab_class, self._slab_busy
            candidates = [s for s in range(self.n_slabs) if slab_class[s] not in (-1, c) and busy[s] == 0]
            if not candidates:
                return 0
            slab = min(candidates, key=self._slab_used.__getitem__)
            self._class_partial[slab_class[slab]].pop(slab, None)  # it takes no new pages while it drains
            self._drain, self._drain_at, self._drain_pass, self._drain_evicted = slab, 0, 1, False
        return self._drain_step(budget)

    def _drain_step(self, budget: int) -> int:
        """Evicts the sealed unpinned pages among the draining slab's next `budget` page ids; hands the slab back
        to the pool when its last page is gone. Returns the page ids looked at (at least 1)."""
        slab = self._drain
        c = self._slab_class[slab]
        pages = self._slab_pages[slab]
        start = self._drain_at
        end = min(len(pages), start + max(budget, 1))
        state, pins, hash_of, ns_of, namespaces = self._state, self._pins, self._hash, self._ns_of, self._namespaces
        prev, nxt, changes = self._prev, self._next, self._changes
        evicted: dict[int, int] = {}  # namespace id -> its pages evicted
        freed: list[int] = []
        for pid in pages[start:end]:
            if state[pid] == SEALED and pins[pid] == 0:  # in the LRU ring: evictable
                p, q = prev[pid], nxt[pid]
                nxt[p] = q
                prev[q] = p
                ns_id = ns_of[pid]
                block_hash = hash_of[pid]
                del namespaces[ns_id].index[block_hash]  # type: ignore[arg-type]
                evicted[ns_id] = evicted.get(ns_id, 0) + 1
                if changes is not None:
                    changes.append((False, ns_id, block_hash))  # type: ignore[arg-type]
                state[pid] = FREE
                hash_of[pid] = None
                freed.append(pid)
        self._drain_at = end
        if freed:
            self._drain_evicted = True
            for ns_id, count in evicted.items():
                ns = namespaces[ns_id]
                ns.resident_blocks -= count
                ns.resident_bytes -= count * self._layouts[ns.layout_id].page_bytes
            n = len(freed)
            self._lru_len[c] -= n
            self._resident_blocks -= n
            self._sealed_bytes -= n * self._class_bytes[c]
            self._evictions += n
            self._slab_free_ids[slab].extend(freed)
            self._slab_used[slab] -= n
        if self._slab_used[slab] == 0:
            self._release_slab(slab)  # ends the drain
        elif end == len(pages):  # pages were pinned or inflight when the pass went by
            if self._drain_evicted and self._drain_pass < DRAIN_PASSES:  # those may be evictable by now
                self._drain_at, self._drain_pass, self._drain_evicted = 0, self._drain_pass + 1, False
            else:  # it cannot be emptied now: back to its class, with what is free in it
                self._drain = -1
                if self._slab_used[slab] < self._class_capacity[c]:
                    self._class_partial[c][slab] = None
        return end - start

    def _evict_lru(self, c: int, n: int) -> list[int]:
        """Takes up to n of class c's least recently used pages (unpinned and sealed: the only pages in the ring)
        out of the ring, the index and the counts, least recent first. They stay in use in their slabs: the
        caller reuses them and sets their state and hash."""
        prev, nxt, ns_of, hash_of = self._prev, self._next, self._ns_of, self._hash
        sentinel = self._class_lru[c]
        victims: list[int] = []
        pid = prev[sentinel]
        while pid != sentinel and len(victims) < n:
            victims.append(pid)
            pid = prev[pid]
        if not victims:
            return victims
        nxt[pid] = sentinel  # pid is now the least recently used page (or the sentinel: the ring is empty)
        prev[sentinel] = pid
        for ns_id, count in Counter(map(ns_of.__getitem__, victims)).items():
            ns = self._namespaces[ns_id]
            ns.resident_blocks -= count
            ns.resident_bytes -= count * self._layouts[ns.layout_id].page_bytes
        namespaces = self._namespaces
        for pid in victims:
            del namespaces[ns_of[pid]].index[hash_of[pid]]  # type: ignore[arg-type]
        if self._changes is not None:
            self._changes.extend((False, ns_of[pid], hash_of[pid]) for pid in victims)  # type: ignore[misc]
        n = len(victims)
        self._lru_len[c] -= n
        self._resident_blocks -= n
        self._sealed_bytes -= n * self._class_bytes[c]
        self._evictions += n
        return victims

    # LRU ring per class: sentinel.next is the most recently used page, sentinel.prev the least.
    def _link_mru(self, pids: Sequence[int], c: int) -> None:
        """Puts pages of class c at the most recently used end, in order (the last is the most recent)."""
        prev, nxt = self._prev, self._next
        sentinel = self._class_lru[c]
        first = nxt[sentinel]
        for pid in pids:
            prev[first] = pid
            nxt[pid] = first
            first = pid
        prev[first] = sentinel
        nxt[sentinel] = first
        self._lru_len[c] += len(pids)

    def _pin(self, pids: Sequence[int]) -> None:
        """Pins sealed pages of one namespace (so of one size class); a page may be listed more than once."""
        pins, prev, nxt, slab_busy, slab_of = self._pins, self._prev, self._next, self._slab_busy, self._slab_of
        newly = 0
        for pid in pids:
            n = pins[pid]
            if n == 0:  # out of the LRU ring: pinned pages are never evicted
                p, q = prev[pid], nxt[pid]
                nxt[p] = q
                prev[q] = p
                slab_busy[slab_of[pid]] += 1
                newly += 1
            pins[pid] = n + 1
        if newly:
            c = self._slab_class[slab_of[pids[0]]]
            self._lru_len[c] -= newly
            self._pinned_blocks += newly
            self._pinned_bytes += newly * self._class_bytes[c]

    def _unpin(self, pids: Sequence[int]) -> None:
        """Drops one pin of each page (of one namespace, as pinned by _pin). A page left without pins becomes the
        most recently used, in list order."""
        if not pids:
            return
        pins, slab_busy, slab_of = self._pins, self._slab_busy, self._slab_of
        unpinned = []
        for pid in pids:
            n = pins[pid] - 1
            pins[pid] = n
            if n == 0:
                slab_busy[slab_of[pid]] -= 1
                unpinned.append(pid)
        if unpinned:
            c = self._slab_class[slab_of[pids[0]]]
            self._link_mru(unpinned, c)
            self._pinned_blocks -= len(unpinned)
            self._pinned_bytes -= len(unpinned) * self._class_bytes[c]

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
        c = self._class_of_size.get(page_stride(page_bytes))
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
            if state == INFLIGHT:
                assert pid in self._inflight and self._pins[pid] == 0 and self._writers[pid] >= 0
            else:
                assert self._writers[pid] == 0
            if state == FREE:
                assert self._pins[pid] == 0 and self._hash[pid] is None
                continue
            counted[state] += 1
            by_state_bytes[state] += self._page_bytes(pid)
            slab_used[slab] += 1
            ns = self._namespaces[self._ns_of[pid]]
            assert ns.index.get(self._hash[pid]) == pid  # type: ignore[arg-type]
            if state == INFLIGHT:
                slab_busy[slab] += 1
            elif self._pins[pid] > 0:
                pinned += 1
                slab_busy[slab] += 1
        assert counted[INFLIGHT] == len(self._inflight)
        assert list(self._inflight) == list(self._inflight_deadline)
        deadlines = list(self._inflight_deadline.values())
        assert deadlines == sorted(deadlines)  # expire() stops at the first deadline still ahead
        assert counted[SEALED] == self._resident_blocks
        assert by_state_bytes[INFLIGHT] == self._inflight_bytes
        assert by_state_bytes[SEALED] == self._sealed_bytes
        assert pinned == self._pinned_blocks
        assert slab_used == self._slab_used and slab_busy == self._slab_busy
        free = len(self._free_slabs) * self.slab_bytes
        owned_ids: set[int] = set()
        for s in range(self.n_slabs):
            c = self._slab_class[s]
            pages, free_ids = self._slab_pages[s], self._slab_free_ids[s]
            if c < 0:
                assert s in self._free_slabs and not pages and not free_ids and self._slab_used[s] == 0
                continue
            assert self._slab_used[s] > 0
            free += self.slab_bytes - self._slab_used[s] * self._class_bytes[c]
            # the slab's ids are its carved pages, at consecutive offsets; the free ones are exactly those FREE
            assert len(pages) <= self._class_capacity[c]
            for k, pid in enumerate(pages):
                assert self._slab_of[pid] == s and self._offset[pid] == s * self.slab_bytes + k * self._class_bytes[c]
            assert sorted(free_ids) == sorted(pid for pid in pages if self._state[pid] == FREE)
            assert len(pages) - len(free_ids) == self._slab_used[s]
            assert (s in self._class_partial[c]) == (self._slab_used[s] < self._class_capacity[c] and s != self._drain)
            owned_ids.update(pages)
        # every page id is a sentinel, a page of one slab, or free in the page table: none leaks or doubles
        unowned = set(self._free_page_ids)
        assert len(owned_ids) == sum(len(p) for p in self._slab_pages) and len(unowned) == len(self._free_page_ids)
        assert not owned_ids & unowned and all(self._state[pid] == FREE for pid in unowned)
        assert len(self._class_lru) + len(owned_ids) + len(unowned) == len(self._hash)
        assert free + self._inflight_bytes + self._sealed_bytes == self.arena_bytes
        lru_pages = 0
        for c, sentinel in enumerate(self._class_lru):
            ring = 0
            pid = self._next[sentinel]
            while pid != sentinel:
                assert self._state[pid] == SEALED and self._pins[pid] == 0
                assert self._prev[self._next[pid]] == pid
                assert self._slab_class[self._slab_of[pid]] == c
                ring += 1
                pid = self._next[pid]
            assert ring == self._lru_len[c]
            lru_pages += ring
        assert lru_pages == self._resident_blocks - self._pinned_blocks
        if self._drain >= 0:  # a draining slab is in use, takes no new pages, and its cursor is within it
            d = self._drain
            assert self._slab_class[d] >= 0 and d not in self._class_partial[self._slab_class[d]]
            assert 0 <= self._drain_at < len(self._slab_pages[d]) and 1 <= self._drain_pass <= DRAIN_PASSES
        pins_by_leases = Counter(pid for lease in self._leases.values() for pid in lease.pages)
        for pid, n in pins_by_leases.items():
            assert self._pins[pid] >= n
        resident = Counter(self._ns_of[pid] for pid in range(len(self._hash)) if self._state[pid] == SEALED)
        for ns_id, ns in enumerate(self._namespaces):
            assert ns.resident_blocks == resident[ns_id]
            assert ns.resident_bytes == ns.resident_blocks * self._layouts[ns.layout_id].page_bytes


def page_stride(page_bytes: int) -> int:
    """The bytes a page of `page_bytes` takes in its slab: consecutive pages of a slab are this far apart."""
    return -(-page_bytes // PAGE_ALIGN) * PAGE_ALIGN


def _compare_layouts(stored: Layout, instance: Layout) -> tuple[str, str] | None:
    """Why pages of `stored` may not be loaded by an instance of `instance`, or None when they may."""
    if stored.digest == instance.digest:  # the descriptor fixes every slot: nothing else can differ
        return None
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
