"""Below the pool: where a query's miss continues, and the I/O that brings blocks back or keeps them.

    query misses at hashes[k]
        page inflight, refilling       -> LOADING    (ask again)
        page inflight, a worker's save -> NOWHERE    (not ours to wait for)
        the SSD holds a run from k     -> LOADING    (a refill from SSD starts now)
        peers, own user's blocks       -> ASK_PEERS  (the engine asks the MetaServer, outside its lock; a peer that
                                                      holds them is fetched from: LOADING)
        otherwise                      -> NOWHERE

A refill (from SSD or a peer) takes inflight pages with the store's begin_refill; the store answers "refilling" for
them until finish_refill seals those that arrived whole and verified and drops the others. Blocks sealed from
anywhere but this node's SSD are written through to it (pinned until written). With no SSD configured the tier is
kvseal.ssd.null.NullTier, which holds and takes nothing.

Thread model: methods said to run "under the lock" are called holding the engine's lock; the reads and fetches run
on this module's own threads and take the lock only for the store's bookkeeping.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from kvseal.core.layout import Layout
from kvseal.core.store import BlockStore, SavePlan
from kvseal.engine.lock import TimedLock
from kvseal.engine.memory import Arena
from kvseal.engine.registry import Instance, tenant
from kvseal.ssd.tier import NamespaceKey, Tier, WriteItem

log = logging.getLogger("kvseal.engine")

PEER_RETRY_S = 2.0  # a prefix no peer could give is not asked for again before this
MAX_PEER_MISSES = 65536
SETTLE_S = 30.0  # how long a timed-out transfer (Mooncake: its progress timeout, 10 s) may still write pages


class Continuation(enum.Enum):
    """Where a prefix that memory does not hold whole continues."""

    NOWHERE = "nowhere"  # the prefix ends here: serve the hits
    LOADING = "loading"  # a refill is under way (perhaps started now): the caller asks again
    ASK_PEERS = "ask_peers"  # ask the MetaServer which peer holds the rest


class PeerSource(Protocol):
    """Other nodes, as a query that misses sees them (kvseal.peer.client.PeerFetcher)."""

    def lookup(self, namespace_final: str, hashes: list[bytes]) -> tuple[str, int] | None:
        """(address, count): the peer holding the longest prefix of `hashes`, or None."""
        ...

    def fetch(
        self,
        address: str,
        namespace_final: str,
        layout: Layout,
        hashes: list[bytes],
        offsets: list[int],
        destinations: list[memoryview],
    ) -> tuple[int, bool]:
        """Fills destinations (pool pages at arena `offsets`) with the peer's pages. Returns how many leading
        pages arrived whole and verified, and whether a transfer that gave up may still write the others (then
        they are not reused before wait_settled)."""
        ...

    def wait_settled(self, timeout_s: float) -> bool:
        """Waits until no transfer that gave up can still write pool pages; False if one still may."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class GroupBlocks:
    """Blocks of one store namespace to bring into the pool: whose (`key`, for the SSD), under which store
    namespace (`name` on other nodes, `ns_id` here), pages of `layout`."""

    key: NamespaceKey
    name: str
    layout: Layout
    ns_id: int
    wanted: list[bytes]


class Tiers:
    def __init__(self, lock: TimedLock, store: BlockStore, arena: Arena, ssd: Tier) -> None:
        self._lock = lock
        self.store = store
        self.arena = arena
        self.ssd = ssd
        self._refills = ThreadPoolExecutor(2, thread_name_prefix="kvseal-refill")  # threads start at first use
        self.peers: PeerSource | None = None
        self._fetches: ThreadPoolExecutor | None = None
        self._peer_misses: dict[tuple[int, bytes], float] = {}  # (ns_id, first missing hash) -> ask again after

    def close(self) -> None:
        """Finishes refills, fetches and SSD writes (the tier seals its segments)."""
        for pool in (self._refills, self._fetches):
            if pool is not None:
                pool.shutdown(wait=True)
        self.ssd.close()

    def use_peers(self, source: PeerSource) -> None:
        """Queries that miss ask `source` (the MetaServer and the peer fetch client) for the rest of the prefix."""
        self.peers = source
        self._fetches = ThreadPoolExecutor(4, thread_name_prefix="kvseal-fetch")

    def page_view(self, pid: int, layout: Layout) -> memoryview:
        at = self.store.page_offset(pid)
        return self.arena.bytes[at : at + layout.page_bytes].data

    # ---------------------------------------------------------------- write-through

    def write_through(self, key: NamespaceKey, layout: Layout, pages: list[int], *, reinsert: bool = False) -> None:
        """Hands freshly sealed pages (in prompt order) the SSD does not hold to its writers, pinned until written;
        under a burst the tier takes the leading ones its queues have room for. `reinsert`: pages just read from
        SSD whose records are aging (Tier.aging), written again so that a block hit on SSD outlives the segment it
        was in (second chance, instead of the log's FIFO). Under the lock."""
        if not pages:
            return
        hashes = self.store.page_hashes(pages)
        chosen = self.ssd.aging(key, hashes) if reinsert else self.ssd.absent(key, hashes)
        if not chosen:
            return
        pages = [pages[i] for i in chosen]
        self.store.pin_pages(pages)
        items = [WriteItem(hashes[i], self.page_view(pid, layout)) for i, pid in zip(chosen, pages, strict=True)]

        taken = len(items)

        def written(ok: bool) -> None:  # takes the lock this caller holds: `taken` is set by then
            with self._lock:
                self.store.unpin_pages(pages[:taken])

        taken = self.ssd.write(key, layout, items, written, reinsert=reinsert)
        self.store.unpin_pages(pages[taken:])

    # ---------------------------------------------------------------- where a miss continues

    def continuation(self, inst: Instance, hashes: list[bytes], start: int) -> Continuation:
        """Where the blocks from hashes[start] on may come from; starts a refill from SSD when it holds them. Under
        the lock."""
        assert inst.sealed is not None
        pid = self.store.page(inst.ns_id, hashes[start])
        if pid is not None:  # inflight: a refill under way, or a worker's save (not ours to wait for)
            return Continuation.LOADING if self.store.refilling(pid) else Continuation.NOWHERE
        if self._refill_from_ssd(inst, hashes, start):
            return Continuation.LOADING
        return Continuation.ASK_PEERS if self.may_ask_peers(inst, inst.ns_id, hashes[start]) else Continuation.NOWHERE

    def refill_groups(self, parts: Sequence[GroupBlocks]) -> Continuation:
        """A hybrid query's blocks that only the SSD holds: starts reading all of them (LOADING), or none: when one
        is inflight already (LOADING while it is refilled, NOWHERE for a worker's save) or the pool has no room for
        them all (NOWHERE). Under the lock."""
        plans = self._begin_group_refills(parts)
        if isinstance(plans, Continuation):
            return plans
        for part, plan in zip(parts, plans, strict=True):
            self._refills.submit(self._refill, part.key, part.layout, [part.wanted[k] for k in plan.positions], plan)
        return Continuation.LOADING

    def fetch_groups(self, address: str, parts: Sequence[GroupBlocks], miss: tuple[int, bytes]) -> Continuation:
        """Like refill_groups, from the peer at `address`: one fetch per group, in one job; a peer that gives less
        of any group notes `miss` (store namespace, hash) so that the query is not asked again at once."""
        plans = self._begin_group_refills(parts)
        if isinstance(plans, Continuation):
            return plans
        jobs = [(part, [part.wanted[k] for k in plan.positions], plan) for part, plan in zip(parts, plans, strict=True)]
        assert self._fetches is not None
        self._fetches.submit(self._fetch_groups, address, jobs, miss)
        return Continuation.LOADING

    def _begin_group_refills(self, parts: Sequence[GroupBlocks]) -> list[SavePlan] | Continuation:
        """Inflight pages for every group's wanted blocks, or none (then where the blocks are: see refill_groups)."""
        for part in parts:
            for block_hash in part.wanted:
                pid = self.store.page(part.ns_id, block_hash)
                if pid is not None:
                    return Continuation.LOADING if self.store.refilling(pid) else Continuation.NOWHERE
        plans: list[SavePlan] = []
        for part in parts:
            plan = self.store.begin_refill(part.ns_id, part.layout, part.wanted, (1 << part.layout.num_slots) - 1)
            plans.append(plan)
            if len(plan.pages) < len(part.wanted):
                for started in plans:
                    self.store.finish_refill(started, ok=False)
                return Continuation.NOWHERE
        return plans

    def _begin_refill(self, inst: Instance, wanted: list[bytes]) -> SavePlan | None:
        """Inflight pages for a refill of `wanted` (full cell mask), or None when the first cannot be had."""
        assert inst.sealed is not None
        layout = inst.sealed.layout
        plan = self.store.begin_refill(inst.ns_id, layout, wanted, (1 << layout.num_slots) - 1)
        if not plan.pages or plan.positions[0] != 0:
            self.store.finish_refill(plan, ok=False)
            return None  # no room for the first block, or it came meanwhile: serve what memory has
        return plan

    def _finish_refill(
        self, key: NamespaceKey, layout: Layout, plan: SavePlan, good: Sequence[bool], *, new: bool = False
    ) -> None:
        """Seals the refill's pages that passed every check, drops the others. `new`: the blocks came from
        elsewhere than this node's SSD, which they are written through to; else those aging there are reinserted."""
        kept, dropped = self.store.split_plan(plan, good)
        with self._lock:
            sealed = self.store.finish_refill(kept, ok=True)
            self.store.finish_refill(dropped, ok=False)
            self.write_through(key, layout, sealed, reinsert=not new)

    # ---------------------------------------------------------------- from SSD

    def _refill_from_ssd(self, inst: Instance, hashes: list[bytes], start: int) -> bool:
        """Starts reading the blocks from hashes[start] on from SSD if it has them and the pool has room."""
        assert inst.sealed is not None
        run = self.ssd.prefix(inst.key, hashes[start:])
        if run == 0:
            return False
        wanted = hashes[start : start + run]
        plan = self._begin_refill(inst, wanted)
        if plan is None:
            return False
        self._refills.submit(self._refill, inst.key, inst.sealed.layout, [wanted[k] for k in plan.positions], plan)
        return True

    def _refill(self, key: NamespaceKey, layout: Layout, hashes: list[bytes], plan: SavePlan) -> None:
        """Reads SSD records into a refill's inflight pages and seals those that passed every check."""
        destinations = [self.arena.bytes[at : at + layout.page_bytes].data for at in plan.offsets]
        try:
            results = self.ssd.read(key, layout, hashes, destinations)
        except Exception:
            log.exception("ssd refill failed")
            results = ["io"] * len(hashes)
        self._finish_refill(key, layout, plan, [r == "" for r in results])

    # ---------------------------------------------------------------- from peers (other nodes)

    def lookup(self, namespace_final: str, hashes: list[bytes]) -> tuple[str, int] | None:
        """Which peer holds the longest prefix of `hashes` (the MetaServer is asked: not under the lock)."""
        assert self.peers is not None
        return self.peers.lookup(namespace_final, hashes)

    def may_ask_peers(self, inst: Instance, ns_id: int, first_missing: bytes) -> bool:
        """Whether a query missing `first_missing` (in store namespace `ns_id`) may ask other nodes: there are
        some, the blocks are the engine's own user's, and no peer failed to give them moments ago. Under the lock."""
        if self.peers is None or inst.key[0] != tenant(os.getuid()):  # other users' blocks never leave the node
            return False
        retry_at = self._peer_misses.get((ns_id, first_missing))
        if retry_at is None:
            return True
        if time.monotonic() < retry_at:
            return False
        del self._peer_misses[(ns_id, first_missing)]
        return True

    def start_peer_fetch(self, inst: Instance, hashes: list[bytes], start: int, offered: tuple[str, int]) -> bool:
        """Starts fetching hashes[start : start + count] from the peer at `address`. Under the lock."""
        address, count = offered
        if inst.sealed is None or count <= 0:
            return False
        wanted = hashes[start : start + min(count, len(hashes) - start)]
        plan = self._begin_refill(inst, wanted)
        if plan is None:
            return False
        assert self._fetches is not None
        part = GroupBlocks(inst.key, inst.sealed.namespace_final, inst.sealed.layout, inst.ns_id, wanted)
        self._fetches.submit(self._fetch_prefix, address, part, [wanted[k] for k in plan.positions], plan)
        return True

    def _fetch_prefix(self, address: str, part: GroupBlocks, hashes: list[bytes], plan: SavePlan) -> None:
        got = self._fetch(address, part, hashes, plan)
        if got < len(hashes):
            with self._lock:
                self.note_peer_miss(plan.namespace_id, hashes[got])

    def _fetch_groups(
        self, address: str, jobs: list[tuple[GroupBlocks, list[bytes], SavePlan]], miss: tuple[int, bytes]
    ) -> None:
        short = False
        for part, hashes, plan in jobs:
            short |= self._fetch(address, part, hashes, plan) < len(hashes)
        if short:
            with self._lock:
                self.note_peer_miss(*miss)

    def _fetch(self, address: str, part: GroupBlocks, hashes: list[bytes], plan: SavePlan) -> int:
        """Fetches a peer's pages into the refill's inflight pages; seals the leading pages that arrived whole and
        verified, and writes them through to SSD. Any failure is a miss of the rest, never a partial page. Returns
        how many arrived."""
        assert self.peers is not None
        layout = part.layout
        destinations = [self.arena.bytes[at : at + layout.page_bytes].data for at in plan.offsets]
        unsettled = False
        try:
            got, unsettled = self.peers.fetch(address, part.name, layout, hashes, plan.offsets, destinations)
        except Exception:
            log.exception("peer fetch from %s failed", address)
            got = 0
        good = [i < got for i in range(len(hashes))]
        if unsettled:  # a transfer that timed out may still write the pages it was given: not to be reused yet
            kept, dropped = self.store.split_plan(plan, good)
            self._finish_refill(part.key, layout, kept, [True] * len(kept.pages), new=True)
            with self._lock:
                self.store.abandon_refill(dropped)  # queries see the miss at once; the pages stay reserved
            if not self.peers.wait_settled(SETTLE_S):
                log.error("a timed-out peer transfer still runs after %.0f s: its pages are freed anyway", SETTLE_S)
            with self._lock:
                self.store.finish_refill(dropped, ok=False)
        else:
            self._finish_refill(part.key, layout, plan, good, new=True)
        return got

    def note_peer_miss(self, ns_id: int, first_missing: bytes) -> None:
        """No peer gave the blocks from `first_missing` on: do not ask again for PEER_RETRY_S. Under the lock."""
        now = time.monotonic()
        if len(self._peer_misses) >= MAX_PEER_MISSES:  # every cold prompt leaves one: keep the live ones only
            self._peer_misses = {k: t for k, t in self._peer_misses.items() if t > now}
            if len(self._peer_misses) >= MAX_PEER_MISSES:
                self._peer_misses.clear()
        self._peer_misses[(ns_id, first_missing)] = now + PEER_RETRY_S
