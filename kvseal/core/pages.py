"""The page table and the page state table. This module is the only one that writes a page's state, its pin count
or its open writers; everything else asks it to, one batch of pages at a time.

The state table (every transition there is, and who asks for it)
----------------------------------------------------------------

                open (save | refill)                seal (last writer gone, every cell written)
    FREE -------------------------> INFLIGHT --------------------------------------> SEALED <--pin/unpin--> pinned
      ^                                |                                               |
      +-- drop (last writer gone, -----+                                               |
      |   nothing written; or past                                                     |
      |   the deadline with no writer)                                                 |
      +---------------------------- forget (unpinned only: evicted or purged) ----------+

    transition     from -> to                      asked for by (kvseal.core.*)
    open           FREE -> INFLIGHT                BlockStore.begin_save / begin_refill, on pages the allocator gave
    join           INFLIGHT, one writer more       begin_save: a hash already inflight whose cells this worker lacks
    end_writes     INFLIGHT, one writer less       finish_save: says which pages to seal and which to drop
    seal           INFLIGHT -> SEALED (ring: MRU)  finish_save
    drop           INFLIGHT -> FREE                finish_save (nothing written), expire (see `stale`)
    pin / unpin    SEALED, pins +1 / -1            query, begin_load / finish_load, leases, pin_pages (an SSD write),
                                                   begin_save / finish_save (prefix-*: the held blocks a save names)
    forget         SEALED, unpinned -> FREE        eviction.py only: purge, a slab's drain step, LRU eviction
                   (SEALED -> INFLIGHT at once)    LRU eviction for a save, which opens the pages in place
    mark_refill    INFLIGHT, refill flag on / off  begin_refill / finish_refill, abandon_refill
    promote        SEALED (pinned), hot flag on    a counted query's hit (prefix-slru); the flag goes off when the
                                                   protected segment overflows (demotion) or the page is forgotten

- INFLIGHT pages are in their namespace's index (so workers of one instance fill the same page) but never answer
  queries; a refill's inflight pages carry the refill flag (a query may wait for them: they are being read from
  SSD or a peer).
- A SEALED page is pinned while a lease holds it or a load copies from it. The unpinned sealed pages of a size
  class, and only they, are in the class's LRU ring (an intrusive doubly linked list through `prev`/`next`, two
  sentinel page ids per class): eviction only ever sees unpinned sealed pages. The ring is two segments:
  `sentinel` heads the protected one (hot pages: a query hit them, prefix-slru only), `probation` the other; walking
  `prev` from `sentinel` meets probation's least recently used page first and protected's most recent last.

Per page metadata lives in typed arrays indexed by page id (no object per page) to keep a resident block under
256 bytes of engine memory, index entry included; the arrays grow PAGE_TABLE_CHUNK ids at a time. An inflight
page's open writers are counted in `writers`; the cells it has written (a mask may be wider than 64 bits) and its
reclaim deadline live in dicts that hold inflight pages only.

Other modules read the arrays freely (the store's lookups, the allocator, the eviction policy) and write only what
is theirs: the allocator (slabs.py) places carved pages (`place`) and sets `slab_class`.
"""

from __future__ import annotations

import enum
import os
from array import array
from collections import Counter, deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from itertools import islice, repeat

try:
    from kvseal.core import _table
except ImportError:  # not built: the Python reference runs
    _table = None  # type: ignore[assignment]

FREE, INFLIGHT, SEALED, SENTINEL = 0, 1, 2, 3  # PageTable.state values
PAGE_TABLE_CHUNK = 4096  # page ids the page table grows by when none is free


class PageStatus(enum.IntEnum):
    FREE = FREE
    INFLIGHT = INFLIGHT
    SEALED = SEALED
    SENTINEL = SENTINEL  # a class's LRU ring head, not a page


@dataclass(frozen=True, slots=True)
class PageState:
    """One page id as the page table holds it (`state_of`): for tests and views, never for a hot path. Fields
    that only mean something while the page is in use (inflight or sealed) read -1 / None otherwise."""

    page: int
    state: PageStatus
    pins: int
    namespace_id: int
    block_hash: bytes | None
    slab: int
    offset: int
    writers: int  # open save plans naming the page (inflight only)
    cells: int  # cells written so far (inflight only: a sealed page has them all)
    refill: bool  # inflight for a refill (begin_refill): being read from SSD or a peer

    @property
    def in_use(self) -> bool:
        return self.state in (INFLIGHT, SEALED)


class PageTable:
    def __init__(self, n_slabs: int, *, tails_first: bool = False, protected_share: float = 0.0) -> None:
        """`tails_first`: the ring order of the prefix policies (eviction.py): a batch that seals or unpins pages
        links them so that its first page ends the most recent; else LRU in list order (the last page ends the
        most recent). `protected_share` (prefix-slru): the share of a class's pages that `promote` may keep in
        its ring's protected segment (0: nothing is ever promoted, the ring is one segment)."""
        self.tails_first = tails_first
        self.protected_share = protected_share
        # per page id
        self.offset = array("q")  # byte offset in the arena
        self.slab_of = array("i")  # the slab it was carved from (a sentinel's holds its class)
        self.state = array("b")  # FREE (0, what a new id reads) / INFLIGHT / SEALED / SENTINEL
        self.pins = array("i")
        self.prev = array("i")  # LRU ring links (sealed unpinned pages and sentinels only)
        self.next = array("i")
        self.ns_of = array("i")
        self.writers = array("i")  # open save plans naming an inflight page
        self.hot = array("b")  # 1: a sealed page in (or pinned from) its ring's protected segment
        self.block_hash: list[bytes | None] = []
        self.free_ids = array("i")  # ids in no slab, popped from the end
        # inflight pages only
        self.cells: dict[int, int] = {}  # page id -> cells written so far
        self.deadline: dict[int, float] = {}  # the same pages, in the same order -> when one without writers goes
        self.refill: set[int] = set()  # those being refilled from SSD or a peer
        # per size class
        self.class_bytes: list[int] = []  # page stride
        # the class's LRU ring: sentinel.next is the most recently used protected page, .prev the least recently
        # used probation page; `probation` is the second sentinel, between the segments (probation.prev: the least
        # recently used protected page, .next the most recently used probation page)
        self.sentinel: list[int] = []
        self.probation: list[int] = []
        self.lru_len: list[int] = []  # pages in the ring: the class's evictable pages
        self.hot_pages: list[int] = []  # its hot pages (pinned or not)
        self.class_pages: list[int] = []  # the pages of the slabs serving it (slabs.py keeps it)
        # per slab
        self.slab_class = [-1] * n_slabs  # which class the slab serves (-1: free); set by slabs.py only
        self.slab_busy = array("i", bytes(4 * n_slabs))  # its inflight or pinned pages: a slab with none can go
        # totals
        self.inflight_bytes = 0
        self.sealed_bytes = 0
        self.pinned_bytes = 0
        self.pinned_blocks = 0
        self.resident_blocks = 0  # sealed pages

    # ---------------------------------------------------------------- ids, classes, placement

    def __len__(self) -> int:
        return len(self.block_hash)

    def new_ids(self, n: int) -> list[int]:
        """n FREE page ids in no slab, the lowest first; the table grows when it has too few."""
        while len(self.free_ids) < n:
            start = len(self.block_hash)
            for arr in (
                self.offset,
                self.slab_of,
                self.state,  # zero is FREE
                self.pins,
                self.prev,
                self.next,
                self.ns_of,
                self.writers,
                self.hot,
            ):
                arr.frombytes(bytes(PAGE_TABLE_CHUNK * arr.itemsize))
            self.block_hash.extend([None] * PAGE_TABLE_CHUNK)
            self.free_ids.extend(range(start + PAGE_TABLE_CHUNK - 1, start - 1, -1))
        pids = self.free_ids[-n:].tolist()
        del self.free_ids[-n:]
        pids.reverse()  # popped from the end: the lowest ids first
        return pids

    def return_ids(self, pids: array[int]) -> None:
        """Takes back FREE ids of a slab that went back to the pool."""
        self.free_ids.extend(pids)

    def add_class(self, stride: int) -> int:
        """A new size class of `stride`-byte pages, with an empty LRU ring (its two sentinels). Returns its number."""
        c = len(self.class_bytes)
        self.class_bytes.append(stride)
        self.lru_len.append(0)
        self.hot_pages.append(0)
        self.class_pages.append(0)
        sentinel, probation = self.new_ids(2)
        for pid in (sentinel, probation):
            self.state[pid] = SENTINEL
            self.slab_of[pid] = c
        self.prev[sentinel] = self.next[sentinel] = probation
        self.prev[probation] = self.next[probation] = sentinel
        self.sentinel.append(sentinel)
        self.probation.append(probation)
        return c

    def place(self, pids: Sequence[int], slab: int, at: int, stride: int) -> None:
        """Carved ids: pids[k] is the page at byte `at + k * stride`, in `slab`."""
        offset, slab_of = self.offset, self.slab_of
        for pid in pids:
            offset[pid] = at
            slab_of[pid] = slab
            at += stride

    def offsets(self, pids: Sequence[int]) -> list[int]:
        return list(map(self.offset.__getitem__, pids))

    # ---------------------------------------------------------------- FREE -> INFLIGHT -> SEALED | FREE

    def open(self, pids: list[int], ns_id: int, hashes: Sequence[bytes], writers: int, deadline: float) -> None:
        """FREE -> INFLIGHT (or, for pages evicted to be reused, SEALED -> INFLIGHT: `forget`): pages of one size
        class the allocator just handed over, pids[k] for hashes[k], each
        with `writers` open plans and no cell written; dropped at `deadline` if no writer is left by then (the
        caller gives deadlines in increasing order: `stale` stops at the first one ahead)."""
        if not pids:
            return
        state, ns_of, hash_of, writer_count = self.state, self.ns_of, self.block_hash, self.writers
        for pid, block_hash in zip(pids, hashes, strict=True):
            state[pid] = INFLIGHT
            ns_of[pid] = ns_id
            hash_of[pid] = block_hash
            writer_count[pid] = writers
        slab_busy = self.slab_busy
        for slab, count in Counter(map(self.slab_of.__getitem__, pids)).items():
            slab_busy[slab] += count
        self.cells.update(dict.fromkeys(pids, 0))
        self.deadline.update(dict.fromkeys(pids, deadline))
        self.inflight_bytes += len(pids) * self.class_bytes[self.slab_class[self.slab_of[pids[0]]]]

    def join(self, found: Sequence[int | None], cell_mask: int) -> tuple[list[int], list[int], int, int]:
        """A save's hashes as the index found them (None: not stored): the inflight pages the save must write, each
        given one more writer, as (positions, pages); then how many it skips (sealed, or `cell_mask` already
        written) and how many are not stored."""
        state, cells, writers = self.state, self.cells, self.writers
        positions: list[int] = []
        pages: list[int] = []
        skipped = not_stored = 0
        for i, pid in enumerate(found):
            if pid is None:
                not_stored += 1
            elif state[pid] == SEALED or cells[pid] & cell_mask == cell_mask:
                skipped += 1
            else:
                writers[pid] += 1
                positions.append(i)
                pages.append(pid)
        return positions, pages, skipped, not_stored

    def end_writes(self, pids: Sequence[int], written: int, full_mask: int) -> tuple[list[int], list[int]]:
        """One writer of each listed page finished, having written the cells `written`. Returns the pages whose
        last writer that was, taken out of the inflight dicts: (complete: every cell written, to `seal`; empty:
        none written, to `drop`). A page not inflight is skipped (its plan was finished twice: a caller bug).

        A page seals or drops only when its last writer finishes: every plan entry holds a writer, so no plan can
        still be copying into a page that became evictable, and a page id cannot be recycled for another hash
        while a plan naming it is open."""
        cells, deadlines, writers = self.cells, self.deadline, self.writers
        complete: list[int] = []
        empty: list[int] = []
        for pid in pids:
            mask = cells.get(pid)
            if mask is None:
                continue
            mask |= written
            left = writers[pid] - 1
            writers[pid] = left
            if left == 0 and mask == full_mask:
                del cells[pid], deadlines[pid]
                complete.append(pid)
            elif left == 0 and mask == 0:
                del cells[pid], deadlines[pid]
                empty.append(pid)
            else:  # other writers still copying, or cells left for another worker
                cells[pid] = mask
        return complete, empty

    def stale(self, now: float) -> list[int]:
        """The inflight pages past their deadline with no writer, taken out of the inflight dicts (to `drop`)."""
        if not self.cells:
            return []
        writers = self.writers
        stale = []
        for pid, deadline in self.deadline.items():
            if deadline > now:
                break  # deadlines grow with insertion order
            if writers[pid] == 0:
                stale.append(pid)
        for pid in stale:
            del self.cells[pid], self.deadline[pid]
        return stale

    def seal(self, pids: Sequence[int]) -> None:
        """INFLIGHT -> SEALED: pages of one size class (out of the inflight dicts: `end_writes`), each the new most
        recently used of its class, in list order (tails first: in reverse)."""
        pids = self._ring_order(pids)
        state, slab_of, slab_busy = self.state, self.slab_of, self.slab_busy
        for pid in pids:
            state[pid] = SEALED
            slab_busy[slab_of[pid]] -= 1
        if self.refill:
            self.refill.difference_update(pids)
        c = self.slab_class[slab_of[pids[0]]]
        self._link_mru(pids, self.probation[c])
        n = len(pids)
        size = n * self.class_bytes[c]
        self.inflight_bytes -= size
        self.sealed_bytes += size
        self.resident_blocks += n

    def drop(self, pids: Sequence[int]) -> None:
        """INFLIGHT -> FREE (out of the inflight dicts: `end_writes` or `stale`). The caller takes the pages out of
        their index first (it needs their hashes) and gives them back to their slabs after."""
        state, hash_of, slab_of, slab_busy = self.state, self.block_hash, self.slab_of, self.slab_busy
        class_bytes, slab_class = self.class_bytes, self.slab_class
        for pid in pids:
            state[pid] = FREE
            hash_of[pid] = None
            slab = slab_of[pid]
            slab_busy[slab] -= 1
            self.inflight_bytes -= class_bytes[slab_class[slab]]
        if self.refill:
            self.refill.difference_update(pids)

    def mark_refill(self, pids: Sequence[int], refill: bool) -> None:
        """Sets (or clears) the refill flag of inflight pages (a flag per page: clearing it once clears it)."""
        if refill:
            self.refill.update(pids)
        elif self.refill:
            self.refill.difference_update(pids)

    # ---------------------------------------------------------------- SEALED: pins, the ring, leaving

    def pin(self, pids: Sequence[int]) -> None:
        """Pins sealed pages of one size class; a page may be listed more than once. A page pinned for the first
        time leaves the LRU ring: pinned pages are never evicted."""
        pins, prev, nxt, slab_busy, slab_of = self.pins, self.prev, self.next, self.slab_busy, self.slab_of
        newly = 0
        for pid in pids:
            n = pins[pid]
            if n == 0:
                p, q = prev[pid], nxt[pid]
                nxt[p] = q
                prev[q] = p
                slab_busy[slab_of[pid]] += 1
                newly += 1
            pins[pid] = n + 1
        if newly:
            c = self.slab_class[slab_of[pids[0]]]
            self.lru_len[c] -= newly
            self.pinned_blocks += newly
            self.pinned_bytes += newly * self.class_bytes[c]

    def unpin(self, pids: Sequence[int]) -> None:
        """Drops one pin of each page (of one size class, as pinned by `pin`). A page left without pins becomes
        the most recently used of its class, in list order (tails first: in reverse)."""
        if not pids:
            return
        pids = self._ring_order(pids)
        pins, slab_busy, slab_of = self.pins, self.slab_busy, self.slab_of
        unpinned = []
        for pid in pids:
            n = pins[pid] - 1
            pins[pid] = n
            if n == 0:
                slab_busy[slab_of[pid]] -= 1
                unpinned.append(pid)
        if unpinned:
            c = self.slab_class[slab_of[pids[0]]]
            if self.hot_pages[c]:
                hot = self.hot
                self._link_mru([pid for pid in unpinned if not hot[pid]], self.probation[c])
                self._link_mru([pid for pid in unpinned if hot[pid]], self.sentinel[c])
                self._demote(c)
            else:
                self._link_mru(unpinned, self.probation[c])
            self.pinned_blocks -= len(unpinned)
            self.pinned_bytes -= len(unpinned) * self.class_bytes[c]

    def _ring_order(self, pids: Sequence[int]) -> Sequence[int]:
        """The order a batch is linked in (each page becoming the most recent in turn): the list's, or under tails
        first its reverse, so that the batch's first page ends the most recent."""
        return pids[::-1] if self.tails_first else pids

    def by_class(self, pids: Sequence[int]) -> list[list[int]]:
        """`pids` cut into runs of one size class each, in order (for pin and unpin, which take one class)."""
        runs: list[list[int]] = []
        last = -1
        for pid in pids:
            c = self.slab_class[self.slab_of[pid]]
            if c != last:
                runs.append([])
                last = c
            runs[-1].append(pid)
        return runs

    def promote(self, pids: Sequence[int]) -> None:
        """prefix-slru (else nothing): pinned sealed pages of one size class that a query hit become hot; they join
        the protected segment when unpinned."""
        if not self.protected_share or not pids:
            return
        self.hot_pages[self.slab_class[self.slab_of[pids[0]]]] += self._set_hot(pids, True)

    def _set_hot(self, pids: Sequence[int], value: bool) -> int:
        """Sets the pages' hot flags to `value`; returns how many changed."""
        hot, changed = self.hot, 0
        for pid in pids:
            if hot[pid] != value:
                hot[pid] = value
                changed += 1
        return changed

    def _demote(self, c: int) -> None:
        """While class c has more hot pages than its protected share, the least recently used page of the protected
        segment becomes the most recently used of probation; pinned hot pages wait for their unpin."""
        excess = self.hot_pages[c] - int(self.protected_share * self.class_pages[c])
        if excess > 0:
            self.hot_pages[c] -= self._demote_pages(self.sentinel[c], self.probation[c], excess)

    def _demote_pages(self, sentinel: int, probation: int, n: int) -> int:
        """Up to n of the protected segment's least recently used pages stop being hot and become probation's most
        recently used (the sentinel between the segments moves past each); returns how many."""
        prev, nxt, hot = self.prev, self.next, self.hot
        moved = 0
        while moved < n:
            pid = prev[probation]
            if pid == sentinel:
                break
            hot[pid] = 0
            before, after = prev[pid], nxt[probation]
            nxt[pid], prev[after] = after, pid  # probation leaves its place
            nxt[before], prev[probation] = probation, before  # and goes in before pid
            nxt[probation], prev[pid] = pid, probation
            moved += 1
        return moved

    def _link_mru(self, pids: Sequence[int], sentinel: int) -> None:
        """Puts pages at the most recently used end of the segment `sentinel` heads (a class's `sentinel`: its
        protected segment; its `probation`), in order (the last is the most recent)."""
        if not pids:
            return
        prev, nxt = self.prev, self.next
        first = nxt[sentinel]
        for pid in pids:
            prev[first] = pid
            nxt[pid] = first
            first = pid
        prev[first] = sentinel
        nxt[sentinel] = first
        self.lru_len[self.slab_of[sentinel]] += len(pids)

    def lru_victims(self, c: int, n: int, protected: Collection[int] = ()) -> list[int]:
        """The n least recently used pages of class c that are not in `protected`, least recent first (probation's,
        then protected's); [] when the ring has fewer."""
        prev = self.prev
        sentinel, probation = self.sentinel[c], self.probation[c]  # sentinel.prev: the least recently used page
        victims: list[int] = []
        pid = prev[sentinel]
        while pid != sentinel and len(victims) < n:
            if pid != probation and pid not in protected:
                victims.append(pid)
            pid = prev[pid]
        return victims if len(victims) == n else []

    def sealed_prefix(self, found: Sequence[int | None]) -> int:
        """How many leading entries of `found` (page ids; None: a hash not stored) are sealed pages."""
        state = self.state
        for k, pid in enumerate(found):
            if pid is None or state[pid] != SEALED:
                return k
        return len(found)

    def sealed(self, pids: Sequence[int | None]) -> list[int]:
        """The listed pages that are sealed (pinned or not), in list order; None entries are skipped."""
        state = self.state
        return [pid for pid in pids if pid is not None and state[pid] == SEALED]

    def evictable(self, pids: Sequence[int]) -> list[int]:
        """The listed pages that are sealed and unpinned (those in a ring), in list order."""
        state, pins = self.state, self.pins
        return [pid for pid in pids if state[pid] == SEALED and pins[pid] == 0]

    def forget(self, pids: Sequence[int], *, lru_tail: bool = False, reused: bool = False) -> None:
        """SEALED, unpinned -> FREE: pages of one size class leave its ring and hold no hash. Only eviction.py
        calls this (it takes the pages out of their index first). `lru_tail`: the caller guarantees the pages are
        the ring's least recently used ones, least recent first (what LRU eviction takes): they leave in one
        splice. `reused`: the caller guarantees it opens them next, in the same call (a save evicting to make room
        reuses the pages in place): `open` writes their state and hash, so they are not written twice."""
        if not pids:
            return
        c, lru_tail = self._leaving(pids, lru_tail)
        prev, nxt = self.prev, self.next
        if not reused:
            deque(map(self.state.__setitem__, pids, repeat(FREE)), maxlen=0)
            deque(map(self.block_hash.__setitem__, pids, repeat(None)), maxlen=0)
        first = last = pids[0]
        if lru_tail:
            last = pids[-1]
        else:  # pages that follow each other in the ring, less recent first, leave it run by run
            for pid in islice(pids, 1, None):
                if prev[last] == pid:  # the next more recent page: the run goes on
                    last = pid
                    continue
                p, q = prev[last], nxt[first]
                nxt[p] = q
                prev[q] = p
                first = last = pid
        p, q = prev[last], nxt[first]
        nxt[p] = q
        prev[q] = p
        n = len(pids)
        self.lru_len[c] -= n
        self.resident_blocks -= n
        self.sealed_bytes -= n * self.class_bytes[c]

    def _leaving(self, pids: Sequence[int], lru_tail: bool) -> tuple[int, bool]:
        """Pages of one class about to leave its ring (`forget`) stop being hot. Returns their class, and whether
        they may leave in one splice: `lru_tail` unless they span both segments (the least recently used pages
        run through probation first: the last of them hot means they do)."""
        c = self.slab_class[self.slab_of[pids[0]]]
        if self.hot_pages[c]:
            lru_tail = lru_tail and not self.hot[pids[-1]]
            self.hot_pages[c] -= self._set_hot(pids, False)
        return c, lru_tail

    # ---------------------------------------------------------------- reading

    def state_of(self, pid: int) -> PageState:
        st = self.state[pid]
        used = st in (INFLIGHT, SEALED)
        return PageState(
            page=pid,
            state=PageStatus(st),
            pins=self.pins[pid],
            namespace_id=self.ns_of[pid] if used else -1,
            block_hash=self.block_hash[pid],
            slab=self.slab_of[pid] if used else -1,
            offset=self.offset[pid] if used else -1,
            writers=self.writers[pid],
            cells=self.cells.get(pid, 0),
            refill=pid in self.refill,
        )

    def lru_pages(self, c: int) -> list[int]:
        """Class c's ring, least recently used first (probation's pages, then protected's)."""
        out: list[int] = []
        sentinel, probation = self.sentinel[c], self.probation[c]
        pid = self.prev[sentinel]
        while pid != sentinel:
            if pid != probation:
                out.append(pid)
            pid = self.prev[pid]
        return out

    def check(self) -> list[int]:
        """Recounts every page and ring and asserts the running totals match. Returns the pages in use per slab
        (for the allocator's check)."""
        counted = Counter[int]()
        by_state_bytes = Counter[int]()
        pinned = 0
        slab_used = [0] * len(self.slab_busy)
        slab_busy = [0] * len(self.slab_busy)
        for pid in range(len(self)):
            state = self.state[pid]
            assert self.pins[pid] >= 0 and self.writers[pid] >= 0
            if state == SENTINEL:
                continue
            if state == INFLIGHT:
                assert pid in self.cells and self.pins[pid] == 0
            else:
                assert self.writers[pid] == 0 and pid not in self.cells and pid not in self.refill
            if state == FREE:
                assert self.pins[pid] == 0 and self.block_hash[pid] is None
                continue
            slab = self.slab_of[pid]
            counted[state] += 1
            by_state_bytes[state] += self.class_bytes[self.slab_class[slab]]
            slab_used[slab] += 1
            if state == INFLIGHT:
                slab_busy[slab] += 1
            elif self.pins[pid] > 0:
                pinned += 1
                slab_busy[slab] += 1
        assert counted[INFLIGHT] == len(self.cells)
        assert list(self.cells) == list(self.deadline)
        deadlines = list(self.deadline.values())
        assert deadlines == sorted(deadlines)  # stale() stops at the first deadline still ahead
        assert counted[SEALED] == self.resident_blocks
        assert by_state_bytes[INFLIGHT] == self.inflight_bytes
        assert by_state_bytes[SEALED] == self.sealed_bytes
        assert pinned == self.pinned_blocks
        assert slab_busy == list(self.slab_busy)
        lru_pages = 0
        hot_pages = Counter[int]()
        for pid in range(len(self)):
            if self.hot[pid]:
                assert self.state[pid] == SEALED and self.protected_share > 0
                hot_pages[self.slab_class[self.slab_of[pid]]] += 1
        for c, (sentinel, probation) in enumerate(zip(self.sentinel, self.probation, strict=True)):
            ring = 0
            hot = 1  # from the sentinel on: the protected segment, then past `probation` the probation segment
            pid = self.next[sentinel]
            while pid != sentinel:
                assert self.prev[self.next[pid]] == pid
                if pid == probation:
                    assert hot, "one probation sentinel per ring"
                    hot = 0
                else:
                    assert self.state[pid] == SEALED and self.pins[pid] == 0 and self.hot[pid] == hot
                    assert self.slab_class[self.slab_of[pid]] == c
                    ring += 1
                pid = self.next[pid]
            assert not hot, "the probation sentinel is in the ring"
            assert ring == self.lru_len[c]
            assert hot_pages[c] == self.hot_pages[c]
            lru_pages += ring
        assert lru_pages == self.resident_blocks - self.pinned_blocks
        return slab_used


class NativePageTable(PageTable):
    """The same page table with its hot batch loops in C (kvseal/core/_table.c) over the same arrays: what the
    store uses when the extension is built, unless KVSEAL_TABLE=python. PageTable's methods are its reference
    (tests/test_table.py compares the two after every step of the same operations)."""

    def open(self, pids: list[int], ns_id: int, hashes: Sequence[bytes], writers: int, deadline: float) -> None:
        if not pids:
            return
        if len(pids) != len(hashes):
            raise ValueError("open: one hash per page id")
        assert _table is not None
        _table.open(
            self.state,
            self.ns_of,
            self.writers,
            self.slab_busy,
            self.slab_of,
            self.block_hash,
            pids,
            hashes,
            ns_id,
            writers,
        )
        self.cells.update(dict.fromkeys(pids, 0))
        self.deadline.update(dict.fromkeys(pids, deadline))
        self.inflight_bytes += len(pids) * self.class_bytes[self.slab_class[self.slab_of[pids[0]]]]

    def end_writes(self, pids: Sequence[int], written: int, full_mask: int) -> tuple[list[int], list[int]]:
        assert _table is not None
        return _table.end_writes(self.writers, self.cells, self.deadline, pids, written, full_mask)

    def seal(self, pids: Sequence[int]) -> None:
        assert _table is not None
        pids = self._ring_order(pids)
        c = self.slab_class[self.slab_of[pids[0]]]
        _table.seal(self.state, self.prev, self.next, self.slab_busy, self.slab_of, pids, self.probation[c])
        if self.refill:
            self.refill.difference_update(pids)
        n = len(pids)
        self.lru_len[c] += n
        size = n * self.class_bytes[c]
        self.inflight_bytes -= size
        self.sealed_bytes += size
        self.resident_blocks += n

    def pin(self, pids: Sequence[int]) -> None:
        assert _table is not None
        newly = _table.pin(self.pins, self.prev, self.next, self.slab_busy, self.slab_of, pids)
        if newly:
            c = self.slab_class[self.slab_of[pids[0]]]
            self.lru_len[c] -= newly
            self.pinned_blocks += newly
            self.pinned_bytes += newly * self.class_bytes[c]

    def unpin(self, pids: Sequence[int]) -> None:
        if not pids:
            return
        assert _table is not None
        pids = self._ring_order(pids)
        c = self.slab_class[self.slab_of[pids[0]]]
        unpinned = _table.unpin(
            self.pins,
            self.prev,
            self.next,
            self.slab_busy,
            self.slab_of,
            self.hot,
            pids,
            self.probation[c],
            self.sentinel[c],
        )
        if unpinned:
            self.lru_len[c] += unpinned
            self.pinned_blocks -= unpinned
            self.pinned_bytes -= unpinned * self.class_bytes[c]
            if self.hot_pages[c]:
                self._demote(c)

    def forget(self, pids: Sequence[int], *, lru_tail: bool = False, reused: bool = False) -> None:
        if not pids:
            return
        assert _table is not None
        c, lru_tail = self._leaving(pids, lru_tail)
        _table.forget(self.state, self.prev, self.next, self.block_hash, pids, lru_tail, reused)
        n = len(pids)
        self.lru_len[c] -= n
        self.resident_blocks -= n
        self.sealed_bytes -= n * self.class_bytes[c]

    def lru_victims(self, c: int, n: int, protected: Collection[int] = ()) -> list[int]:
        assert _table is not None
        held = set(protected) if protected else None
        return _table.lru_victims(self.prev, self.sentinel[c], n, held, self.probation[c])

    def offsets(self, pids: Sequence[int]) -> list[int]:
        assert _table is not None
        return _table.gather(self.offset, pids)

    def _set_hot(self, pids: Sequence[int], value: bool) -> int:
        assert _table is not None
        return _table.set_hot(self.hot, pids, value)

    def _demote_pages(self, sentinel: int, probation: int, n: int) -> int:
        assert _table is not None
        return _table.demote(self.prev, self.next, self.hot, sentinel, probation, n)


def page_table(
    n_slabs: int, kind: str | None = None, *, tails_first: bool = False, protected_share: float = 0.0
) -> PageTable:
    """The page table the store uses: `kind` "native" (the C loops; an error when the extension is not built) or
    "python" (the reference); None reads KVSEAL_TABLE, native when the extension is built, else python.
    `tails_first`, `protected_share`: PageTable's."""
    kind = kind or os.environ.get("KVSEAL_TABLE", "") or ("native" if _table is not None else "python")
    if kind == "python":
        return PageTable(n_slabs, tails_first=tails_first, protected_share=protected_share)
    if kind != "native":
        raise ValueError(f"KVSEAL_TABLE must be native or python, not {kind!r}")
    if _table is None:
        raise RuntimeError("the native page table (kvseal/core/_table.c) is not built: pip install -e . builds it")
    return NativePageTable(n_slabs, tails_first=tails_first, protected_share=protected_share)
