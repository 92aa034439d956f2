"""The block store (kvseal.core.store): pages, leases, eviction and accounting, on a FakeClock.

Every test runs once per page table (test ids [python] / [native]; StoreMachine as TestStoreMachinePython and
TestStoreMachineNative): the autouse `table` fixture sets KVSEAL_TABLE, which BlockStore's default reads, and
make_store asserts the store got it. The native runs are skipped when kvseal/core/_table.c is not built.
"""

from __future__ import annotations

import os
import unittest
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvseal.core import pages
from kvseal.core.eviction import Eviction
from kvseal.core.index import ChangeLog, Namespaces
from kvseal.core.layout import LayerGeometry, Layout, build_layout
from kvseal.core.pages import PageTable
from kvseal.core.slabs import Slabs
from kvseal.core.store import (
    DRAIN_PASSES,
    FREE,
    INFLIGHT,
    SEALED,
    BlockIndex,
    BlockStore,
    LoadPlan,
    PageState,
    PageStatus,
    SavePlan,
)
from kvseal.errors import NotFound
from kvseal.testing.clock import FakeClock

INFLIGHT_TIMEOUT = 60.0
LEASE_TTL = 30.0
NATIVE_BUILT = pages._table is not None
NOT_BUILT = "the native page table (kvseal/core/_table.c) is not built"
TABLES = ["python", pytest.param("native", marks=pytest.mark.skipif(not NATIVE_BUILT, reason=NOT_BUILT))]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test function of this module, once per page table (the `table` fixture is autouse). Not the
    StoreMachine TestCases: unittest-style, they take no parametrized fixture and pick their table themselves."""
    if "table" in metafunc.fixturenames:
        metafunc.parametrize("table", TABLES, indirect=True)


@pytest.fixture(autouse=True)
def table(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str | None]:
    """The page table this test's stores run: BlockStore's default reads KVSEAL_TABLE (None for the TestCases)."""
    kind = getattr(request, "param", None)
    if kind is not None:
        monkeypatch.setenv("KVSEAL_TABLE", kind)
    yield kind


def geo(name: str, segment_bytes: int, segments: int = 1, dtype: str = "bfloat16") -> LayerGeometry:
    return LayerGeometry(name, dtype, segment_bytes, segments, 0, "cpu_attn.avx512")


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def mask(layout: Layout, tp_rank: int) -> int:
    """The cells a worker of `tp_rank` writes when it holds every layer (no pipeline split)."""
    return sum(1 << layout.slot(layer_id, tp_rank) for layer_id in range(len(layout.layers)))


def make_store(
    arena: int,
    slab: int,
    clock: FakeClock,
    reclaim_step_pages: int = 2048,
    table: str | None = None,
    eviction: str = "lru",
) -> BlockStore:
    """A store with the page table `table` (None: BlockStore's default, KVSEAL_TABLE, which the `table` fixture
    sets): asserted, so that a switch the store ignored fails every test instead of testing one table twice.
    `eviction`: LRU unless a test says otherwise (the exact orders below are LRU's)."""
    store = BlockStore(
        arena,
        slab_bytes=slab,
        clock=clock,
        wall_clock=lambda: 1.7e9,
        inflight_timeout_s=INFLIGHT_TIMEOUT,
        lease_ttl_s=LEASE_TTL,
        reclaim_step_pages=reclaim_step_pages,
        table=table,
        eviction=eviction,
    )
    requested = table or os.environ.get("KVSEAL_TABLE")
    if requested:
        assert store.table == requested, f"asked for the {requested} page table, got {store.table}"
    return store


def save(store: BlockStore, ns: int, layout: Layout, hashes: list[bytes], tp_rank: int = 0) -> SavePlan:
    plan = store.begin_save(ns, layout, hashes, mask(layout, tp_rank))
    store.finish_save(plan, ok=True)
    return plan


def index(store: BlockStore, ns: int) -> BlockIndex:
    return store.namespace_stats()[ns][0].index


def resident(store: BlockStore, ns: int) -> dict[bytes, int]:
    """hash -> state, for every page in the namespace's index."""
    return {k: store.state_of(pid).state for k, pid in index(store, ns).items()}


def pid_of(store: BlockStore, ns: int, block_hash: bytes) -> int:
    pid = store.page(ns, block_hash)
    assert pid is not None
    return pid


def check(store: BlockStore) -> None:
    store.check_invariants()
    s = store.statistics()
    assert s.free_bytes + s.inflight_bytes + s.sealed_bytes == s.arena_bytes


# One layer, two tp ranks: a 2048-byte page (cells: bit 0 = tp_rank 0, bit 1 = tp_rank 1).
TP2 = build_layout(16, 2, [geo("model.layers.0.attn", 1024)])
# One layer, one rank: a 1024-byte page; a 4096-byte slab holds 4 of them.
TP1 = build_layout(16, 1, [geo("model.layers.0.attn", 1024)])


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


# ------------------------------------------------------------------------------------------ the table switch


def test_the_store_runs_the_page_table_asked_for(table: str, clock: FakeClock) -> None:
    """KVSEAL_TABLE picks the default, and BlockStore's `table` argument overrides it."""
    assert os.environ["KVSEAL_TABLE"] == table
    assert BlockStore(4096, slab_bytes=4096).table == table
    assert make_store(4096, 4096, clock).table == table
    assert BlockStore(4096, slab_bytes=4096, table="python").table == "python"
    if NATIVE_BUILT:
        assert BlockStore(4096, slab_bytes=4096, table="native").table == "native"
    else:
        with pytest.raises(RuntimeError, match="not built"):
            BlockStore(4096, slab_bytes=4096, table="native")


def test_an_unknown_page_table_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="native or python, not 'c'"):
        BlockStore(4096, slab_bytes=4096, table="c")
    monkeypatch.setenv("KVSEAL_TABLE", "fast")
    with pytest.raises(ValueError, match="native or python, not 'fast'"):
        BlockStore(4096, slab_bytes=4096)


# ------------------------------------------------------------------------------------------ save and query


def test_two_workers_seal_a_page_only_when_every_cell_is_written(clock: FakeClock) -> None:
    store = make_store(1 << 16, 1 << 14, clock)
    ns = store.namespace("m.x", TP2)
    hashes = [h(1), h(2)]

    p0 = store.begin_save(ns, TP2, hashes, mask(TP2, 0))
    assert [e[0] for e in p0.entries] == [0, 1] and p0.skipped == 0 and p0.not_stored == 0
    assert store.finish_save(p0, ok=True) == 0
    assert resident(store, ns) == {h(1): INFLIGHT, h(2): INFLIGHT}
    assert store.query(ns, TP2, hashes, "inst", 2).hits == 0  # inflight pages are not hits
    assert store.statistics().inflight_blocks == 2 and store.statistics().inflight_bytes == 2 * 2048
    check(store)

    again = store.begin_save(ns, TP2, hashes, mask(TP2, 0))  # worker 0's cells are already written
    assert again.entries == [] and again.skipped == 2

    p1 = store.begin_save(ns, TP2, [h(1)], mask(TP2, 1))
    assert [(i, pid) for i, pid, _ in p1.entries] == [(0, p0.entries[0][1])]  # the same page
    assert store.finish_save(p1, ok=True) == 1
    assert resident(store, ns) == {h(1): SEALED, h(2): INFLIGHT}
    q = store.query(ns, TP2, hashes, "inst", 2)
    assert q.hits == 1 and q.lease_id != 0
    store.release(q.lease_id, "inst")

    assert store.finish_save(store.begin_save(ns, TP2, [h(2)], mask(TP2, 1)), ok=True) == 1
    assert store.query(ns, TP2, hashes, "inst", 2).hits == 2
    s = store.statistics()
    assert (s.resident_blocks, s.inflight_blocks, s.sealed_bytes, s.inflight_bytes) == (2, 0, 4096, 0)
    check(store)


def test_query_counts_leading_sealed_hashes_only(clock: FakeClock) -> None:
    store = make_store(1 << 16, 1 << 14, clock)
    ns = store.namespace("m.x", TP2)
    save(store, ns, TP2, [h(1), h(3)], 0)
    save(store, ns, TP2, [h(1), h(3)], 1)
    store.begin_save(ns, TP2, [h(2)], mask(TP2, 0))  # h2 stays inflight
    assert store.query(ns, TP2, [h(1), h(2), h(3)], "inst", 2).hits == 1
    assert store.query(ns, TP2, [h(1), h(3), h(2)], "inst", 2).hits == 2
    miss = store.query(ns, TP2, [h(2), h(1)], "inst", 2)
    assert miss.hits == 0 and miss.lease_id == 0
    assert store.query(ns, TP2, [h(9), h(1)], "inst", 2).hits == 0
    stats = store.namespace_stats()[ns][0]
    assert (stats.hits, stats.misses) == (3, 2 + 1 + 2 + 2)
    assert stats.last_used == 1.7e9
    check(store)


def test_prefix_lookup_by_page_run_agrees_with_the_index(clock: FakeClock) -> None:
    """Query and load first try the run of pages after the first hash's page; whatever the pages hold, the
    answer must be the index's."""
    store = make_store(1 << 16, 1 << 14, clock)
    a = store.namespace("m.a", TP1)
    b = store.namespace("m.b", TP1)
    save(store, a, TP1, [h(i) for i in range(6)])  # consecutive pages
    assert store.query(a, TP1, [h(i) for i in range(6)], "inst", 1).hits == 6
    assert store.query(a, TP1, [h(i) for i in range(2, 5)], "inst", 1).hits == 3
    assert store.query(a, TP1, [h(0), h(1), h(9), h(3)], "inst", 1).hits == 2
    assert store.query(a, TP1, [h(0), h(2), h(1)], "inst", 1).hits == 3  # out of page order: by the index

    # hashes of another namespace on the pages right after: the run must not be taken for namespace a
    save(store, b, TP1, [h(6), h(7)])
    assert store.query(a, TP1, [h(5), h(6), h(7)], "inst", 1).hits == 1
    assert store.query(b, TP1, [h(6), h(7)], "inst", 1).hits == 2

    # a page of the run that is only inflight ends the prefix, wherever the lookup found it
    store.begin_save(a, TP1, [h(8)], mask(TP1, 0))
    assert store.query(a, TP1, [h(5), h(8)], "inst", 1).hits == 1
    plan = store.begin_load(a, TP1, [h(4), h(5), h(8)])
    assert plan.outcome == "missing" and len(plan.pages) == 2
    store.finish_load(plan)
    check(store)


def test_resaving_a_sealed_hash_is_skipped(clock: FakeClock) -> None:
    store = make_store(1 << 16, 1 << 14, clock)
    ns = store.namespace("m.x", TP1)
    save(store, ns, TP1, [h(1), h(2)])
    before = store.statistics()
    plan = store.begin_save(ns, TP1, [h(1), h(2), h(3)], 1)
    assert plan.skipped == 2 and [e[0] for e in plan.entries] == [2]
    assert store.finish_save(plan, ok=True) == 1
    assert store.statistics().resident_blocks == before.resident_blocks + 1
    # another instance with the same layout shares the final namespace: its save is a no-op
    assert store.namespace("m.x", TP1) == ns
    dedup = store.begin_save(ns, TP1, [h(1), h(2), h(3)], 1)
    assert dedup.entries == [] and dedup.skipped == 3
    # another tenant's namespace of the same name and layout shares nothing: its query misses, its save writes
    other = store.namespace("m.x", TP1, tenant=1000)
    assert other != ns and store.query(other, TP1, [h(1)], owner="o", shares=1, ttl_s=1).hits == 0
    assert len(store.begin_save(other, TP1, [h(1)], 1).entries) == 1
    check(store)


def test_failed_save_with_nothing_written_frees_the_page(clock: FakeClock) -> None:
    store = make_store(1 << 16, 1 << 14, clock)
    ns = store.namespace("m.x", TP2)
    plan = store.begin_save(ns, TP2, [h(1)], mask(TP2, 0))
    assert store.finish_save(plan, ok=False) == 0
    assert resident(store, ns) == {}
    assert store.statistics().free_bytes == store.arena_bytes
    check(store)


def test_duplicate_hash_in_one_request(clock: FakeClock) -> None:
    store = make_store(1 << 16, 1 << 14, clock)
    ns = store.namespace("m.x", TP1)
    plan = store.begin_save(ns, TP1, [h(1), h(1)], 1)
    assert len(plan.entries) == 2 and plan.entries[0][1] == plan.entries[1][1]
    assert store.finish_save(plan, ok=True) == 1
    assert resident(store, ns) == {h(1): SEALED}
    failed = store.begin_save(ns, TP1, [h(2), h(2)], 1)
    assert store.finish_save(failed, ok=False) == 0
    assert h(2) not in resident(store, ns)
    check(store)


# ------------------------------------------------------------------------------------------ inflight timeout


def test_inflight_page_is_reclaimed_after_the_timeout(clock: FakeClock) -> None:
    store = make_store(1 << 16, 1 << 14, clock)
    ns = store.namespace("m.x", TP2)
    store.finish_save(store.begin_save(ns, TP2, [h(1)], mask(TP2, 0)), ok=True)  # tp_rank 1 never comes
    clock.advance(INFLIGHT_TIMEOUT - 1)
    store.expire()
    assert resident(store, ns) == {h(1): INFLIGHT}
    clock.advance(1)
    store.expire()
    assert resident(store, ns) == {}
    s = store.statistics()
    assert s.inflight_reclaimed == 1 and s.inflight_blocks == 0 and s.free_bytes == s.arena_bytes
    check(store)


def test_inflight_page_with_a_writer_is_not_reclaimed(clock: FakeClock) -> None:
    store = make_store(1 << 16, 1 << 14, clock)
    ns = store.namespace("m.x", TP2)
    writing = store.begin_save(ns, TP2, [h(1)], mask(TP2, 0))  # still copying
    clock.advance(3 * INFLIGHT_TIMEOUT)
    store.expire()
    assert resident(store, ns) == {h(1): INFLIGHT}
    assert store.statistics().inflight_reclaimed == 0
    assert store.finish_save(writing, ok=True) == 0
    assert resident(store, ns) == {h(1): INFLIGHT}
    store.expire()  # no writer left and past the deadline
    assert resident(store, ns) == {}
    assert store.statistics().inflight_reclaimed == 1
    check(store)


def test_save_after_the_timeout_starts_a_fresh_page(clock: FakeClock) -> None:
    store = make_store(1 << 16, 1 << 14, clock)
    ns = store.namespace("m.x", TP2)
    store.finish_save(store.begin_save(ns, TP2, [h(1)], mask(TP2, 0)), ok=True)
    clock.advance(INFLIGHT_TIMEOUT + 1)
    late = store.begin_save(ns, TP2, [h(1)], mask(TP2, 1))  # expires the stale page first
    assert store.finish_save(late, ok=True) == 0  # tp_rank 0's cells went with the reclaimed page
    assert resident(store, ns) == {h(1): INFLIGHT}
    assert store.finish_save(store.begin_save(ns, TP2, [h(1)], mask(TP2, 0)), ok=True) == 1
    check(store)


# ------------------------------------------------------------------------------------------ leases


@pytest.fixture
def full_pool(clock: FakeClock) -> tuple[BlockStore, int]:
    """A one-slab pool of exactly four 1024-byte pages, holding h0..h3 (h0 least recently used)."""
    store = make_store(4096, 4096, clock)
    ns = store.namespace("m.x", TP1)
    for i in range(4):
        save(store, ns, TP1, [h(i)])
    assert store.lru_order(TP1.page_bytes) == [h(0), h(1), h(2), h(3)]
    assert store.statistics().free_bytes == 0
    return store, ns


def evicts(store: BlockStore, ns: int, new: bytes) -> set[bytes]:
    before = set(resident(store, ns))
    plan = save(store, ns, TP1, [new])
    assert plan.not_stored == 0
    return before - set(resident(store, ns))


def test_a_lease_pins_its_pages(full_pool: tuple[BlockStore, int]) -> None:
    store, ns = full_pool
    lease = store.query(ns, TP1, [h(0), h(1)], "inst", 1)
    assert lease.hits == 2
    s = store.statistics()
    assert (s.pinned_blocks, s.pinned_bytes, s.leases) == (2, 2048, 1)
    assert store.lru_order(TP1.page_bytes) == [h(2), h(3)]  # pinned pages are out of the LRU
    assert evicts(store, ns, h(10)) == {h(2)}
    assert evicts(store, ns, h(11)) == {h(3)}
    assert evicts(store, ns, h(12)) == {h(10)}
    check(store)
    store.release(lease.lease_id, "inst")
    assert store.statistics().pinned_blocks == 0
    assert store.lru_order(TP1.page_bytes) == [h(11), h(12), h(0), h(1)]  # released pages are most recent
    assert evicts(store, ns, h(13)) == {h(11)}
    check(store)


def test_release_of_unknown_or_foreign_lease_is_not_found(full_pool: tuple[BlockStore, int]) -> None:
    store, ns = full_pool
    with pytest.raises(NotFound, match="lease_id 12345"):
        store.release(12345, "inst")
    lease = store.query(ns, TP1, [h(0)], "inst", 1)
    with pytest.raises(NotFound):
        store.release(lease.lease_id, "someone-else")
    assert store.lease(lease.lease_id) is not None
    store.release(lease.lease_id, "inst")
    with pytest.raises(NotFound) as exc:
        store.release(lease.lease_id, "inst")  # twice
    assert exc.value.status == "NOT_FOUND"
    check(store)


def test_a_lease_ends_when_every_worker_consumed_its_share(full_pool: tuple[BlockStore, int]) -> None:
    store, ns = full_pool
    lease = store.query(ns, TP1, [h(0), h(1)], "inst", shares=2)
    plan = store.begin_load(ns, TP1, [h(0), h(1)], lease_id=lease.lease_id, owner="inst", worker_key=(0, 0))
    assert plan.outcome == "loaded" and plan.lease_id == lease.lease_id
    assert [pid for pid, _ in plan.entries] == [pid_of(store, ns, h(0)), pid_of(store, ns, h(1))]
    store.finish_load(plan)
    assert store.lease(lease.lease_id) is not None
    # the same worker loading again does not count twice
    store.finish_load(store.begin_load(ns, TP1, [h(0)], lease_id=lease.lease_id, owner="inst", worker_key=(0, 0)))
    assert store.lease(lease.lease_id) is not None
    assert store.statistics().pinned_blocks == 2
    # another instance cannot consume it
    foreign = store.begin_load(ns, TP1, [h(0)], lease_id=lease.lease_id, owner="other", worker_key=(1, 0))
    assert foreign.lease_id == 0
    store.finish_load(foreign)
    assert store.lease(lease.lease_id) is not None
    second = store.begin_load(ns, TP1, [h(0), h(1)], lease_id=lease.lease_id, owner="inst", worker_key=(1, 0))
    assert store.statistics().pinned_blocks == 2  # pinned by lease and load
    store.finish_load(second)
    assert store.lease(lease.lease_id) is None
    s = store.statistics()
    assert (s.leases, s.pinned_blocks, s.pinned_bytes) == (0, 0, 0)
    with pytest.raises(NotFound):
        store.release(lease.lease_id, "inst")
    check(store)


def test_a_load_pins_until_finished(full_pool: tuple[BlockStore, int]) -> None:
    store, ns = full_pool
    plan = store.begin_load(ns, TP1, [h(0)])
    assert plan.outcome == "loaded" and plan.lease_id == 0
    assert evicts(store, ns, h(10)) == {h(1)}
    store.finish_load(plan)
    assert store.lru_order(TP1.page_bytes) == [h(2), h(3), h(10), h(0)]
    missing = store.begin_load(ns, TP1, [h(2), h(99), h(3)])
    assert missing.outcome == "missing" and len(missing.entries) == 1
    assert "block 1" in missing.message
    store.finish_load(missing)
    check(store)


def test_release_owner_ends_every_lease_of_the_instance(full_pool: tuple[BlockStore, int]) -> None:
    store, ns = full_pool
    a = store.query(ns, TP1, [h(0)], "inst", 2)
    b = store.query(ns, TP1, [h(0), h(1)], "inst", 2)
    other = store.query(ns, TP1, [h(2)], "other", 1)
    assert store.state_of(pid_of(store, ns, h(0))).pins == 2
    assert store.release_owner("inst") == 2
    assert store.release_owner("inst") == 0
    assert store.lease(a.lease_id) is None and store.lease(b.lease_id) is None
    assert store.lease(other.lease_id) is not None
    assert store.statistics().pinned_blocks == 1
    check(store)


def test_a_lease_expires_after_its_ttl(full_pool: tuple[BlockStore, int], clock: FakeClock) -> None:
    store, ns = full_pool
    default = store.query(ns, TP1, [h(0)], "inst", 1)
    short = store.query(ns, TP1, [h(1)], "inst", 1, ttl_s=5.0)
    clock.advance(5.0)
    store.expire()
    assert store.lease(short.lease_id) is None and store.lease(default.lease_id) is not None
    clock.advance(LEASE_TTL - 5.0 - 0.5)
    store.expire()
    assert store.lease(default.lease_id) is not None
    clock.advance(0.5)
    assert evicts(store, ns, h(10)) == {h(2)}  # begin_save expires the lease first, then evicts LRU
    s = store.statistics()
    assert (s.leases, s.leases_expired, s.pinned_blocks) == (0, 2, 0)
    with pytest.raises(NotFound):
        store.release(default.lease_id, "inst")
    check(store)


# ------------------------------------------------------------------------------------------ eviction


def test_eviction_is_lru_and_hits_refresh_recency(full_pool: tuple[BlockStore, int]) -> None:
    store, ns = full_pool
    q = store.query(ns, TP1, [h(1)], "inst", 1)
    store.release(q.lease_id, "inst")
    assert store.lru_order(TP1.page_bytes) == [h(0), h(2), h(3), h(1)]
    assert evicts(store, ns, h(4)) == {h(0)}
    assert evicts(store, ns, h(5)) == {h(2)}
    store.finish_load(store.begin_load(ns, TP1, [h(3)]))  # a load refreshes too
    assert store.lru_order(TP1.page_bytes) == [h(1), h(4), h(5), h(3)]
    assert evicts(store, ns, h(6)) == {h(1)}
    # a skipped re-save does not refresh
    assert store.begin_save(ns, TP1, [h(4)], 1).skipped == 1
    assert evicts(store, ns, h(7)) == {h(4)}
    assert store.lru_order(TP1.page_bytes) == [h(5), h(3), h(6), h(7)]
    assert store.statistics().evictions == 4
    check(store)


def test_prefix_lru_evicts_a_prompts_tail_before_its_head_and_re_saves_refresh(clock: FakeClock) -> None:
    """prefix-lru: a batch (a seal, a lease's release, a load) is linked so its first block ends the most recent;
    a save naming held blocks pins them until it finishes and then links them above its new blocks, first named
    most recent; a save never evicts a block it names (LRU included)."""
    store = make_store(4096, 4096, clock, eviction="prefix-lru")
    ns = store.namespace("m.x", TP1)
    save(store, ns, TP1, [h(0), h(1), h(2)])
    assert store.lru_order(TP1.page_bytes) == [h(2), h(1), h(0)]  # least recent first: the tail goes first
    assert evicts(store, ns, h(3)) == set()  # a free page was left
    assert store.lru_order(TP1.page_bytes) == [h(2), h(1), h(0), h(3)]
    q = store.query(ns, TP1, [h(0), h(1)], "inst", 1)
    store.release(q.lease_id, "inst")
    assert store.lru_order(TP1.page_bytes) == [h(2), h(3), h(1), h(0)]
    store.finish_load(store.begin_load(ns, TP1, [h(2), h(3)]))
    assert store.lru_order(TP1.page_bytes) == [h(1), h(0), h(3), h(2)]
    # a save naming held blocks with one new (a request's prefix h1 h0, then h5): the held ones leave the ring
    # while it runs, the new one takes the least recent page's place (h3), and once it is sealed the held ones
    # are linked above it, the first named most recent: the request's head outlives its tail
    plan = store.begin_save(ns, TP1, [h(1), h(0), h(5)], 1)
    assert (plan.skipped, len(plan.entries)) == (2, 1)
    assert store.lru_order(TP1.page_bytes) == [h(2)]  # h3 evicted for h5, which is inflight; h1 h0 pinned
    store.finish_save(plan, ok=True)
    assert store.lru_order(TP1.page_bytes) == [h(2), h(5), h(0), h(1)]
    # a save whose own held blocks are all that could go stores nothing rather than evict them
    q = store.query(ns, TP1, [h(2)], "inst", 1)
    plan = store.begin_save(ns, TP1, [h(0), h(1), h(5), h(6)], 1)
    assert (plan.skipped, plan.not_stored, plan.entries) == (3, 1, [])
    store.finish_save(plan, ok=True)
    store.release(q.lease_id, "inst")
    assert store.lru_order(TP1.page_bytes) == [h(5), h(1), h(0), h(2)]
    assert store.statistics().evictions == 1
    check(store)


def test_prefix_slru_keeps_hit_blocks_in_a_protected_segment_of_half_the_pool(clock: FakeClock) -> None:
    """prefix-slru: saved blocks enter probation, a query's hit moves them to protected (half the class's pages:
    2 of 4 here; its least recent page goes back to probation's most recent end), eviction takes probation's
    least recent first. The same orders as kvseal.core.policies.PrefixSLRU."""
    store = make_store(4096, 4096, clock, eviction="prefix-slru")
    ns = store.namespace("m.x", TP1)
    save(store, ns, TP1, [h(0), h(1), h(2)])
    assert store.lru_order(TP1.page_bytes) == [h(2), h(1), h(0)]  # all in probation
    q = store.query(ns, TP1, [h(0), h(1)], "inst", 1)
    store.release(q.lease_id, "inst")
    assert store.lru_order(TP1.page_bytes) == [h(2), h(1), h(0)]  # h1 h0 protected now, h0 most recent
    save(store, ns, TP1, [h(3)])  # the free page
    assert store.lru_order(TP1.page_bytes) == [h(2), h(3), h(1), h(0)]
    assert evicts(store, ns, h(4)) == {h(2)}
    assert evicts(store, ns, h(5)) == {h(3)}  # probation before protected, though h3 came after h1 h0
    assert store.lru_order(TP1.page_bytes) == [h(4), h(5), h(1), h(0)]
    q = store.query(ns, TP1, [h(4)], "inst", 1)  # a third protected page: protected's least recent one leaves
    store.release(q.lease_id, "inst")
    assert store.lru_order(TP1.page_bytes) == [h(5), h(1), h(0), h(4)]
    assert evicts(store, ns, h(6)) == {h(5)}
    assert evicts(store, ns, h(7)) == {h(1)}
    assert evicts(store, ns, h(8)) == {h(6)}
    assert store.lru_order(TP1.page_bytes) == [h(7), h(8), h(0), h(4)]
    check(store)


def test_nothing_is_evicted_when_everything_is_pinned(full_pool: tuple[BlockStore, int]) -> None:
    store, ns = full_pool
    lease = store.query(ns, TP1, [h(0), h(1), h(2), h(3)], "inst", 1)
    assert lease.hits == 4
    plan = store.begin_save(ns, TP1, [h(4), h(5)], 1)
    assert plan.entries == [] and plan.not_stored == 2
    assert store.statistics().evictions == 0
    assert set(resident(store, ns)) == {h(0), h(1), h(2), h(3)}
    store.release(lease.lease_id, "inst")
    check(store)


def test_inflight_pages_are_not_evicted(full_pool: tuple[BlockStore, int]) -> None:
    store, ns = full_pool
    writing = store.begin_save(ns, TP1, [h(4), h(5), h(6), h(7)], 1)  # evicts all four sealed pages
    assert len(writing.entries) == 4 and store.statistics().evictions == 4
    blocked = store.begin_save(ns, TP1, [h(8)], 1)
    assert blocked.not_stored == 1 and store.statistics().evictions == 4
    store.finish_save(writing, ok=True)
    assert evicts(store, ns, h(8)) == {h(4)}
    check(store)


def test_cross_class_eviction_empties_an_unpinned_slab(clock: FakeClock) -> None:
    small = TP1  # 1024-byte pages, 4 per slab
    big = build_layout(16, 1, [geo("model.layers.0.attn", 1024, segments=2)])  # 2048-byte pages, 2 per slab
    store = make_store(2 * 4096, 4096, clock)
    ns_small = store.namespace("m.small", small)
    ns_big = store.namespace("m.big", big)
    save(store, ns_small, small, [h(i) for i in range(4)])  # slab A
    save(store, ns_small, small, [h(i) for i in range(4, 8)])  # slab B
    slab_of = {k: store.state_of(pid).slab for k, pid in index(store, ns_small).items()}
    assert len({slab_of[h(i)] for i in range(4)}) == 1 and slab_of[h(0)] != slab_of[h(4)]
    lease = store.query(ns_small, small, [h(1)], "inst", 1)  # slab A has a pinned page

    plan = store.begin_save(ns_big, big, [h(100)], 1)
    assert plan.not_stored == 0 and len(plan.entries) == 1
    assert set(resident(store, ns_small)) == {h(0), h(1), h(2), h(3)}  # the whole of slab B went
    assert store.state_of(plan.entries[0][1]).slab == slab_of[h(4)]
    assert store.statistics().evictions == 4
    store.finish_save(plan, ok=True)
    check(store)

    # the big class now evicts its own LRU page before touching the small class
    assert save(store, ns_big, big, [h(101)]).not_stored == 0
    assert set(resident(store, ns_big)) == {h(100), h(101)}
    assert save(store, ns_big, big, [h(102)]).not_stored == 0
    assert set(resident(store, ns_big)) == {h(101), h(102)}
    assert set(resident(store, ns_small)) == {h(0), h(1), h(2), h(3)}

    # the small class has its own pages; with the big class pinned it cannot take the big slab
    big_lease = store.query(ns_big, big, [h(101), h(102)], "inst", 1)
    assert evicts_in(store, ns_small, small, h(200)) == {h(0)}
    store.release(lease.lease_id, "inst")
    pin_all = store.query(ns_small, small, [h(1), h(2), h(3), h(200)], "inst", 1)
    assert pin_all.hits == 4
    blocked = store.begin_save(ns_small, small, [h(201)], 1)
    assert blocked.not_stored == 1 and store.statistics().evictions == 6
    store.release(big_lease.lease_id, "inst")
    # now the big slab is unpinned: the small class, with nothing of its own to evict, empties it
    plan = store.begin_save(ns_small, small, [h(201)], 1)
    assert plan.not_stored == 0 and resident(store, ns_big) == {}
    store.finish_save(plan, ok=True)
    store.release(pin_all.lease_id, "inst")
    check(store)


def test_emptying_a_slab_shared_by_two_namespaces_keeps_each_count(clock: FakeClock) -> None:
    """Two namespaces in one size class (1000- and 1024-byte pages) share a slab; a third class empties it."""
    odd = build_layout(16, 1, [geo("model.layers.0.attn", 1000)])
    big = build_layout(16, 1, [geo("model.layers.0.attn", 2048)])
    store = make_store(4096, 4096, clock)
    ns_a, ns_b, ns_big = store.namespace("m.a", TP1), store.namespace("m.b", odd), store.namespace("m.big", big)
    save(store, ns_a, TP1, [h(1), h(2)])
    save(store, ns_b, odd, [h(1), h(3)])
    assert store.statistics().free_bytes == 0
    check(store)
    plan = store.begin_save(ns_big, big, [h(9)], 1)
    assert plan.not_stored == 0 and store.statistics().evictions == 4
    assert resident(store, ns_a) == {} and resident(store, ns_b) == {}
    stats = store.namespace_stats()
    assert [(s.resident_blocks, s.resident_bytes) for s, _ in stats] == [(0, 0), (0, 0), (0, 0)]
    assert store.lru_order(TP1.page_bytes) == []
    assert store.finish_save(plan, ok=True) == 1
    assert store.namespace_stats()[ns_big][0].resident_bytes == 2048
    check(store)


def test_a_repeated_hash_is_pinned_per_mention_and_relinked_once(full_pool: tuple[BlockStore, int]) -> None:
    store, ns = full_pool
    lease = store.query(ns, TP1, [h(1), h(1), h(0)], "inst", 1)
    assert lease.hits == 3
    assert store.state_of(pid_of(store, ns, h(1))).pins == 2
    assert store.statistics().pinned_blocks == 2 and store.lru_order(TP1.page_bytes) == [h(2), h(3)]
    load = store.begin_load(ns, TP1, [h(0), h(2), h(0)])
    check(store)
    store.release(lease.lease_id, "inst")
    assert store.lru_order(TP1.page_bytes) == [h(3), h(1)]  # h0 and h2 are still pinned by the load
    store.finish_load(load)
    assert store.lru_order(TP1.page_bytes) == [h(3), h(1), h(2), h(0)]
    assert store.statistics().pinned_blocks == 0
    check(store)


def test_page_ids_come_back_when_slabs_change_hands(clock: FakeClock) -> None:
    """A slab's page ids return to the page table when it empties (check_invariants accounts for every id)."""
    store = make_store(4 * 4096, 4096, clock)
    small, big = TP1, build_layout(16, 1, [geo("model.layers.0.attn", 2048)])
    ns_small, ns_big = store.namespace("m.small", small), store.namespace("m.big", big)
    for round_ in range(12):
        layout, ns = (small, ns_small) if round_ % 2 else (big, ns_big)
        plan = store.begin_save(ns, layout, [h(100 * round_ + i) for i in range(16)], 1)
        assert len(plan.entries) == 4 * 4096 // layout.page_bytes  # it took every slab of the other class
        store.finish_save(plan, ok=round_ % 3 != 0)
        check(store)
    assert store.statistics().evictions > 0


def evicts_in(store: BlockStore, ns: int, layout: Layout, new: bytes) -> set[bytes]:
    before = set(resident(store, ns))
    assert save(store, ns, layout, [new]).not_stored == 0
    return before - set(resident(store, ns))


def test_free_slab_goes_back_to_the_pool(clock: FakeClock) -> None:
    store = make_store(2 * 4096, 4096, clock)
    ns = store.namespace("m.x", TP1)
    plan = store.begin_save(ns, TP1, [h(i) for i in range(8)], 1)
    assert len(plan.entries) == 8
    store.finish_save(plan, ok=False)
    assert store.slab_statistics().free_slabs == 2
    big = build_layout(16, 1, [geo("a", 4000)])
    ns_big = store.namespace("m.big", big)
    assert save(store, ns_big, big, [h(1), h(2)]).not_stored == 0
    check(store)


def test_sealed_page_is_not_recycled_while_a_second_writer_copies(clock: FakeClock) -> None:
    """Regression: two concurrent saves of one hash by the same worker. The page must not seal (and become
    evictable) while the second copy is still in progress, or a stale finish_save seals a recycled page."""
    store = make_store(2048, 2048, clock)  # two 1024-byte pages
    ns = store.namespace("m.x", TP1)
    r1 = store.begin_save(ns, TP1, [h(1)], 1)
    r2 = store.begin_save(ns, TP1, [h(1)], 1)  # the first copy is not finished: joins as a writer
    assert r2.entries and r2.entries[0][1] == r1.entries[0][1]
    store.finish_save(r1, ok=True)
    save(store, ns, TP1, [h(2)])
    r3 = store.begin_save(ns, TP1, [h(3)], 1)
    assert r3.not_stored == 0
    assert h(1) in resident(store, ns)  # r2 still writes into h1's page: it was not evicted
    assert r3.entries[0][1] != r1.entries[0][1]
    assert store.finish_save(r2, ok=True) == 1
    assert resident(store, ns) == {h(1): SEALED, h(3): INFLIGHT}  # h3 waits for its own writer
    assert store.finish_save(r3, ok=True) == 1
    check(store)


# ------------------------------------------------------------------------------------------ layout refusal

BASE = build_layout(16, 2, [geo("model.layers.0.attn", 1024, 2), geo("model.layers.1.attn", 512, 2)])
MORE_SLOTS = build_layout(16, 2, [*BASE.layers, geo("model.layers.2.attn", 512, 2)])  # an MTP drafter layer more
OTHER_SLOT_SIZE = build_layout(16, 2, [geo("model.layers.0.attn", 1024, 2), geo("model.layers.1.attn", 256, 2)])
OTHER_DTYPE = build_layout(
    16, 2, [geo("model.layers.0.attn", 1024, 2, "float16"), geo("model.layers.1.attn", 512, 2, "float16")]
)


@pytest.mark.parametrize(
    ("other", "reason", "words"),
    [
        (MORE_SLOTS, "slot_count", ["4 slots", "6"]),
        (OTHER_SLOT_SIZE, "slot_bytes", ["slot 2", "model.layers.1.attn", "tp_rank 0", "1024", "512"]),
        (OTHER_DTYPE, "digest", [BASE.digest.hex(), OTHER_DTYPE.digest.hex()]),
    ],
)
def test_fingerprint_collision_is_refused(clock: FakeClock, other: Layout, reason: str, words: list[str]) -> None:
    assert other.digest != BASE.digest
    if reason == "digest":
        assert other.slot_sizes == BASE.slot_sizes
    store = make_store(1 << 16, 1 << 14, clock)
    forced = "m.deadbeef"
    ns = store.namespace(forced, BASE)
    assert store.namespace(forced, other) == ns  # the collision: same final namespace, another layout
    assert store.layout_of(ns) == BASE
    for tp_rank in (0, 1):
        save(store, ns, BASE, [h(1), h(2)], tp_rank)
    assert store.query(ns, BASE, [h(1), h(2)], "a", 1).hits == 2

    plan = store.begin_load(ns, other, [h(1), h(2)], owner="b", worker_key=(0, 0))
    assert plan.outcome == "refused" and plan.reason == reason and plan.entries == []
    for word in words:
        assert word in plan.message
    store.finish_load(plan)
    q = store.query(ns, other, [h(1), h(2)], "b", 2)
    assert q.hits == 0 and q.lease_id == 0
    refused_save = store.begin_save(ns, other, [h(3)], 1)
    assert refused_save.entries == [] and refused_save.not_stored == 1
    stats, layout = store.namespace_stats()[ns]
    assert layout == BASE
    assert stats.refused[reason] >= 1
    expected = {reason: 1}
    expected["digest"] = expected.get("digest", 0) + 2  # the query and the save compare digests
    assert dict(stats.refused) == expected
    assert store.begin_load(ns, BASE, [h(1), h(2)]).outcome == "loaded"


# ------------------------------------------------------------------------------------------ emptying a slab in steps

TINY = build_layout(16, 1, [geo("model.layers.0.attn", 64)])  # 64-byte pages: 1024 in a 64 KiB slab
BIG = build_layout(16, 1, [geo("model.layers.0.attn", 4096)])  # 4 KiB pages: 16 in a 64 KiB slab
TINY_SLAB = 1 << 16
STEP = 100


def tiny_pool(clock: FakeClock) -> tuple[BlockStore, int, int, list[bytes]]:
    """A one-slab pool full of 1024 sealed 64-byte pages, emptied STEP page ids at a time."""
    store = make_store(TINY_SLAB, TINY_SLAB, clock, reclaim_step_pages=STEP)
    ns_tiny, ns_big = store.namespace("m.tiny", TINY), store.namespace("m.big", BIG)
    tiny = [h(i) for i in range(1024)]
    for i in range(0, 1024, 256):
        save(store, ns_tiny, TINY, tiny[i : i + 256])
    assert store.statistics().free_bytes == 0 and store.statistics().resident_blocks == 1024
    return store, ns_tiny, ns_big, tiny


def step(store: BlockStore, ns: int, layout: Layout, hashes: list[bytes]) -> bool:
    """One reclaim() call, checked: it looks at no more than STEP page ids and evicts no more than STEP pages."""
    evictions, slab, at = store.statistics().evictions, store.reclaiming(), store.slab_statistics().drain_at
    more = store.reclaim(ns, layout, hashes)
    assert store.statistics().evictions - evictions <= STEP
    if store.reclaiming() >= 0 and store.reclaiming() == slab:
        now = store.slab_statistics().drain_at
        assert 0 < now - at <= STEP or now < at  # within the pass, or a new pass began
    check(store)
    return more


def test_a_slab_of_many_small_pages_is_emptied_in_bounded_steps(clock: FakeClock) -> None:
    store, ns_tiny, ns_big, tiny = tiny_pool(clock)
    steps = 0
    while step(store, ns_big, BIG, [h(5000)]):
        steps += 1
        if store.reclaiming() >= 0:  # between steps the slab is in use: its pages not yet passed still answer
            assert store.query(ns_tiny, TINY, [tiny[-1]], "inst", 1).hits == 1
            store.release_owner("inst")
    assert steps == -(-1024 // STEP)  # ceil(1024 / STEP): each step looked at STEP page ids, the last at the rest
    assert store.reclaiming() == -1 and store.statistics().evictions == 1024
    plan = store.begin_save(ns_big, BIG, [h(5000)], 1)
    assert plan.not_stored == 0 and store.statistics().evictions == 1024  # the free slab: nothing else went
    store.finish_save(plan, ok=True)
    assert resident(store, ns_tiny) == {} and list(resident(store, ns_big)) == [h(5000)]
    check(store)


def test_pages_pinned_or_written_during_the_steps_stay_until_a_later_pass(clock: FakeClock) -> None:
    store, ns_tiny, ns_big, tiny = tiny_pool(clock)
    assert step(store, ns_big, BIG, [h(5000)])  # page ids 0..99 looked at: those pages are gone
    assert store.query(ns_tiny, TINY, [tiny[0]], "inst", 1).hits == 0
    ahead = store.query(ns_tiny, TINY, [tiny[500]], "inst", 1)  # pinned before its step comes
    assert ahead.hits == 1
    # the tiny class, with no slab to take, reuses its own least recently used pages in place (pages of the slab
    # being emptied): they are inflight while the copy runs, and sealed afterwards
    writing = store.begin_save(ns_tiny, TINY, [h(9000), h(9001)], 1)
    assert len(writing.pages) == 2 and store.state_of(writing.pages[0]).state == INFLIGHT
    check(store)
    while store.reclaiming() >= 0 and store.slab_statistics().drain_pass == 1:
        assert step(store, ns_big, BIG, [h(5000)])
    # the first pass is over: the pinned page and the two being written are still there
    assert set(resident(store, ns_tiny)) == {tiny[500], h(9000), h(9001)}
    assert store.state_of(pid_of(store, ns_tiny, tiny[500])).state == SEALED
    store.finish_save(writing, ok=True)
    store.release(ahead.lease_id, "inst")
    while step(store, ns_big, BIG, [h(5000)]):
        pass
    assert resident(store, ns_tiny) == {} and store.statistics().evictions == 1024 + 2
    assert save(store, ns_big, BIG, [h(5000)]).not_stored == 0
    check(store)


def test_a_slab_with_a_page_pinned_throughout_goes_back_to_its_class(clock: FakeClock) -> None:
    store, ns_tiny, ns_big, tiny = tiny_pool(clock)
    assert step(store, ns_big, BIG, [h(5000)])
    lease = store.query(ns_tiny, TINY, [tiny[700]], "inst", 1)
    calls = 1
    while step(store, ns_big, BIG, [h(5000)]):
        calls += 1
    # one pass over the slab, and a second that evicted nothing: the slab cannot be emptied now
    assert store.reclaiming() == -1 and calls == 2 * -(-1024 // STEP)
    assert list(resident(store, ns_tiny)) == [tiny[700]] and store.statistics().evictions == 1023
    assert store.begin_save(ns_big, BIG, [h(5000)], 1).not_stored == 1  # no room, and nothing more evicted
    assert store.statistics().evictions == 1023
    # the slab is its class's again, with 1023 free pages: a tiny save takes them without evicting
    assert save(store, ns_tiny, TINY, [h(9000 + i) for i in range(1000)]).not_stored == 0
    assert store.statistics().evictions == 1023
    store.release(lease.lease_id, "inst")
    check(store)


def test_a_drain_gives_up_after_its_passes(clock: FakeClock) -> None:
    """A pass that evicted something and left pages starts another (pages pinned when it went by may be free by
    then); DRAIN_PASSES passes at most."""
    store, ns_tiny, ns_big, tiny = tiny_pool(clock)
    assert step(store, ns_big, BIG, [h(5000)])  # only a slab with nothing pinned starts being emptied
    a = store.query(ns_tiny, TINY, [tiny[1022]], "inst", 1)
    b = store.query(ns_tiny, TINY, [tiny[1023]], "other", 1)
    passes = [1]
    while step(store, ns_big, BIG, [h(5000)]):
        drain_pass = store.slab_statistics().drain_pass
        if store.reclaiming() >= 0 and drain_pass not in passes:
            passes.append(drain_pass)
            if drain_pass == 2:  # the second pass finds one of the two pages free, the third none
                store.release(a.lease_id, "inst")
    assert passes == list(range(1, DRAIN_PASSES + 1)) and store.reclaiming() == -1
    assert list(resident(store, ns_tiny)) == [tiny[1023]] and store.statistics().evictions == 1023
    store.release(b.lease_id, "other")
    check(store)


def test_begin_save_alone_spends_one_step_and_reclaim_step_finishes(clock: FakeClock) -> None:
    """Without reclaim() first (a refill), begin_save looks at STEP page ids of the slab at most and stores what
    fits; reclaim_step() (the engine's tick) finishes the slab."""
    store, _, ns_big, _ = tiny_pool(clock)
    plan = store.begin_save(ns_big, BIG, [h(5000)], 1)
    assert plan.not_stored == 1 and store.statistics().evictions == STEP and store.reclaiming() >= 0
    check(store)
    steps = 0
    while store.reclaim_step():
        steps += 1
        assert store.statistics().evictions <= STEP * (steps + 1)
        check(store)
    assert store.statistics().evictions == 1024 and store.statistics().free_bytes == TINY_SLAB
    assert save(store, ns_big, BIG, [h(5000)]).not_stored == 0
    assert not store.reclaim_step()


def test_reclaim_does_nothing_when_there_is_room_or_nothing_to_take(clock: FakeClock) -> None:
    store, ns_tiny, ns_big, tiny = tiny_pool(clock)
    assert not store.reclaim(ns_tiny, TINY, tiny[:10])  # all resident: no new page needed
    assert not store.reclaim(ns_tiny, TINY, [h(9000)])  # its own LRU page will do
    lease = store.query(ns_tiny, TINY, [tiny[0]], "inst", 1)
    assert not store.reclaim(ns_big, BIG, [h(5000)])  # the only other slab has a pinned page: nothing starts
    assert store.reclaiming() == -1 and store.statistics().evictions == 0
    store.release(lease.lease_id, "inst")
    with pytest.raises(ValueError, match="reclaim_step_pages"):
        make_store(TINY_SLAB, TINY_SLAB, clock, reclaim_step_pages=0)


# ------------------------------------------------------------------------------------------ state machine


# L_A: tp 2, one layer -> 2048-byte pages, workers (0,0) and (1,0).
# L_B: tp 1, pp 2, two layers split over the stages -> 1024-byte pages, workers (0,0) and (0,1).
# L_C: tp 1, one layer -> 512-byte pages, a single worker.
L_A = build_layout(16, 2, [geo("model.layers.0.attn", 1024)])
L_B = build_layout(16, 1, [geo("model.layers.0.attn", 700), geo("model.layers.1.attn", 300)])
L_C = build_layout(16, 1, [geo("model.layers.0.attn", 512)])
INSTANCES = {
    "A": (L_A, "ns.a", {(0, 0): 0b01, (1, 0): 0b10}),
    "B": (L_B, "ns.b", {(0, 0): 0b01, (0, 1): 0b10}),
    "C": (L_C, "ns.c", {(0, 0): 0b1}),
}
HASHES = [h(i) for i in range(7)]
SLAB = 4096

hash_lists = st.lists(st.sampled_from(HASHES), min_size=1, max_size=4)
instances = st.sampled_from(sorted(INSTANCES))
workers = st.integers(0, 1)  # which of the instance's workers


@dataclass
class ModelLease:
    instance: str
    ns: int
    pinned: list[tuple[bytes, int]]
    shares: int
    deadline: float
    consumed: set[tuple[int, int]] = field(default_factory=set)


@dataclass
class ModelSave:
    instance: str
    plan: SavePlan
    hashes: list[bytes]
    refill: bool


@dataclass
class ModelLoad:
    instance: str
    plan: LoadPlan
    pinned: list[tuple[bytes, int]]


class StoreMachine(RuleBasedStateMachine):
    TABLE = "python"  # the page table its store runs (a unittest-style TestCase takes no pytest fixture)

    @initialize(n_slabs=st.integers(1, 3), reclaim_step=st.sampled_from((1, 2, 3, 2048)))
    def setup(self, n_slabs: int, reclaim_step: int) -> None:
        self.clock = FakeClock()
        self.store = make_store(n_slabs * SLAB, SLAB, self.clock, reclaim_step_pages=reclaim_step, table=self.TABLE)
        self.ns = {name: self.store.namespace(nsf, lay) for name, (lay, nsf, _) in INSTANCES.items()}
        self.saves: list[ModelSave] = []
        self.loads: list[ModelLoad] = []
        self.leases: dict[int, ModelLease] = {}
        self.written: dict[tuple[int, bytes, int], int] = {}  # (ns, hash, page id) -> cells written successfully
        self.refilling: set[int] = set()  # pages begin_refill marked and no finish/abandon_refill unmarked since

    # -- model helpers

    def worker(self, instance: str, which: int) -> tuple[tuple[int, int], int]:
        keys = sorted(INSTANCES[instance][2])
        key = keys[which % len(keys)]
        return key, INSTANCES[instance][2][key]

    def expired(self) -> None:
        """Mirror of BlockStore.expire for leases: called after every store call that expires."""
        now = self.clock()
        for lease_id in [i for i, lease in self.leases.items() if lease.deadline <= now]:
            del self.leases[lease_id]

    def index(self, instance: str) -> BlockIndex:
        return index(self.store, self.ns[instance])

    # -- rules

    @rule(instance=instances, which=workers, hashes=hash_lists)
    def begin_save(self, instance: str, which: int, hashes: list[bytes]) -> None:
        layout = INSTANCES[instance][0]
        _, cells = self.worker(instance, which)
        plan = self.store.begin_save(self.ns[instance], layout, hashes, cells)
        self.expired()
        assert len(plan.entries) + plan.skipped + plan.not_stored == len(hashes)
        self.saves.append(ModelSave(instance, plan, hashes, refill=False))

    @rule(instance=instances, hashes=hash_lists)
    def begin_refill(self, instance: str, hashes: list[bytes]) -> None:
        """Blocks read back from SSD or a peer: every cell at once, the pages marked as refilling."""
        layout = INSTANCES[instance][0]
        plan = self.store.begin_refill(self.ns[instance], layout, hashes, (1 << layout.num_slots) - 1)
        self.expired()
        assert len(plan.entries) + plan.skipped + plan.not_stored == len(hashes)
        assert all(self.store.refilling(pid) for pid in plan.pages)
        self.refilling.update(plan.pages)
        self.saves.append(ModelSave(instance, plan, hashes, refill=True))

    @precondition(lambda self: any(save.refill for save in self.saves))
    @rule(i=st.integers(0, 100))
    def abandon_refill(self, i: int) -> None:
        """A refill whose transfer timed out: its pages stop refilling but stay reserved until it finishes."""
        refills = [save for save in self.saves if save.refill]
        plan = refills[i % len(refills)].plan
        self.store.abandon_refill(plan)
        self.refilling.difference_update(plan.pages)
        assert not any(self.store.refilling(pid) for pid in plan.pages)

    @precondition(lambda self: self.saves)
    @rule(i=st.integers(0, 100), ok=st.booleans())
    def finish_save(self, i: int, ok: bool) -> None:
        save = self.saves.pop(i % len(self.saves))
        plan = save.plan
        if ok:
            for index, pid, _ in plan.entries:
                key = (plan.namespace_id, save.hashes[index], pid)
                self.written[key] = self.written.get(key, 0) | plan.cell_mask
        if save.refill:
            sealed = self.store.finish_refill(plan, ok)
            self.refilling.difference_update(plan.pages)
        else:
            sealed = self.store.finish_save_pages(plan, ok)
        assert set(sealed) <= set(plan.pages) and all(self.store.state_of(pid).state == SEALED for pid in sealed)

    @rule(instance=instances, hashes=hash_lists, shares=st.integers(1, 2), ttl=st.sampled_from((None, 5.0)))
    def query(self, instance: str, hashes: list[bytes], shares: int, ttl: float | None) -> None:
        layout = INSTANCES[instance][0]
        ns = self.ns[instance]
        result = self.store.query(ns, layout, hashes, instance, shares, ttl)
        self.expired()
        expected = 0
        for block_hash in hashes:
            pid = self.store.page(ns, block_hash)
            if pid is None or self.store.state_of(pid).state != SEALED:
                break
            expected += 1
        assert result.hits == expected
        if result.hits:
            assert result.lease_id not in self.leases
            pinned = [(b, pid_of(self.store, ns, b)) for b in hashes[: result.hits]]
            deadline = self.clock() + (LEASE_TTL if ttl is None else ttl)
            self.leases[result.lease_id] = ModelLease(instance, ns, pinned, shares, deadline)
        else:
            assert result.lease_id == 0

    @rule(instance=instances, which=workers, hashes=hash_lists, use_lease=st.booleans(), pick=st.integers(0, 100))
    def begin_load(self, instance: str, which: int, hashes: list[bytes], use_lease: bool, pick: int) -> None:
        layout = INSTANCES[instance][0]
        key, _ = self.worker(instance, which)
        own = sorted(i for i, lease in self.leases.items() if lease.instance == instance)
        lease_id = own[pick % len(own)] if use_lease and own else 0
        plan = self.store.begin_load(
            self.ns[instance], layout, hashes, lease_id=lease_id, owner=instance, worker_key=key
        )
        self.expired()
        assert plan.outcome in ("loaded", "missing")
        assert (plan.outcome == "loaded") == (len(plan.entries) == len(hashes))
        pinned = [(b, pid_of(self.store, self.ns[instance], b)) for b in hashes[: len(plan.entries)]]
        assert [pid for _, pid in pinned] == [pid for pid, _ in plan.entries]
        self.loads.append(ModelLoad(instance, plan, pinned))

    @precondition(lambda self: self.loads)
    @rule(i=st.integers(0, 100))
    def finish_load(self, i: int) -> None:
        load = self.loads.pop(i % len(self.loads))
        self.store.finish_load(load.plan)
        lease = self.leases.get(load.plan.lease_id)
        if lease is not None:
            lease.consumed.add(load.plan.worker_key)
            if len(lease.consumed) >= lease.shares:
                del self.leases[load.plan.lease_id]

    @rule(pick=st.integers(0, 100), bogus=st.booleans())
    def release(self, pick: int, bogus: bool) -> None:
        if bogus or not self.leases:
            with pytest.raises(NotFound):
                self.store.release(10_000 + pick, "A")
            return
        lease_id = sorted(self.leases)[pick % len(self.leases)]
        self.store.release(lease_id, self.leases[lease_id].instance)
        del self.leases[lease_id]

    @rule(instance=instances)
    def release_owner(self, instance: str) -> None:
        ours = [i for i, lease in self.leases.items() if lease.instance == instance]
        assert self.store.release_owner(instance) == len(ours)
        for i in ours:
            del self.leases[i]

    @rule(instance=instances)
    def purge(self, instance: str) -> None:
        """Exactly the namespace's sealed unpinned pages go; pinned and inflight ones stay."""
        before = dict(self.index(instance).items())
        evictable = {b for b, pid in before.items() if (s := self.store.state_of(pid)).state == SEALED and not s.pins}
        freed, left = self.store.purge(self.ns[instance])
        after = dict(self.index(instance).items())
        assert set(before) - set(after) == evictable and freed == len(evictable) and left == len(after)
        assert all(after[b] == before[b] for b in after)

    @rule()
    def settle(self) -> None:
        """Every open save and load finishes and every lease is released: slabs can be emptied again."""
        while self.saves:
            self.finish_save(0, True)
        while self.loads:
            self.finish_load(0)
        for lease_id in sorted(self.leases):
            self.store.release(lease_id, self.leases.pop(lease_id).instance)

    @rule(instance=instances, hashes=hash_lists)
    def reclaim(self, instance: str, hashes: list[bytes]) -> None:
        """One step of emptying a slab for a save of `hashes`, at any point between the other calls."""
        evictions = self.store.statistics().evictions
        self.store.reclaim(self.ns[instance], INSTANCES[instance][0], hashes)
        self.expired()
        assert self.store.statistics().evictions - evictions <= self.store.reclaim_step_pages

    @rule()
    def reclaim_step(self) -> None:
        evictions, at = self.store.statistics().evictions, self.store.slab_statistics().drain_at
        draining = self.store.reclaiming()
        assert self.store.reclaim_step() == (self.store.reclaiming() >= 0)
        assert self.store.statistics().evictions - evictions <= self.store.reclaim_step_pages
        now = self.store.slab_statistics().drain_at
        if draining >= 0 and self.store.reclaiming() == draining and now > at:
            assert now - at <= self.store.reclaim_step_pages

    @rule(seconds=st.sampled_from((0.5, 4.0, 6.0, 31.0, 61.0)))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.store.expire()
        self.expired()

    # -- invariants

    @invariant()
    def accounting_balances(self) -> None:
        self.store.check_invariants()
        s = self.store.statistics()
        assert s.free_bytes + s.inflight_bytes + s.sealed_bytes == s.arena_bytes
        assert s.leases == len(self.leases)
        assert all(self.store.lease(lease_id) is not None for lease_id in self.leases)

    @invariant()
    def every_page_state_agrees(self) -> None:
        """Walks state_of over every page carved from a slab: the pins are exactly the model's leases and loads, the
        indexes hold exactly the pages in use, the LRU rings exactly the sealed unpinned pages, the slabs count
        exactly their pages in use, and the refill flags are exactly those the model set."""
        store = self.store
        pins = Counter(pid for lease in self.leases.values() for _, pid in lease.pinned)
        pins.update(pid for load in self.loads for _, pid in load.pinned)
        in_use: dict[int, PageState] = {}
        used, busy = Counter[int](), Counter[int]()
        evictable, flagged = set(), set()
        for pid in store.page_ids():
            page = store.state_of(pid)
            assert page.page == pid and page.writers >= 0
            assert page.pins == pins.get(pid, 0)  # and so never negative
            if page.refill:
                flagged.add(pid)
            if page.state == FREE:
                assert page.pins == page.writers == 0 and page.block_hash is None and not page.refill
                continue
            in_use[pid] = page
            used[page.slab] += 1
            if page.state == INFLIGHT:
                assert page.pins == 0
                busy[page.slab] += 1
            elif page.pins:
                assert page.writers == 0 and not page.refill
                busy[page.slab] += 1
            else:
                evictable.add(pid)
        indexed = {pid: (self.ns[name], b) for name in INSTANCES for b, pid in self.index(name).items()}
        assert indexed == {pid: (page.namespace_id, page.block_hash) for pid, page in in_use.items()}
        for ns in self.ns.values():
            sealed = {p.block_hash for p in in_use.values() if p.namespace_id == ns and p.state == SEALED}
            assert set(store.sealed_hashes(ns)) == sealed
        ring = [
            store.page(self.ns[name], b)
            for name, (layout, _, _) in INSTANCES.items()
            for b in store.lru_order(layout.page_bytes)
        ]  # one namespace per size class here
        assert len(ring) == len(set(ring)) and set(ring) == evictable
        slabs = store.slab_statistics()
        assert slabs.used == tuple(used[s] for s in range(store.n_slabs))
        assert slabs.busy == tuple(busy[s] for s in range(store.n_slabs))
        # a slab serves a class (page_bytes > 0) exactly while it has pages in use; the others are free
        assert [size > 0 for size in slabs.page_bytes] == [n > 0 for n in slabs.used]
        assert slabs.free_slabs == slabs.page_bytes.count(0)
        assert flagged == self.refilling and flagged <= {pid for pid, p in in_use.items() if p.state == INFLIGHT}
        s = store.statistics()
        assert s.resident_blocks == sum(p.state == SEALED for p in in_use.values())
        assert s.inflight_blocks == sum(p.state == INFLIGHT for p in in_use.values())
        assert s.pinned_blocks == sum(1 for p in in_use.values() if p.pins)

    @invariant()
    def pinned_pages_stay(self) -> None:
        pinned = [(lease.instance, b, pid) for lease in self.leases.values() for b, pid in lease.pinned]
        pinned += [(load.instance, b, pid) for load in self.loads for b, pid in load.pinned]
        for instance, block_hash, pid in pinned:
            assert self.index(instance).get(block_hash) == pid
            assert self.store.state_of(pid).state == SEALED

    @invariant()
    def open_saves_write_inflight_pages_of_their_hash(self) -> None:
        """A page seals only once no save plan is still copying into it, so a page being written can neither be
        evicted nor recycled for another hash under a writer that has not finished."""
        for save in self.saves:
            for index, pid, offset in save.plan.entries:
                page = self.store.state_of(pid)
                assert self.index(save.instance).get(save.hashes[index]) == pid
                assert page.state == INFLIGHT and page.offset == offset and page.writers > 0

    @invariant()
    def sealed_pages_were_fully_written(self) -> None:
        for instance, (layout, _, _) in INSTANCES.items():
            ns = self.ns[instance]
            full = (1 << layout.num_slots) - 1
            for block_hash, pid in self.index(instance).items():
                if self.store.state_of(pid).state == SEALED:
                    assert self.written.get((ns, block_hash, pid), 0) == full


class NativeStoreMachine(StoreMachine):
    TABLE = "native"


# one machine per page table, each with half the examples one machine had (the two tables' equivalence is
# tests/test_table.py's: it drives both with the same calls and compares everything after every step)
MACHINE_SETTINGS = settings(
    max_examples=150, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestStoreMachinePython = StoreMachine.TestCase
TestStoreMachinePython.settings = MACHINE_SETTINGS
TestStoreMachineNative = unittest.skipUnless(NATIVE_BUILT, NOT_BUILT)(NativeStoreMachine.TestCase)
TestStoreMachineNative.settings = MACHINE_SETTINGS


def test_purge_frees_what_nothing_pins_and_leaves_leased_pages(clock: FakeClock) -> None:
    store = make_store(1 << 16, 1 << 14, clock)
    ns = store.namespace("m.x", TP1)
    other = store.namespace("m.y", TP1)
    save(store, ns, TP1, [h(1), h(2), h(3)])
    save(store, other, TP1, [h(1)])
    lease = store.query(ns, TP1, [h(1)], owner="o", shares=1)
    assert store.purge(ns) == (2, 1)  # h(1) is leased
    check(store)
    assert store.query(ns, TP1, [h(2)], owner="o", shares=1).hits == 0
    assert store.query(other, TP1, [h(1)], owner="o", shares=1).hits == 1  # another namespace keeps its blocks
    store.release(lease.lease_id, "o")
    check(store)


def test_tracked_changes_replayed_give_exactly_the_resident_blocks(clock: FakeClock) -> None:
    store = make_store(1 << 16, 1 << 14, clock)
    ns = store.namespace("m.x", TP1)
    save(store, ns, TP1, [h(1)])
    store.track_changes()
    model = set(store.sealed_hashes(ns))
    assert model == {h(1)}

    def replay() -> None:
        for sealed, ns_id, block_hash in store.take_changes():
            assert ns_id == ns
            (model.add if sealed else model.discard)(block_hash)
        assert model == set(store.sealed_hashes(ns))

    save(store, ns, TP1, [h(2), h(3)])
    replay()
    assert store.take_changes() == []
    for start in range(10, 200, 30):  # far more than the pool holds: evictions
        save(store, ns, TP1, [h(i) for i in range(start, start + 30)])
        replay()
    assert h(1) not in model  # sealed before tracking began, evicted since: reported too
    store.purge(ns)
    replay()
    assert model == set()
    check(store)


# ------------------------------------------------------------------------------------------ page states and refills


def test_state_of_reports_each_page(clock: FakeClock) -> None:
    store = make_store(1 << 16, 1 << 14, clock)
    ns = store.namespace("m.x", TP2)
    plan = store.begin_save(ns, TP2, [h(1), h(2)], mask(TP2, 0))
    store.finish_save(plan, ok=True)
    a, b = plan.pages
    assert store.state_of(a) == PageState(a, PageStatus.INFLIGHT, 0, ns, h(1), 0, plan.offsets[0], 0, 0b01, False)
    store.finish_save(store.begin_save(ns, TP2, [h(1)], mask(TP2, 1)), ok=True)
    lease = store.query(ns, TP2, [h(1)], "inst", 1)
    sealed = store.state_of(a)
    assert (sealed.state, sealed.pins, sealed.block_hash, sealed.cells, sealed.in_use) == (SEALED, 1, h(1), 0, True)
    store.release(lease.lease_id, "inst")
    assert store.state_of(a).pins == 0
    clock.advance(INFLIGHT_TIMEOUT)
    store.expire()  # h2 never got its second cell
    free = store.state_of(b)
    assert (free.state, free.namespace_id, free.block_hash, free.slab, free.in_use) == (FREE, -1, None, -1, False)
    assert sorted(store.page_ids()) == sorted([a, b])  # the slab carved two pages
    check(store)


def test_a_refill_marks_its_pages_until_it_finishes(clock: FakeClock) -> None:
    store = make_store(1 << 16, 1 << 14, clock)
    ns = store.namespace("m.x", TP2)
    full = (1 << TP2.num_slots) - 1
    plan = store.begin_refill(ns, TP2, [h(1), h(2), h(3)], full)
    assert len(plan.pages) == 3
    assert all(store.refilling(pid) and store.state_of(pid).refill for pid in plan.pages)
    assert store.query(ns, TP2, [h(1)], "inst", 1).hits == 0  # inflight: not a hit yet
    kept, dropped = store.split_plan(plan, [True, False, True])
    assert store.finish_refill(kept, ok=True) == kept.pages
    assert store.finish_refill(dropped, ok=False) == []
    assert not any(store.refilling(pid) for pid in plan.pages)
    assert resident(store, ns) == {h(1): SEALED, h(3): SEALED}
    assert store.query(ns, TP2, [h(1)], "inst", 1).hits == 1
    check(store)


def test_an_abandoned_refill_keeps_its_pages_until_finished(clock: FakeClock) -> None:
    store = make_store(1 << 16, 1 << 14, clock)
    ns = store.namespace("m.x", TP1)
    plan = store.begin_refill(ns, TP1, [h(1)], 1)
    store.abandon_refill(plan)  # a transfer that timed out may still write the page: not free yet
    (pid,) = plan.pages
    assert not store.refilling(pid) and store.state_of(pid).state == INFLIGHT
    clock.advance(3 * INFLIGHT_TIMEOUT)
    store.expire()  # the plan's writer is still open: the page stays
    assert store.state_of(pid).state == INFLIGHT and store.statistics().inflight_reclaimed == 0
    assert store.finish_refill(plan, ok=False) == []
    assert resident(store, ns) == {} and store.statistics().free_bytes == store.arena_bytes
    check(store)


def test_a_refill_joining_a_workers_page_seals_it_when_both_finish(clock: FakeClock) -> None:
    store = make_store(1 << 16, 1 << 14, clock)
    ns = store.namespace("m.x", TP2)
    worker = store.begin_save(ns, TP2, [h(1)], mask(TP2, 0))
    refill = store.begin_refill(ns, TP2, [h(1)], 0b11)
    assert refill.pages == worker.pages and store.refilling(refill.pages[0])
    assert store.finish_save(worker, ok=True) == 0  # the refill still writes the page
    assert store.state_of(refill.pages[0]).refill
    assert store.finish_refill(refill, ok=True) == refill.pages
    assert resident(store, ns) == {h(1): SEALED} and not store.refilling(refill.pages[0])
    check(store)


# ------------------------------------------------------------------------------------------ eviction on its own


@dataclass
class Pool:
    """The pieces BlockStore wires together, wired the same way, with one namespace of TP1 pages."""

    pages: PageTable
    namespaces: Namespaces
    changes: ChangeLog
    eviction: Eviction
    slabs: Slabs
    ns: int
    c: int

    @classmethod
    def of(cls, n_slabs: int, slab_bytes: int) -> Pool:
        """The parts of a store of the page table KVSEAL_TABLE picks (the `table` fixture), as the store wires them."""
        store = BlockStore(n_slabs * slab_bytes, slab_bytes=slab_bytes, eviction="lru")
        assert store.table == os.environ["KVSEAL_TABLE"]
        parts = store._pages, store._namespaces, store._changes, store._eviction, store._slabs
        return cls(*parts, parts[1].add("m.x", TP1, 0), parts[4].size_class(1024))

    def seal(self, hashes: list[bytes]) -> list[int]:
        """Sealed pages for `hashes`, the last the most recently used, as BlockStore's save makes them."""
        pids = self.slabs.allocate(self.c, len(hashes), budget=0)
        assert len(pids) == len(hashes)
        self.pages.open(pids, self.ns, hashes, 1, 0.0)
        self.namespaces[self.ns].index.update(hashes, pids)
        complete, _ = self.pages.end_writes(pids, 1, 1)
        self.pages.seal(complete)
        self.namespaces.count_resident(self.ns, len(complete))
        return pids

    def check(self) -> None:
        self.slabs.check(self.pages.check(), self.slabs.n_slabs * self.slabs.slab_bytes)
        self.namespaces.check(self.pages)

    def snapshot(self) -> tuple[object, ...]:
        index = self.namespaces[self.ns].index
        states = [self.pages.state_of(pid) for ids in self.slabs.slab_pages for pid in ids]
        return dict(index.items()), states, self.pages.lru_pages(self.c), self.eviction.evictions


@settings(max_examples=200, deadline=None)
@given(
    pinned=st.sets(st.integers(0, 7)),
    protected=st.sets(st.integers(0, 7)),
    n=st.integers(0, 9),
)
def test_evict_frees_exactly_n_unprotected_lru_pages_or_changes_nothing(
    pinned: set[int], protected: set[int], n: int
) -> None:
    pool = Pool.of(1, 8 * 1024)
    hashes = [h(i) for i in range(8)]
    pids = pool.seal(hashes)  # h0 least recently used
    pool.pages.pin([pids[i] for i in sorted(pinned)])
    before, ring = pool.snapshot(), pool.pages.lru_pages(pool.c)
    candidates = [pids[i] for i in range(8) if i not in pinned and i not in protected]
    victims = pool.eviction.evict(pool.c, n, {pids[i] for i in protected})
    if len(candidates) < n:
        assert victims == [] and pool.snapshot() == before
        return
    assert victims == candidates[:n]  # least recently used first, skipping pinned and protected pages
    assert all(pool.pages.state_of(pid).state == FREE for pid in victims)
    assert set(pool.namespaces[pool.ns].index.values()) == set(pids) - set(victims)
    assert pool.pages.lru_pages(pool.c) == [pid for pid in ring if pid not in victims]
    assert pool.eviction.evictions == n and pool.namespaces[pool.ns].resident_blocks == 8 - n
    pool.slabs.free(victims)  # the allocator would have reused them; given back, everything balances
    pool.check()


def test_forget_is_the_one_way_out_for_purge_drain_and_lru() -> None:
    pool = Pool.of(2, 4 * 1024)
    pool.changes.start()
    first = pool.seal([h(i) for i in range(4)])  # slab A
    second = pool.seal([h(i) for i in range(4, 8)])  # slab B
    pool.changes.take()
    gone = [first[1], first[3], second[0]]  # out of LRU order, over two slabs
    pool.eviction.forget(gone, evicted=False)
    assert pool.changes.take() == [(False, pool.ns, h(1)), (False, pool.ns, h(3)), (False, pool.ns, h(4))]
    assert pool.eviction.evictions == 0  # a purge is not an eviction
    assert pool.pages.lru_pages(pool.c) == [first[0], first[2], *second[1:]]
    assert [h(i) in pool.namespaces[pool.ns].index for i in range(8)] == [True, False, True, False] + [False] + [
        True
    ] * 3
    pool.slabs.free(gone)
    pool.check()
    pool.eviction.forget([first[0], first[2]])  # slab A's last pages: it goes back to the pool
    pool.slabs.free([first[0], first[2]])
    assert pool.slabs.free_slabs == [pool.pages.slab_of[first[0]]] and pool.eviction.evictions == 2
    pool.check()
