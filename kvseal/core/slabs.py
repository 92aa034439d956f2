"""The slab allocator: size classes, carving pages out of slabs, and emptying a slab for another class in bounded
steps.

Arena layout
------------

    arena = | slab 0 | slab 1 | ... | slab N-1 |        each slab: slab_bytes, free or owned by one size class
    slab of class c = | page | page | ... | page | tail |   pages of class_bytes[c] (page bytes rounded to 64)

A size class takes a free slab when its slabs are full. When none is free, the class evicts its own least
recently used unpinned pages and reuses them in place (eviction.py); a class with nothing to evict empties a whole
slab of another class whose pages are all evictable (or fails without evicting anything). A slab whose pages are
all free goes back to the pool. Page ids are carved from a slab on first use and the slab keeps the list of its
ids, so emptying it costs its own pages only.

Emptying a slab is done in bounded steps (a slab of 64-byte pages holds a million of them): the slab is *drained*,
at most `budget` (the store's reclaim_step_pages) of its page ids looked at per call, and handed back to the pool
when its last page goes. One slab drains at a time, and only a slab with no pinned or inflight page starts. While
it drains it takes no new pages (it is in no class's partial set), and its pages stay what they were until their
step comes: sealed ones answer queries and may be pinned, its own class may still reuse its least recently used
ones in place. A step evicts only sealed unpinned pages (Eviction.forget); a page that is pinned or inflight when
the step passes it is left, and a pass that ends with pages left starts another if it evicted anything (at most
DRAIN_PASSES passes: a lease's pins are mostly short), else the drain stops and the slab goes back to its class
with whatever is free in it.
"""

from __future__ import annotations

from array import array
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from kvseal.core.eviction import Eviction
from kvseal.core.pages import FREE, PageTable

PAGE_ALIGN = 64
# page ids a slab's drain looks at per step: ~0.7 µs each when evicted (CPython 3.11, 2 vCPUs), so ~1.5 ms a step,
# well under the interpreter's 5 ms switch interval (a step that outlasts it may wait that long again for the GIL)
RECLAIM_STEP_PAGES = 2048
DRAIN_PASSES = 3  # passes over a draining slab before it is given up (pages pinned or written meanwhile)


def page_stride(page_bytes: int) -> int:
    """The bytes a page of `page_bytes` takes in its slab: consecutive pages of a slab are this far apart."""
    return -(-page_bytes // PAGE_ALIGN) * PAGE_ALIGN


@dataclass(frozen=True, slots=True)
class SlabStatistics:
    """The slabs at one moment (for tests and views). Per slab: the page stride of the class it serves (0: free),
    its pages in use, and those of them inflight or pinned. The drain: the slab being emptied for another class
    (-1: none), the index of its next page id, and the pass over it (from 1)."""

    free_slabs: int
    page_bytes: tuple[int, ...]
    used: tuple[int, ...]
    busy: tuple[int, ...]
    draining: int
    drain_at: int
    drain_pass: int


class Slabs:
    def __init__(self, pages: PageTable, eviction: Eviction, n_slabs: int, slab_bytes: int) -> None:
        self._pages = pages
        self._eviction = eviction
        self.n_slabs = n_slabs
        self.slab_bytes = slab_bytes
        # per slab (which class it serves is pages.slab_class: the page table reads it, this module writes it)
        self.free_slabs = list(range(n_slabs - 1, -1, -1))  # popped from the end
        self.slab_pages = [array("i") for _ in range(n_slabs)]  # ids carved from the slab, in offset order
        # carved ids not in use; arrays, like the lists of ids, so that a slab changes hands in a memcpy
        self.slab_free_ids = [array("i") for _ in range(n_slabs)]
        self.slab_used = [0] * n_slabs
        # per size class (its page stride and LRU ring are the page table's)
        self._class_of_size: dict[int, int] = {}
        self.class_capacity: list[int] = []
        self.class_partial: list[dict[int, None]] = []  # slabs with room, as an ordered set
        # the slab being emptied for another class, in steps
        self.drain = -1  # -1: none
        self.drain_at = 0  # its next page, as an index into its page ids
        self.drain_pass = 0  # passes over it begun so far
        self._drain_evicted = False  # whether the current pass evicted anything

    def size_class(self, page_bytes: int) -> int:
        """The class of `page_bytes` pages, created on first use."""
        stride = page_stride(page_bytes)
        c = self._class_of_size.get(stride)
        if c is None:
            if stride > self.slab_bytes:
                raise ValueError(f"page of {page_bytes} bytes exceeds the slab size {self.slab_bytes}")
            c = self._pages.add_class(stride)  # its ring; classes are numbered alike here and there
            assert c == len(self.class_capacity)
            self._class_of_size[stride] = c
            self.class_capacity.append(self.slab_bytes // stride)
            self.class_partial.append({})
        return c

    def find_class(self, page_bytes: int) -> int | None:
        return self._class_of_size.get(page_stride(page_bytes))

    # ---------------------------------------------------------------- allocating and freeing

    def allocate(self, c: int, n: int, budget: int, protected: Collection[int] = ()) -> list[int]:
        """Up to n pages of class c, counted as used in their slabs, for the caller to open at once (evicted ones are
        handed over unwritten: pages.forget's `reused`); fewer only when
        the pool has no more room for the class. In order of preference: free pages of slabs the class holds, free
        slabs, the class's own least recently used pages (evicted and reused in place), whole slabs of other
        classes (emptied, looking at no more than `budget` of their page ids in this call: the rest of a big slab
        is left to later steps, and fewer pages come back meanwhile). Pages in `protected` are not evicted."""
        out: list[int] = []
        partial, capacity, used = self.class_partial[c], self.class_capacity[c], self.slab_used
        while len(out) < n:
            if partial:
                slab = next(iter(partial))
                free_ids = self.slab_free_ids[slab]
                room = min(n - len(out), capacity - used[slab])
                if free_ids:
                    took = free_ids[-room:].tolist()
                    del free_ids[-len(took) :]
                    took.reverse()  # the most recently freed first
                else:
                    took = self._carve(slab, c, room)
                out += took
                used[slab] += len(took)
                if used[slab] == capacity:
                    del partial[slab]
            elif self.free_slabs:
                slab = self.free_slabs.pop()
                self._pages.slab_class[slab] = c
                self._pages.class_pages[c] += capacity
                partial[slab] = None
            elif victims := self._eviction.evict(
                c, min(n - len(out), self._unprotected(c, protected)), protected, reuse=True
            ):
                # prefix-lru evicts a batch last page first: hand its pages back in page order, so copies run forward
                out += reversed(victims) if self._pages.tails_first else victims
            elif budget > 0 and (spent := self.reclaim_for(c, budget)):
                budget -= spent
            else:
                break
        return out

    def _unprotected(self, c: int, protected: Collection[int]) -> int:
        """How many of class c's evictable pages are not in `protected` (pages of class c)."""
        held = len(self._pages.evictable(list(protected))) if protected else 0
        return self._pages.lru_len[c] - held

    def _carve(self, slab: int, c: int, n: int) -> list[int]:
        """The slab's next n page ids, at the next page offsets."""
        pages = self.slab_pages[slab]
        stride = self._pages.class_bytes[c]
        pids = self._pages.new_ids(n)
        self._pages.place(pids, slab, slab * self.slab_bytes + len(pages) * stride, stride)
        pages.extend(pids)
        return pids

    def free(self, pids: Sequence[int], slab: int = -1) -> None:
        """Gives FREE pages back to their slabs (`slab`: the one they all belong to, when the caller knows). A slab
        left with no page in use goes back to the pool, its page ids to the page table (which ends its drain);
        any other slab has room for its class again, unless it is draining."""
        if not pids:
            return
        groups: Iterable[tuple[int, Sequence[int]]] = ((slab, pids),)
        if slab < 0:
            slab_of = self._pages.slab_of
            by_slab: dict[int, list[int]] = {}
            for pid in pids:
                by_slab.setdefault(slab_of[pid], []).append(pid)
            groups = by_slab.items()
        emptied = []
        for s, freed in groups:
            self.slab_free_ids[s].extend(freed)
            self.slab_used[s] -= len(freed)
            if self.slab_used[s] == 0:
                emptied.append(s)
            elif s != self.drain:  # a draining slab takes no new pages
                self.class_partial[self._pages.slab_class[s]][s] = None
        if len(emptied) > 1:  # back to the pool in the order their last pages were freed
            last = {self._pages.slab_of[pid]: k for k, pid in enumerate(pids)}
            emptied.sort(key=last.__getitem__)
        for s in emptied:
            self._release(s)

    def _release(self, slab: int) -> None:
        """Returns a slab none of whose pages is in use to the pool, and its page ids to the page table."""
        c = self._pages.slab_class[slab]
        self.class_partial[c].pop(slab, None)
        self._pages.class_pages[c] -= self.class_capacity[c]
        self._pages.return_ids(self.slab_pages[slab])
        self.slab_pages[slab] = array("i")
        self.slab_free_ids[slab] = array("i")
        self._pages.slab_class[slab] = -1
        self.free_slabs.append(slab)
        if slab == self.drain:
            self.drain = -1

    # ---------------------------------------------------------------- emptying a slab for another class

    def room(self, c: int, n: int) -> bool:
        """Whether class c can have n pages without emptying a slab of another class."""
        capacity = self.class_capacity[c]
        room = self._pages.lru_len[c] + len(self.free_slabs) * capacity
        if room >= n:
            return True
        used = self.slab_used
        for slab in self.class_partial[c]:
            room += capacity - used[slab]
            if room >= n:
                return True
        return False

    def reclaim_for(self, c: int, budget: int) -> int:
        """One step, of at most `budget` page ids, of emptying a slab of another class than c: the one being
        emptied, or else the emptiest whose pages are all evictable. Returns the page ids looked at (0: there is
        none, or the one being emptied is c's own, which gives c nothing)."""
        slab_class = self._pages.slab_class
        if self.drain >= 0:
            if slab_class[self.drain] == c:
                return 0
        else:
            busy = self._pages.slab_busy
            candidates = [s for s in range(self.n_slabs) if slab_class[s] not in (-1, c) and busy[s] == 0]
            if not candidates:
                return 0
            slab = min(candidates, key=self.slab_used.__getitem__)
            self.class_partial[slab_class[slab]].pop(slab, None)  # it takes no new pages while it drains
            self.drain, self.drain_at, self.drain_pass, self._drain_evicted = slab, 0, 1, False
        return self.drain_step(budget)

    def drain_step(self, budget: int) -> int:
        """Evicts the sealed unpinned pages among the draining slab's next `budget` page ids; hands the slab back
        to the pool when its last page is gone. Returns the page ids looked at (at least 1)."""
        slab = self.drain
        pages = self.slab_pages[slab]
        start = self.drain_at
        end = min(len(pages), start + max(budget, 1))
        victims = self._pages.evictable(pages[start:end])
        self.drain_at = end
        if victims:
            self._drain_evicted = True
            self._eviction.forget(victims)
            self.free(victims, slab)  # ends the drain if that was its last page
        if self.drain == slab and end == len(pages):  # pages were pinned or inflight when the pass went by
            if self._drain_evicted and self.drain_pass < DRAIN_PASSES:  # those may be evictable by now
                self.drain_at, self.drain_pass, self._drain_evicted = 0, self.drain_pass + 1, False
            else:  # it cannot be emptied now: back to its class, with what is free in it
                self.drain = -1
                c = self._pages.slab_class[slab]
                if self.slab_used[slab] < self.class_capacity[c]:
                    self.class_partial[c][slab] = None
        return end - start

    # ---------------------------------------------------------------- reading

    def statistics(self) -> SlabStatistics:
        pages = self._pages
        return SlabStatistics(
            free_slabs=len(self.free_slabs),
            page_bytes=tuple(pages.class_bytes[c] if c >= 0 else 0 for c in pages.slab_class),
            used=tuple(self.slab_used),
            busy=tuple(pages.slab_busy),
            draining=self.drain,
            drain_at=self.drain_at,
            drain_pass=self.drain_pass,
        )

    def check(self, slab_used: list[int], arena_bytes: int) -> None:
        """Asserts the slabs agree with the page table (`slab_used`: its count of pages in use per slab) and that
        free + inflight + sealed bytes make the arena."""
        pages = self._pages
        assert slab_used == self.slab_used
        free = len(self.free_slabs) * self.slab_bytes
        owned_ids: set[int] = set()
        for s in range(self.n_slabs):
            c = pages.slab_class[s]
            ids, free_ids = self.slab_pages[s], self.slab_free_ids[s]
            if c < 0:
                assert s in self.free_slabs and not ids and not free_ids and self.slab_used[s] == 0
                continue
            assert self.slab_used[s] > 0
            stride = pages.class_bytes[c]
            free += self.slab_bytes - self.slab_used[s] * stride
            # the slab's ids are its carved pages, at consecutive offsets; the free ones are exactly those FREE
            assert len(ids) <= self.class_capacity[c]
            for k, pid in enumerate(ids):
                assert pages.slab_of[pid] == s and pages.offset[pid] == s * self.slab_bytes + k * stride
            assert sorted(free_ids) == sorted(pid for pid in ids if pages.state[pid] == FREE)
            assert len(ids) - len(free_ids) == self.slab_used[s]
            assert (s in self.class_partial[c]) == (self.slab_used[s] < self.class_capacity[c] and s != self.drain)
            owned_ids.update(ids)
        # every page id is a ring's sentinel, a page of one slab, or free in the page table: none leaks or doubles
        unowned = set(pages.free_ids)
        assert len(owned_ids) == sum(len(p) for p in self.slab_pages) and len(unowned) == len(pages.free_ids)
        assert not owned_ids & unowned and all(pages.state[pid] == FREE for pid in unowned)
        assert len(pages.sentinel) + len(pages.probation) + len(owned_ids) + len(unowned) == len(pages)
        for c, capacity in enumerate(self.class_capacity):  # what prefix-slru's protected share is a share of
            assert pages.class_pages[c] == pages.slab_class.count(c) * capacity
        assert free + pages.inflight_bytes + pages.sealed_bytes == arena_bytes
        if self.drain >= 0:  # a draining slab is in use, takes no new pages, and its cursor is within it
            d = self.drain
            assert pages.slab_class[d] >= 0 and d not in self.class_partial[pages.slab_class[d]]
            assert 0 <= self.drain_at < len(self.slab_pages[d]) and 1 <= self.drain_pass <= DRAIN_PASSES
