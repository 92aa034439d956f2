"""The hit of a prompt on an instance of several KV cache groups (a hybrid model), and bringing in what makes it
longer: the engine's Query for such instances.

Each group's blocks are pages of their own store namespace (kvseal.core.layout.storage_parts). One query finds,
per group, which of the prompt's blocks are resident, computes the longest prefix every group can serve
(kvseal.core.hybrid.hybrid_hit) and leases exactly the pages that prefix needs, in one lease. When the SSD holds
what makes the hit longer, those blocks are read in (answer: loading); when it does not and other nodes may, the
answer comes with a PeerAsk: the engine asks the MetaServer outside its lock, then `from_peers` fetches what every
group's hit on the offered run is judged on. While blocks are brought in, the hit's resident pages are pinned, so
that the pages taken for the others are never theirs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from kvseal.core.hybrid import hybrid_hit, judged_blocks, needed_blocks
from kvseal.core.layout import SealedInstance
from kvseal.core.store import BlockStore
from kvseal.engine.lock import TimedLock
from kvseal.engine.registry import Instance
from kvseal.engine.results import QueryResult
from kvseal.engine.tiers import Continuation, GroupBlocks, Tiers

REFILL_OWNER = "kvseal.refill"  # the lease that keeps a hybrid hit's resident pages while the rest is brought in


@dataclasses.dataclass(frozen=True, slots=True)
class PeerAsk:
    """What a hybrid query that missed asks other nodes for: each group's block keys, the hit's token limit, the
    group whose run the MetaServer is asked about, and the (store namespace, key) a failed ask is remembered by."""

    keys: list[list[bytes]]
    limit: int
    group: int
    miss: tuple[int, bytes]


class GroupQueries:
    """Queries of hybrid instances, on the engine's store and tiers, under the engine's lock."""

    def __init__(self, lock: TimedLock, store: BlockStore, tiers: Tiers) -> None:
        self._lock = lock
        self.store = store
        self.tiers = tiers

    def query(
        self, inst: Instance, sealed: SealedInstance, hashes: list[bytes], max_tokens: int, ttl_s: float
    ) -> tuple[QueryResult, PeerAsk | None]:
        """The longest prefix every group can serve (kvseal.core.hybrid), its needed pages leased in one lease.
        `hashes` cover block_size tokens each; a group of k times that block size keys its block i by hash
        (i + 1) * k - 1 (the hash at its end). Hits count hashes. When the SSD holds what makes the hit longer,
        those blocks are read into the pool and the answer is `loading`; when it does not, the answer may come
        with what to ask other nodes for (from_peers). Under the lock."""
        step = sealed.layout.block_size
        limit = len(hashes) * step if not max_tokens else min(max_tokens, len(hashes) * step)
        kinds = [part.kind for part in sealed.parts]
        keys = [hashes[part.kind.block_size // step - 1 :: part.kind.block_size // step] for part in sealed.parts]
        found = self._resident_groups(inst, sealed, keys)
        tokens = hybrid_hit(kinds, _present(found), limit, sealed.eagle_groups)
        ttl_ms = int(ttl_s * 1000)
        could = tokens < hybrid_hit(kinds, [[True] * len(k) for k in keys], limit, sealed.eagle_groups)
        if could and self._refilling(inst, keys, found):  # read from SSD or fetched: ask again
            return QueryResult(0, 0, ttl_ms, sealed.namespace_final, loading=True), None
        if could:  # the hit could be longer: the SSD, then other nodes
            held = [self.tiers.ssd.holds(inst.part_key(g), group_keys) for g, group_keys in enumerate(keys)]
            either = [[a or b for a, b in zip(p, h, strict=True)] for p, h in zip(_present(found), held, strict=True)]
            longer = hybrid_hit(kinds, either, limit, sealed.eagle_groups)
            if longer > tokens:
                if self._bring_in(inst, sealed, keys, found, longer, self.tiers.refill_groups) is Continuation.LOADING:
                    return QueryResult(0, 0, ttl_ms, sealed.namespace_final, loading=True), None
        pages: list[int] = []
        for kind, pids, ns_id in zip(kinds, found, inst.ns_ids, strict=True):
            needed = [pids[i] for i in needed_blocks(kind, tokens)]
            self.store.count_hits(ns_id, len(needed), len(pids) - len(needed))
            pages += needed  # type: ignore[arg-type]  # every needed block is present
        lease_id = self.store.lease_pages(pages, inst.instance_id, len(inst.workers), ttl_s, hit=True)
        found_result = QueryResult(tokens // step, lease_id, ttl_ms, sealed.namespace_final)
        ask = None
        dense = next((g for g, kind in enumerate(kinds) if kind.kind != "mamba"), None)
        if could and dense is not None and tokens // kinds[dense].block_size < len(keys[dense]):
            miss = (inst.ns_ids[dense], keys[dense][tokens // kinds[dense].block_size])
            if self.store.page(*miss) is None and self.tiers.may_ask_peers(inst, *miss):
                ask = PeerAsk(keys, limit, dense, miss)
        return found_result, ask

    def from_peers(self, inst: Instance, sealed: SealedInstance, found: QueryResult, ask: PeerAsk) -> QueryResult:
        """Asks the MetaServer which node holds the longest run of the first attention group's blocks (not under
        the lock) and fetches from it what every group needs for the hit that run allows: the attention groups'
        needed blocks within the run, the Mamba state where it ends (a node holds the states where its steps ended;
        when it lacks that one, the fetch gives less and the query serves what this node has). Answers `loading`
        while the fetch runs, else `found`."""
        offered = self.tiers.lookup(sealed.parts[ask.group].name, ask.keys[ask.group])
        with self._lock:
            if offered is not None and inst.sealed is sealed:
                address, count = offered
                kinds = [part.kind for part in sealed.parts]
                found_pids = self._resident_groups(inst, sealed, ask.keys)
                reach = count * kinds[ask.group].block_size  # tokens of the run the peer holds
                assumed = [
                    [
                        pid is not None or kind.kind == "mamba" or (i + 1) * kind.block_size <= reach
                        for i, pid in enumerate(pids)
                    ]
                    for kind, pids in zip(kinds, found_pids, strict=True)
                ]
                tokens = hybrid_hit(kinds, assumed, ask.limit, sealed.eagle_groups)
                fetch = functools.partial(self.tiers.fetch_groups, address, miss=ask.miss)
                if self._bring_in(inst, sealed, ask.keys, found_pids, tokens, fetch) is Continuation.LOADING:
                    if found.lease_id:
                        self.store.release(found.lease_id, inst.instance_id)
                    return found.still_loading()
            self.tiers.note_peer_miss(*ask.miss)
        return found

    def _resident_groups(
        self, inst: Instance, sealed: SealedInstance, keys: list[list[bytes]]
    ) -> list[list[int | None]]:
        """Each group's resident page per block key (None: not resident). Under the lock."""
        return [
            self.store.resident(ns_id, part.layout, group_keys)
            for part, ns_id, group_keys in zip(sealed.parts, inst.ns_ids, keys, strict=True)
        ]

    def _refilling(self, inst: Instance, keys: list[list[bytes]], found: list[list[int | None]]) -> bool:
        """Whether a block of the prompt that is not resident is being read from SSD or fetched. Under the lock."""
        for ns_id, group_keys, pids in zip(inst.ns_ids, keys, found, strict=True):
            for key, pid in zip(group_keys, pids, strict=True):
                if pid is None and (page := self.store.page(ns_id, key)) is not None and self.store.refilling(page):
                    return True
        return False

    def _bring_in(
        self,
        inst: Instance,
        sealed: SealedInstance,
        keys: list[list[bytes]],
        found: list[list[int | None]],
        tokens: int,
        start: Callable[[list[GroupBlocks]], Continuation],
    ) -> Continuation:
        """Starts bringing into the pool (`start`: from the SSD or a peer) the blocks a hit of `tokens` is judged
        on that are not resident. The resident ones are pinned meanwhile, so that the pages taken for the others
        are never theirs (else the next query would miss those and start over). Under the lock."""
        kinds = [part.kind for part in sealed.parts]
        parts, resident = [], []
        for g, part in enumerate(sealed.parts):
            judged = judged_blocks(kinds, g, tokens, sealed.eagle_groups, len(keys[g]))
            resident += [pid for i in judged if (pid := found[g][i]) is not None]
            wanted = [keys[g][i] for i in judged if found[g][i] is None]
            parts.append(GroupBlocks(inst.part_key(g), part.name, part.layout, inst.ns_ids[g], wanted))
        if not any(part.wanted for part in parts):
            return Continuation.NOWHERE
        hold = self.store.lease_pages(resident, REFILL_OWNER, 1)
        try:
            return start(parts)
        finally:
            if hold:
                self.store.release(hold, REFILL_OWNER)


def _present(found: list[list[int | None]]) -> list[list[bool]]:
    return [[pid is not None for pid in pids] for pids in found]
