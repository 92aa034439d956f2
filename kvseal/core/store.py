"""The block store: pool accounting, block index, page lifecycle, leases and eviction, behind one facade. Pure:
offsets only, no bytes, no threads (the engine serialises calls and does the copies). Time comes from an injected
clock.

Where each part lives
---------------------

    pages.py     the page table (typed arrays per page id, the LRU rings) and the page state table: the only
                 module that writes a page's state, pins or writers
    index.py     namespaces, their sharded block hash -> page id indexes, the change log
    leases.py    leases and their deadlines (the store unpins what an ended lease held)
    eviction.py  the eviction contract (evict n or nothing), the two ring orders (prefix-lru, lru), and `forget`:
                 the one way a sealed page leaves (eviction, a slab's drain step, purge)
    slabs.py     the arena's slabs, size classes, carving, emptying a slab for another class in bounded steps
    store.py     BlockStore: the calls the engine makes, two-phase save / refill / load, query, expire

`reclaim()` is the engine's way into emptying a slab for another class: it takes one step when a save would need
another class's slab, and says whether to call again (the engine releases its lock between calls); `begin_save`
itself spends at most one step's worth of page ids on it (a refill has no loop around it), and `reclaim_step()`
continues a drain begun there.

Accounting: free_bytes + inflight_bytes + sealed_bytes == arena_bytes at all times (check_invariants()).

The hot calls work per batch, not per block where they can: a save allocates, evicts and opens all its new
pages at once (dict.update, list slices, one walk of the LRU tail), lookups go through map() over the index, and
a query's or load's hashes are first checked against the run of pages after the first hash's page (a prompt's
blocks are mostly saved together, so mostly on consecutive page ids) before the index is asked for each. Between
the modules there is a call per batch, never one per page.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import repeat

# besides what it uses, this module hands out the names callers have always imported from it (noqa: F401)
from kvseal.core.eviction import EVICTION_POLICIES, PROTECTED_SHARE, Eviction
from kvseal.core.index import (  # noqa: F401
    INDEX_SHARDS,
    BlockIndex,
    ChangeLog,
    Namespace,
    Namespaces,
    NamespaceStats,
    compare_layouts,
    resident_prefix,
)
from kvseal.core.layout import Layout
from kvseal.core.leases import Lease, Leases
from kvseal.core.pages import (  # noqa: F401
    FREE,
    INFLIGHT,
    SEALED,
    SENTINEL,
    NativePageTable,
    PageState,
    PageStatus,
    PageTable,
    page_table,
)
from kvseal.core.slabs import DRAIN_PASSES, PAGE_ALIGN, RECLAIM_STEP_PAGES, Slabs, SlabStatistics, page_stride  # noqa: F401
from kvseal.errors import NotFound, quote


@dataclass(frozen=True, slots=True)
class SavePlan:
    """Pages one worker must now write, as columns: positions[k] indexes the request's hashes, pages[k] is the
    page id written for it and offsets[k] that page's byte offset in the arena. `held`: sealed pages the save named,
    pinned until it finishes (prefix-lru and prefix-slru; lru: none)."""

    namespace_id: int
    cell_mask: int
    positions: list[int]
    pages: list[int]
    offsets: list[int]
    skipped: int
    not_stored: int
    held: list[int] = field(default_factory=list)

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
class PinnedPrefix:
    """What a store query found: the leading hashes resident, pinned under `lease_id` (0: none pinned)."""

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
        table: str | None = None,
        eviction: str = EVICTION_POLICIES[0],
    ) -> None:
        """`reclaim_step_pages`: the most page ids one call looks at while emptying a slab for another class;
        `table`: "native" (the page table's loops and the namespaces' indexes in C) or "python" (the reference);
        None: KVSEAL_TABLE, else native when the extension is built (pages.page_table); `eviction`: one of
        eviction.EVICTION_POLICIES."""
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {', '.join(EVICTION_POLICIES)}, not {eviction!r}")
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

        self.eviction = eviction
        share = PROTECTED_SHARE if eviction == "prefix-slru" else 0.0
        self._pages = page_table(self.n_slabs, table, tails_first=eviction != "lru", protected_share=share)
        self.table = "native" if isinstance(self._pages, NativePageTable) else "python"
        self._namespaces = Namespaces(native=self.table == "native")
        self._changes = ChangeLog()
        self._eviction = Eviction(self._pages, self._namespaces, self._changes)
        self._slabs = Slabs(self._pages, self._eviction, self.n_slabs, slab_bytes)
        self._leases = Leases()
        self._reclaimed = 0  # inflight pages dropped at their deadline

    # ---------------------------------------------------------------- namespaces and layouts

    def namespace(self, namespace_final: str, layout: Layout, tenant: int = 0) -> int:
        """The id of a tenant's final namespace, created on first use. The first layout seen under a namespace is
        the one it holds; a different layout under the same name (a fingerprint collision) gets its pages refused.
        Tenants never share a namespace: one could otherwise read another's prompts by hash, or poison them."""
        return self._namespaces.add(namespace_final, layout, tenant)

    def namespace_id(self, tenant: int, namespace_final: str) -> int | None:
        return self._namespaces.id_of(tenant, namespace_final)

    def namespace_stats(self) -> list[tuple[Namespace, Layout]]:
        layouts = self._namespaces.layouts
        return [(ns, layouts[ns.layout_id]) for ns in self._namespaces.records]

    def layout_of(self, ns_id: int) -> Layout:
        return self._namespaces.layout_of(ns_id)

    # ---------------------------------------------------------------- save and refill (two-phase)

    def begin_save(self, ns_id: int, layout: Layout, hashes: Sequence[bytes], cell_mask: int) -> SavePlan:
        """Reserves the pages a worker writes for `hashes`. The caller copies its slots into every entry and then
        calls finish_save. Sealed hashes and cells this worker already wrote are skipped; when the pool is full
        of pinned or inflight pages the remaining new hashes are not stored."""
        self.expire()
        ns = self._namespaces[ns_id]
        if self._namespaces.layouts[ns.layout_id].digest != layout.digest:  # a fingerprint collision: never mix
            ns.refused["digest"] += 1
            return SavePlan(ns_id, cell_mask, [], [], [], 0, len(hashes))
        lookup = ns.index.get_many
        found = lookup(hashes)
        c = self._slabs.size_class(layout.page_bytes)
        allocate, budget = self._slabs.allocate, self.reclaim_step_pages
        n = len(hashes)
        if found.count(None) == n and len(set(hashes)) == n:  # the common case: every hash new, none repeated
            pids = allocate(c, n, budget)
            self._open(ns, ns_id, hashes[: len(pids)], pids, writers=1)
            offsets = self._pages.offsets(pids)
            return SavePlan(ns_id, cell_mask, list(range(len(pids))), pids, offsets, 0, n - len(pids))
        # blocks already held: a re-save, or the request's prefix named by the client; none is evicted to make room.
        # prefix-lru and prefix-slru pin the sealed ones until finish_save, which links them back after the new
        # pages (they end the most recent, in order: a request's head, then its tail); lru protects them
        held = [pid for pid in found if pid is not None]
        pinned: list[int] = []
        if self._pages.tails_first:
            pinned = self._pages.sealed(held)
            self._pages.pin(pinned)
            held = []  # pinned or inflight: none of them is in the ring
        while None in found:
            new = list(dict.fromkeys(h for h, pid in zip(hashes, found, strict=True) if pid is None))
            pids = allocate(c, len(new), budget, held)
            self._open(ns, ns_id, new[: len(pids)], pids)
            # None is left for hashes the pool had no room for
            found = lookup(hashes)
            if len(pids) < len(new):
                break
        positions, pages, skipped, not_stored = self._pages.join(found, cell_mask)
        return SavePlan(ns_id, cell_mask, positions, pages, self._pages.offsets(pages), skipped, not_stored, pinned)

    def _open(self, ns: Namespace, ns_id: int, hashes: Sequence[bytes], pids: list[int], writers: int = 0) -> None:
        """Makes freshly allocated pages inflight, pids[k] for hashes[k], each with `writers` open plans."""
        self._pages.open(pids, ns_id, hashes, writers, self._clock() + self.inflight_timeout_s)
        ns.index.update(hashes, pids)

    def finish_save(self, plan: SavePlan, ok: bool) -> int:
        """Records the copies of a SavePlan. Returns how many pages became sealed (finish_save_pages: which)."""
        return len(self.finish_save_pages(plan, ok))

    def finish_save_pages(self, plan: SavePlan, ok: bool) -> list[int]:
        """Records the copies of a SavePlan. Returns the pages that became sealed.

        A page seals (or, with nothing written, is dropped) only when its last writer finishes: every plan entry
        holds a writer, so no plan can still be copying into a page that became evictable, and a page id cannot
        be recycled for another hash while a plan naming it is open."""
        ns_id = plan.namespace_id
        full_mask = (1 << self._namespaces.layout_of(ns_id).num_slots) - 1
        complete, empty = self._pages.end_writes(plan.pages, plan.cell_mask if ok else 0, full_mask)
        if empty:
            self._discard(empty)
        if complete:
            self._pages.seal(complete)
            hash_of = self._pages.block_hash
            self._changes.record(True, repeat(ns_id), map(hash_of.__getitem__, complete))
            self._namespaces.count_resident(ns_id, len(complete))
            what_if = self._namespaces[ns_id].what_if
            if len(what_if):  # blocks evicted before are resident again
                what_if.stored([hash_of[pid] for pid in complete])  # type: ignore[misc]  # sealed: a hash each
        self._pages.unpin(plan.held)
        return complete

    def _discard(self, pids: list[int]) -> None:
        """Inflight pages out of the inflight dicts (end_writes, stale) leave their index and go back to FREE."""
        records, ns_of, hash_of = self._namespaces.records, self._pages.ns_of, self._pages.block_hash
        for pid in pids:
            del records[ns_of[pid]].index[hash_of[pid]]  # type: ignore[arg-type]
        self._pages.drop(pids)
        self._slabs.free(pids)

    def begin_refill(self, ns_id: int, layout: Layout, hashes: Sequence[bytes], cell_mask: int) -> SavePlan:
        """begin_save for blocks read from SSD or fetched from a peer: the plan's pages are marked as refilling
        (`refilling`, `state_of`: a query may wait for them) until finish_refill or abandon_refill. The mark is
        per page, not per plan: the first plan naming a page to finish or abandon its refill clears it."""
        plan = self.begin_save(ns_id, layout, hashes, cell_mask)
        self._pages.mark_refill(plan.pages, True)
        return plan

    def finish_refill(self, plan: SavePlan, ok: bool) -> list[int]:
        """finish_save_pages for a begin_refill plan (or a split_plan part of one): its pages stop refilling."""
        self._pages.mark_refill(plan.pages, False)
        return self.finish_save_pages(plan, ok)

    def abandon_refill(self, plan: SavePlan) -> None:
        """The plan's pages stop refilling (queries see them missing at once) but stay inflight, reserved for the
        plan, until finish_refill (a transfer that timed out may still write into them)."""
        self._pages.mark_refill(plan.pages, False)

    def refilling(self, pid: int) -> bool:
        """Whether an inflight page is being refilled (read from SSD or a peer)."""
        return pid in self._pages.refill

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
    ) -> PinnedPrefix:
        """Counts the leading sealed hashes and pins them under a lease of `shares` loads (one per worker).
        `count`: whether the namespace's hits and misses count it (not for another node's fetch)."""
        self.expire()
        ns = self._namespaces[ns_id]
        ns.last_used = self._wall_clock()
        pages: list[int] = []
        if self._namespaces.layouts[ns.layout_id].digest != layout.digest:
            ns.refused["digest"] += 1
        else:
            pages = resident_prefix(self._pages, ns.index, ns_id, hashes)
        if count:
            ns.hits += len(pages)
            ns.misses += len(hashes) - len(pages)
            self._observe(ns, hashes, len(pages))
        if not pages:
            return PinnedPrefix(0, 0)
        deadline = self._clock() + (self.lease_ttl_s if ttl_s is None else ttl_s)
        self._pages.pin(pages)
        if count:
            self._pages.promote(pages)  # prefix-slru: a hit
        return PinnedPrefix(len(pages), self._leases.open(owner, tuple(pages), shares, deadline))

    def _observe(self, ns: Namespace, hashes: Sequence[bytes], hit: int) -> None:
        """A counted query, for the namespace's what-if estimates (kvseal.core.ghost), whose capacity follows the
        namespace's resident blocks (re-split when they moved by more than an eighth)."""
        what_if, resident = ns.what_if, ns.resident_blocks
        if abs(resident - what_if.capacity) * 8 > what_if.capacity:
            what_if.resize(resident)
        if not len(what_if):  # nothing evicted lately: the block after the hit is held by no larger pool either
            what_if.observe(hashes, hit)
            return
        index, state = ns.index, self._pages.state

        def held(key: bytes) -> bool:
            pid = index.get(key)
            return pid is not None and state[pid] == SEALED

        what_if.observe(hashes, hit, held)

    def resident(self, ns_id: int, layout: Layout, hashes: Sequence[bytes]) -> list[int | None]:
        """Per hash, the page holding it sealed in the namespace, or None (a hybrid query's presence, anywhere in
        the prompt: a sliding window's blocks need not start at its first block). Nothing is pinned or counted."""
        self.expire()
        ns = self._namespaces[ns_id]
        ns.last_used = self._wall_clock()
        if self._namespaces.layouts[ns.layout_id].digest != layout.digest:
            ns.refused["digest"] += 1
            return [None] * len(hashes)
        state = self._pages.state
        return [pid if pid is not None and state[pid] == SEALED else None for pid in ns.index.get_many(hashes)]

    def lease_pages(
        self, pages: Sequence[int], owner: str, shares: int, ttl_s: float | None = None, *, hit: bool = False
    ) -> int:
        """Pins sealed pages (of any namespaces, found by resident() under the same lock hold) under one lease of
        `shares` loads; 0 when `pages` is empty. `hit`: a query's hit (prefix-slru promotes the pages)."""
        if not pages:
            return 0
        deadline = self._clock() + (self.lease_ttl_s if ttl_s is None else ttl_s)
        for run in self._pages.by_class(pages):
            self._pages.pin(run)
            if hit:
                self._pages.promote(run)
        return self._leases.open(owner, tuple(pages), shares, deadline, mixed=True)

    def count_hits(self, ns_id: int, hits: int, misses: int) -> None:
        """A hybrid query's hits and misses of one group's namespace (query() counts its own)."""
        ns = self._namespaces[ns_id]
        ns.hits += hits
        ns.misses += misses

    def release(self, lease_id: int, owner: str) -> None:
        lease = self._leases.get(lease_id)
        if lease is None or lease.owner != owner:
            raise NotFound(f"lease_id {lease_id} is not an open lease of instance {quote(owner)} (released or expired)")
        self._unpin_lease(self._leases.end(lease))

    def release_owner(self, owner: str) -> int:
        """Ends every lease of an instance (it unregistered or a worker's session dropped)."""
        ended = self._leases.end_owner(owner)
        for lease in ended:
            self._unpin_lease(lease)
        return len(ended)

    def _unpin_lease(self, lease: Lease) -> None:
        for run in self._pages.by_class(lease.pages) if lease.mixed else (lease.pages,):
            self._pages.unpin(run)

    def lease(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    def purge(self, ns_id: int) -> tuple[int, int]:
        """Frees the namespace's sealed pages that nothing pins. Returns (freed, left): pages pinned by a lease or a
        copy, or still inflight, stay until they are released (and are then evicted like any page)."""
        index = self._namespaces[ns_id].index
        freed = self._pages.evictable(list(index.values()))
        self._eviction.forget(freed, evicted=False)
        self._slabs.free(freed)
        return len(freed), len(index)

    # ---------------------------------------------------------------- changes, for the MetaServer

    def track_changes(self) -> None:
        """From now on, record every block that becomes sealed or stops being resident (take_changes)."""
        self._changes.start()

    def take_changes(self) -> list[tuple[bool, int, bytes]]:
        """(sealed, namespace id, hash) of every change since the last call, in order: True = now resident,
        False = no longer resident (evicted or purged)."""
        return self._changes.take()

    def sealed_hashes(self, ns_id: int) -> list[bytes]:
        """The hashes of the namespace's sealed pages (a node announcing everything it holds)."""
        state = self._pages.state
        return [h for h, pid in self._namespaces[ns_id].index.items() if state[pid] == SEALED]

    # ---------------------------------------------------------------- pages for other tiers

    def page(self, ns_id: int, block_hash: bytes) -> int | None:
        """The page id holding `block_hash` in the namespace (inflight or sealed), or None."""
        return self._namespaces[ns_id].index.get(block_hash)

    def pin_pages(self, pids: Sequence[int]) -> None:
        """Pins sealed pages of one namespace (an SSD write reads them): they cannot be evicted until unpinned."""
        self._pages.pin(pids)

    def unpin_pages(self, pids: Sequence[int]) -> None:
        self._pages.unpin(pids)

    def page_offset(self, pid: int) -> int:
        return self._pages.offset[pid]

    def page_hashes(self, pids: Sequence[int]) -> list[bytes]:
        """The hashes of pages in use."""
        return list(map(self._pages.block_hash.__getitem__, pids))  # type: ignore[arg-type]

    def page_hash(self, pid: int) -> bytes:
        block_hash = self._pages.block_hash[pid]
        assert block_hash is not None, "a page in use has a hash"
        return block_hash

    def split_plan(self, plan: SavePlan, keep: Sequence[bool]) -> tuple[SavePlan, SavePlan]:
        """The plan's entries where `keep` is true, and the others (a refill whose records partly failed their
        checks finishes the first as written and the second as not). The first keeps the plan's held pages."""
        parts: tuple[list[int], list[int]] = ([], [])
        for k, flag in enumerate(keep):
            parts[0 if flag else 1].append(k)
        out: list[SavePlan] = []
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
                    [] if out else plan.held,
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
        refusal = compare_layouts(self._namespaces.layouts[ns.layout_id], layout)
        pages: list[int] = []
        outcome, reason, message = "loaded", "", ""
        if refusal is not None and hashes:
            outcome = "refused"
            reason, message = refusal
            ns.refused[reason] += 1
        else:
            pages = resident_prefix(self._pages, ns.index, ns_id, hashes)
            resident = len(pages)
            if resident < len(hashes):
                outcome = "missing"
                message = f"block {resident} of the request ({hashes[resident].hex()[:16]}…) is not resident"
            self._pages.pin(pages)
        if lease_id and (lease := self._leases.get(lease_id)) is not None and lease.owner != owner:
            lease_id = 0
        return LoadPlan(ns_id, pages, self._pages.offsets(pages), outcome, reason, message, lease_id, worker_key)

    def finish_load(self, plan: LoadPlan) -> None:
        self._pages.unpin(plan.pages)
        ended = self._leases.consume(plan.lease_id, plan.worker_key)
        if ended is not None:
            self._unpin_lease(ended)

    # ---------------------------------------------------------------- time

    def expire(self) -> None:
        """Reclaims inflight pages past their timeout and ends expired leases."""
        now = self._clock()
        stale = self._pages.stale(now)
        if stale:
            self._discard(stale)
            self._reclaimed += len(stale)
        for lease in self._leases.expire(now):
            self._unpin_lease(lease)

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
        if self._namespaces.layouts[ns.layout_id].digest != layout.digest:
            return False  # refused by begin_save: nothing is stored
        slabs = self._slabs
        c = slabs.size_class(layout.page_bytes)
        if slabs.room(c, len(hashes)):
            return False
        index = ns.index
        new = len({h for h in hashes if h not in index})
        if not new or slabs.room(c, new):
            return False
        return slabs.reclaim_for(c, self.reclaim_step_pages) > 0

    def reclaim_step(self) -> bool:
        """Continues the slab being emptied (one begun by a begin_save that had no reclaim() before it) by one
        bounded step. Returns whether one is still being emptied."""
        if self._slabs.drain >= 0:
            self._slabs.drain_step(self.reclaim_step_pages)
        return self._slabs.drain >= 0

    def reclaiming(self) -> int:
        """The slab being emptied for another class, or -1."""
        return self._slabs.drain

    def max_page_bytes(self) -> int:
        return self.slab_bytes

    # ---------------------------------------------------------------- introspection

    def statistics(self) -> StoreStatistics:
        pages = self._pages
        return StoreStatistics(
            arena_bytes=self.arena_bytes,
            slab_bytes=self.slab_bytes,
            free_bytes=self.arena_bytes - pages.inflight_bytes - pages.sealed_bytes,
            inflight_bytes=pages.inflight_bytes,
            sealed_bytes=pages.sealed_bytes,
            pinned_bytes=pages.pinned_bytes,
            resident_blocks=pages.resident_blocks,
            inflight_blocks=len(pages.cells),
            pinned_blocks=pages.pinned_blocks,
            leases=len(self._leases),
            evictions=self._eviction.evictions,
            inflight_reclaimed=self._reclaimed,
            leases_expired=self._leases.expired,
        )

    def state_of(self, pid: int) -> PageState:
        """One page id's state, pins, namespace, hash, slab and refill flag (see pages.py's state table)."""
        return self._pages.state_of(pid)

    def page_ids(self) -> list[int]:
        """The ids of every page carved from a slab, in use or free, slab by slab in offset order (the page
        table's other ids are FREE, in no slab, or a size class's ring sentinel)."""
        return [pid for ids in self._slabs.slab_pages for pid in ids]

    def slab_statistics(self) -> SlabStatistics:
        return self._slabs.statistics()

    def lru_order(self, page_bytes: int) -> list[bytes]:
        """Hashes of the class holding `page_bytes` pages, least recently used first (for tests)."""
        c = self._slabs.find_class(page_bytes)
        if c is None:
            return []
        return [self.page_hash(pid) for pid in self._pages.lru_pages(c)]

    def check_invariants(self) -> None:
        """Recounts everything from the page table and asserts it matches the running totals, the slabs, the
        indexes and the leases."""
        self._slabs.check(self._pages.check(), self.arena_bytes)
        self._namespaces.check(self._pages)
        for pid, n in self._leases.pins().items():
            assert self._pages.pins[pid] >= n
