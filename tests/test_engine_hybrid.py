"""A hybrid instance in-process (no server): each KV cache group's blocks are pages of their own, saved and loaded
through per-group runs with a block table per merged vLLM group, and one Query answers the hybrid hit.

The property: whatever blocks of each group are stored, the Query's hit is exactly kvseal.core.hybrid's rule over
what is present (itself checked against vLLM's coordinator in test_hybrid_oracle.py), the lease holds exactly the
pages that hit needs, and loading them through other block ids gives back every layer's bytes as saved."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvseal.core.hybrid import hybrid_hit, needed_blocks
from kvseal.core.layout import KvGroup
from kvseal.engine.engine import Caller, Engine, QueryResult, Session
from kvseal.engine.tiers import PEER_RETRY_S
from kvseal.errors import InvalidArgument
from kvseal.memfd import SharedArray
from kvseal.ssd.tier import DiskTier
from kvseal.testing import FakePeerSource, MemoryDevice, register_one_rank

SLOT = 256
BLOCKS = 64  # per layer
STEP = 4  # tokens per hash (the registration's block_size)
SESSION = Session(Caller(uid=os.getuid(), pid=os.getpid(), privileged=True))
WORKER = ("h", 0, 0)
# layer -> (group, table): group 1 merges two vLLM groups of one spec, each addressing its blocks by its own ids
LAYERS = {"a.full": (0, 0), "b.window0": (1, 0), "b.window1": (1, 1), "c.state": (2, 0)}

GROUP_KINDS = st.tuples(
    st.sampled_from([KvGroup("full", 4), KvGroup("full", 8)]),
    st.sampled_from([KvGroup("sliding", 4, 9), KvGroup("sliding", 8, 5), KvGroup("chunked", 4, 8)]),
    st.sampled_from([KvGroup("mamba", 4), KvGroup("mamba", 8)]),
)


class Hybrid:
    def __init__(
        self,
        groups: tuple[KvGroup, ...],
        eagle: tuple[int, ...] = (),
        ssd: DiskTier | None = None,
        pool_bytes: int = 16 << 20,
        session: Session = SESSION,
    ) -> None:
        self.groups = groups
        self.shared = SharedArray((len(LAYERS) * BLOCKS, SLOT))
        self.memory = self.shared.array
        self.views = {name: self.memory[i * BLOCKS : (i + 1) * BLOCKS] for i, name in enumerate(LAYERS)}
        self.engine = Engine(pool_bytes, slab_bytes=1 << 20, ssd=ssd)
        status = register_one_rank(
            self.engine,
            "h",
            self.shared,
            self.views,
            namespace="hybrid",
            layout_tag="test",
            dtype="uint8",
            block_size=STEP,
            session=session,
            groups=[(g.kind, g.block_size, g.span) for g in groups],
            group_ids={name: group for name, (group, _) in LAYERS.items()},
            tables={name: table for name, (_, table) in LAYERS.items()},
            eagle_groups=eagle,
        )
        assert status.sealed
        self.namespace_final = status.namespace_final

    def close(self) -> None:
        self.engine.close()
        self.shared.close()

    def layers_of(self, group: int) -> list[tuple[str, int]]:
        return [(name, table) for name, (g, table) in LAYERS.items() if g == group]

    def tables(self, group: int) -> int:
        return 1 + max(table for _, table in self.layers_of(group))


@pytest.fixture
def hybrid() -> Iterator[Hybrid]:
    h = Hybrid((KvGroup("full", 4), KvGroup("sliding", 4, 9), KvGroup("mamba", 8)))
    yield h
    h.close()


def prompt(n: int, salt: int = 0) -> list[bytes]:
    return [(salt << 32 | i).to_bytes(32, "big") for i in range(n)]


def served(h: Hybrid, hs: list[bytes], max_tokens: int, session: Session = SESSION) -> tuple[QueryResult, int]:
    """Queries until the answer is not `loading` (a refill or fetch under way); returns it and how many were."""
    deadline = time.monotonic() + 30
    loading = 0
    while (q := h.engine.query("h", hs, session.caller, max_tokens=max_tokens)).loading:
        loading += 1
        assert time.monotonic() < deadline, "the refill or fetch never finished"
        time.sleep(0.001)  # poll interval of a bounded wait on a real condition (the refill or fetch thread)
    return q, loading


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kinds=GROUP_KINDS, data=st.data())
def test_the_query_hits_what_the_hybrid_rule_says_and_loads_give_back_every_layer(
    kinds: tuple[KvGroup, ...], data: st.DataObject
) -> None:
    eagle = data.draw(st.sampled_from([(), (0,)]))
    h = Hybrid(kinds, eagle)
    try:
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        h.memory[:] = rng.integers(0, 256, h.memory.shape, dtype=np.uint8)
        n = data.draw(st.integers(1, 12))
        hs = prompt(n)
        present, runs, saved = [], [], {}
        for group, kind in enumerate(kinds):
            k = kind.block_size // STEP
            stored = data.draw(st.lists(st.booleans(), min_size=n // k, max_size=n // k))
            blocks = [i for i, s in enumerate(stored) if s]
            ids = [rng.choice(BLOCKS, len(blocks), replace=False).tolist() for _ in range(h.tables(group))]
            runs.append((group, [hs[(i + 1) * k - 1] for i in blocks], ids))
            for name, table in h.layers_of(group):
                for i, block_id in zip(blocks, ids[table], strict=True):
                    saved[name, i] = h.views[name][block_id].copy()
            present.append(stored)
        r = h.engine.save_groups(WORKER, runs, SESSION)
        assert r.completed == sum(len(run[1]) for run in runs)

        limit = data.draw(st.integers(0, n * STEP))
        q = h.engine.query("h", hs, SESSION.caller, max_tokens=limit)
        tokens = hybrid_hit(kinds, present, limit or n * STEP, eagle)
        assert q.hits == tokens // STEP
        needed = [needed_blocks(kind, tokens) for kind in kinds]
        lease = h.engine.store.lease(q.lease_id)
        assert (len(lease.pages) if lease else 0) == sum(map(len, needed))

        h.memory[:] = 0
        loads = []
        for group, kind in enumerate(kinds):
            k = kind.block_size // STEP
            ids = [rng.choice(BLOCKS, len(needed[group]), replace=False).tolist() for _ in range(h.tables(group))]
            loads.append((group, [hs[(i + 1) * k - 1] for i in needed[group]], ids))
        loaded = h.engine.load_groups(WORKER, loads, SESSION, q.lease_id)
        assert (loaded.outcome, loaded.loaded) == ("loaded", sum(map(len, needed)))
        for group, _, ids in loads:
            for name, table in h.layers_of(group):
                for i, block_id in zip(needed[group], ids[table], strict=True):
                    assert np.array_equal(h.views[name][block_id], saved[name, i]), (name, i)
        assert h.engine.store.lease(q.lease_id) is None  # its one share was loaded
        h.engine.store.check_invariants()
    finally:
        h.close()


def test_each_group_is_its_own_namespace_of_pages_of_its_own_layers(hybrid: Hybrid) -> None:
    names = {ns["namespace"]: ns for ns in hybrid.engine.namespaces()}
    for group in range(3):
        part = names[f"{hybrid.namespace_final}/g{group}"]
        assert part["page_bytes"] == SLOT * len(hybrid.layers_of(group))


def test_runs_that_do_not_fit_the_instance_are_refused_naming_what(hybrid: Hybrid) -> None:
    hs = prompt(2)
    with pytest.raises(InvalidArgument, match="group 1 needs 2 block tables"):
        hybrid.engine.save_groups(WORKER, [(1, hs, [[0, 1]])], SESSION)
    with pytest.raises(InvalidArgument, match="group 3 names no KV cache group: the instance has 3"):
        hybrid.engine.save_groups(WORKER, [(3, hs, [[0, 1]])], SESSION)
    with pytest.raises(InvalidArgument, match=r"runs\[0\].block_ids\[1\] has 1 entries but block_hashes has 2"):
        hybrid.engine.save_groups(WORKER, [(1, hs, [[0, 1], [2]])], SESSION)
    with pytest.raises(InvalidArgument, match="block_ids.* out of range"):
        hybrid.engine.load_groups(WORKER, [(0, hs, [[0, BLOCKS]])], SESSION)
    hybrid.engine.save(WORKER, hs, [0, 1], SESSION)  # a one-table Save is group 0's: fine, it has one table
    assert hybrid.engine.store.statistics().resident_blocks == 2  # group 0's two blocks, nothing else
    hybrid.engine.store.check_invariants()


def test_a_load_stops_at_the_first_group_missing_a_block_and_still_ends_the_lease(hybrid: Hybrid) -> None:
    hs = prompt(4)
    hybrid.engine.save_groups(
        WORKER, [(0, hs, [[0, 1, 2, 3]]), (1, hs[2:4], [[4, 5], [6, 7]]), (2, [hs[3]], [[8]])], SESSION
    )
    q = hybrid.engine.query("h", hs, SESSION.caller)
    assert q.hits == 4
    r = hybrid.engine.load_groups(
        WORKER,
        [(0, hs, [[0, 1, 2, 3]]), (1, hs[1:4], [[4, 5, 9], [6, 7, 10]]), (2, [hs[3]], [[8]])],
        SESSION,
        q.lease_id,
    )
    assert (r.outcome, r.loaded) == ("missing", 4)  # group 0's four; group 1's first block (hash 1) was never saved
    assert hybrid.engine.store.lease(q.lease_id) is None
    hybrid.engine.store.check_invariants()


def test_a_restarted_engine_refills_every_group_the_hit_needs_from_ssd() -> None:
    """Each group's pages are written through to SSD under its own namespace; after a restart the query finds the
    hybrid hit on SSD, answers `loading` while it reads exactly the missing needed blocks of every group, then hits
    and loads them byte-exact."""
    kinds = (KvGroup("full", 4), KvGroup("sliding", 4, 9), KvGroup("mamba", 8))
    device = MemoryDevice(16 << 20, 512 << 10)
    hs = prompt(8)
    runs = [(0, hs, [list(range(8))]), (1, hs, [list(range(8)), list(range(8, 16))]), (2, hs[1::2], [[20, 21, 22, 23]])]
    tier = DiskTier([device], batch_bytes=64 << 10)
    tier.open()
    first = Hybrid(kinds, ssd=tier)
    first.memory[:] = np.random.default_rng(3).integers(0, 256, first.memory.shape, dtype=np.uint8)
    saved = {name: view.copy() for name, view in first.views.items()}
    assert first.engine.save_groups(WORKER, runs, SESSION).completed == 8 + 8 + 4
    tier.flush()
    assert tier.statistics().records == 20
    first.close()

    tier = DiskTier([device], batch_bytes=64 << 10)
    tier.open()
    second = Hybrid(kinds, ssd=tier)
    try:
        q, loading = served(second, hs, max_tokens=31)
        assert loading >= 1 and q.hits == 6  # 24 tokens: within the limit, aligned to the Mamba group's 8
        # read from SSD: what the hit of 24 tokens needs, and nothing else
        assert second.engine.store.statistics().resident_blocks == 6 + 2 + 1
        needed = [needed_blocks(kind, 24) for kind in kinds]
        loads = [
            (g, [hs[(i + 1) * (kind.block_size // STEP) - 1] for i in needed[g]], []) for g, kind in enumerate(kinds)
        ]
        second.memory[:] = 0
        ids = {0: [[0, 1, 2, 3, 4, 5]], 1: [[4, 5], [12, 13]], 2: [[22]]}
        r = second.engine.load_groups(WORKER, [(g, h, ids[g]) for g, h, _ in loads], SESSION, q.lease_id)
        assert (r.outcome, r.loaded) == ("loaded", 9)
        for name, (group, table) in LAYERS.items():
            for block_id in ids[group][table]:
                assert np.array_equal(second.views[name][block_id], saved[name][block_id]), name
        second.engine.store.check_invariants()
    finally:
        second.close()


def test_a_refill_under_memory_pressure_never_evicts_what_the_hit_already_has() -> None:
    """A full pool (one slab of 256-byte pages, the full group's and the Mamba group's) holds every block of the hit
    but the Mamba state, which is on SSD: reading it back takes a page, and the resident blocks the hit needs are
    pinned meanwhile, so the LRU page that goes is another's. One `loading`, then the whole hit."""
    kinds = (KvGroup("full", 4), KvGroup("sliding", 4, 9), KvGroup("mamba", 8))
    tier = DiskTier([MemoryDevice(16 << 20, 512 << 10)], batch_bytes=64 << 10)
    tier.open()
    h = Hybrid(kinds, ssd=tier, pool_bytes=2 << 20)  # one slab per page size: 256 and 512 bytes
    try:
        hs = prompt(8)
        per_slab = (1 << 20) // SLOT
        assert h.engine.save_groups(WORKER, [(2, [hs[7]], [[20]])], SESSION).completed == 1  # the oldest page
        assert h.engine.save_groups(WORKER, [(0, hs, [list(range(8))]), (1, hs, [list(range(8))] * 2)], SESSION)
        tier.flush()
        others = prompt(per_slab - 8, salt=1)  # fills the slab: the Mamba state, the LRU page, is evicted
        assert h.engine.save_groups(WORKER, [(0, others, [[0] * len(others)])], SESSION).completed == len(others)
        tier.flush()  # written through: no longer pinned for the writer
        inst = h.engine.registry.find_sealed("h")
        assert inst.sealed is not None
        assert h.engine.store.resident(inst.ns_ids[2], inst.sealed.parts[2].layout, [hs[7]]) == [None]
        reads = tier.statistics().reads
        q, loading = served(h, hs, max_tokens=32)
        assert loading >= 1 and q.hits == 8
        assert tier.statistics().reads - reads == 1  # the state alone: no block of the hit was evicted for it
        h.engine.store.check_invariants()
    finally:
        h.close()


def test_another_users_hybrid_instance_never_asks_a_peer() -> None:
    """Other users' blocks never leave the node, and no other node's are asked for on their behalf."""
    stranger = Session(Caller(uid=os.getuid() + 4242, pid=1))
    h = Hybrid((KvGroup("full", 4), KvGroup("sliding", 4, 9), KvGroup("mamba", 8)), session=stranger)
    try:
        peer = FakePeerSource()
        h.engine.use_peers(peer)
        q = h.engine.query("h", prompt(8), stranger.caller, max_tokens=31)
        assert (q.hits, q.loading) == (0, False) and peer.lookups == []
    finally:
        h.close()


class _PeerNodes:
    """Node A saves a hybrid prompt; node B (same model, empty) asks A through a fake peer source that holds the
    bytes A would serve (its pinned pages, under each group's store namespace)."""

    KINDS = (KvGroup("full", 4), KvGroup("sliding", 4, 9), KvGroup("mamba", 8))

    def __init__(self, mamba_blocks: list[int]) -> None:
        self.a = Hybrid(self.KINDS)
        self.b = Hybrid(self.KINDS)
        self.peer = FakePeerSource()
        self.b.engine.use_peers(self.peer)
        self.hs = prompt(8)
        self.a.memory[:] = np.random.default_rng(5).integers(0, 256, self.a.memory.shape, dtype=np.uint8)
        self.ids = {0: [list(range(8))], 1: [list(range(8)), list(range(8, 16))], 2: [[20, 21, 22, 23]]}
        mamba = [(self.hs[2 * i + 1], self.ids[2][0][i]) for i in mamba_blocks]
        runs = [
            (0, self.hs, self.ids[0]),
            (1, self.hs, self.ids[1]),
            (2, [h for h, _ in mamba], [[i for _, i in mamba]]),
        ]
        self.a.engine.save_groups(WORKER, runs, SESSION)
        sealed = self.a.engine.registry.find_sealed("h").sealed
        assert sealed is not None
        for part, group_keys in zip(sealed.parts, (self.hs, self.hs, self.hs[1::2]), strict=True):
            pin = self.a.engine.pin_for_peer(
                part.name, part.layout.digest, part.layout.page_bytes, group_keys, "b", 60.0
            )  # the leading blocks A holds of each group
            held = group_keys[: len(pin.views)]
            self.peer.hold(part.name, held, [bytes(v) for v in pin.views])

    def query_until_served(self, max_tokens: int) -> QueryResult:
        return served(self.b, self.hs, max_tokens)[0]

    def close(self) -> None:
        self.a.close()
        self.b.close()


def test_a_hybrid_miss_fetches_from_a_peer_exactly_the_pages_every_group_needs() -> None:
    """The MetaServer is asked about the full-attention group's run; the fetch takes, per group, the blocks the
    hit that run allows needs (a set: the sliding group's last blocks, the one Mamba state), then serves them."""
    nodes = _PeerNodes(mamba_blocks=[0, 1, 2, 3])
    try:
        b = nodes.b
        assert b.engine.query("h", nodes.hs, SESSION.caller, max_tokens=31).loading
        q = nodes.query_until_served(31)
        assert q.hits == 6  # 24 tokens: below the limit, aligned to the Mamba group's 8
        name = nodes.a.namespace_final
        assert nodes.peer.lookups == [(f"{name}/g0", 8)]
        assert sorted(nodes.peer.fetches) == [(f"{name}/g0", 6), (f"{name}/g1", 2), (f"{name}/g2", 1)]
        assert b.engine.store.statistics().resident_blocks == 6 + 2 + 1
        b.memory[:] = 0
        needed = {0: range(0, 6), 1: range(4, 6), 2: range(2, 3)}
        runs = []
        for g, kind in enumerate(_PeerNodes.KINDS):
            k = kind.block_size // STEP
            runs.append(
                (g, [nodes.hs[(i + 1) * k - 1] for i in needed[g]], [[t[i] for i in needed[g]] for t in nodes.ids[g]])
            )
        r = b.engine.load_groups(WORKER, runs, SESSION, q.lease_id)
        assert (r.outcome, r.loaded) == ("loaded", 9)
        for g, _, ids in runs:
            for name_, table in b.layers_of(g):
                for block_id in ids[table]:
                    assert np.array_equal(b.views[name_][block_id], nodes.a.views[name_][block_id]), (name_, block_id)
        b.engine.store.check_invariants()
    finally:
        nodes.close()


def test_a_peer_without_the_mamba_state_the_hit_needs_is_a_miss_not_asked_again_at_once() -> None:
    """A holds the attention blocks but not the Mamba state at 24 tokens: B fetches what A gives, serves what it
    can (nothing without a state), and does not ask again within PEER_RETRY_S."""
    nodes = _PeerNodes(mamba_blocks=[0, 1])
    try:
        assert nodes.b.engine.query("h", nodes.hs, SESSION.caller, max_tokens=31).loading
        assert nodes.query_until_served(31).hits == 0
        asked = len(nodes.peer.lookups)
        assert nodes.b.engine.query("h", nodes.hs, SESSION.caller, max_tokens=31).hits == 0
        assert len(nodes.peer.lookups) == asked and PEER_RETRY_S >= 1.0
        assert nodes.b.engine.statistics().store.inflight_blocks == 0
        nodes.b.engine.store.check_invariants()
    finally:
        nodes.close()
