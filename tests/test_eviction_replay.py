"""The store hits what its eviction policy's offline simulation says, request by request.

A workload (kvseal.bench.workload's mix of chats, agent loops, RAG and one-off prompts, small, 512-token blocks; and
hypothesis traces of short hash chains over a tiny alphabet) is replayed against a BlockStore the way the vLLM
connector drives the engine: a query (lease) of the whole prompt, the lease released, then a save of the whole
prompt (the hit prefix is named, not copied), one worker, one size class. kvseal.bench.hitsim.simulate replays the
same requests against the policy of the same name (kvseal.core.policies) with room for as many blocks as the pool
has pages. Both page tables, both engine policies: every request's hit must be equal, so the engine's eviction is
exactly the order the simulator measures (`kvseal bench hitrate`).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvseal.bench.hitsim import simulate
from kvseal.bench.workload import MixedWorkload, Workload
from kvseal.core import pages
from kvseal.core.eviction import EVICTION_POLICIES
from kvseal.core.layout import LayerGeometry, build_layout
from kvseal.core.policies import POLICIES
from kvseal.core.store import BlockStore

LAYOUT = build_layout(16, 1, [LayerGeometry("model.layers.0.attn", "bfloat16", 1024, 1, 0, "cpu_attn.avx512")])
PAGE = 1024  # LAYOUT's page stride
TABLES = ("python", "native") if pages._table is not None else ("python",)


def replay(requests: Sequence[Sequence[bytes]], capacity: int, eviction: str, table: str) -> list[int]:
    """Each request's hit (leading blocks found) on a store of `capacity` pages."""
    store = BlockStore(capacity * PAGE, slab_bytes=capacity * PAGE, table=table, eviction=eviction)
    assert store.table == table
    ns = store.namespace("m.x", LAYOUT)
    hits = []
    for request in requests:
        lease = store.query(ns, LAYOUT, list(request), "inst", 1)
        hits.append(lease.hits)
        if lease.lease_id:
            store.release(lease.lease_id, "inst")
        if request:
            plan = store.begin_save(ns, LAYOUT, list(request), 1)
            store.finish_save(plan, ok=True)
    store.check_invariants()
    return hits


def simulated(requests: Sequence[Sequence[bytes]], capacity: int, eviction: str) -> list[int]:
    return simulate(requests, capacity, POLICIES[eviction](capacity)).per_request


MIXED = MixedWorkload(
    chat=Workload(seed=3, conversations=30, system_tokens=1500),
    agents=6,
    rag=60,
    documents=20,
    one_offs=30,
).requests(512)
DISTINCT = len({key for request in MIXED for key in request})


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("eviction", EVICTION_POLICIES)
@pytest.mark.parametrize("share", [0.15, 0.3])
def test_the_store_hits_what_the_simulation_of_its_policy_says(eviction: str, table: str, share: float) -> None:
    """On the mixed workload at 15 % and 30 % of its distinct blocks: request for request, the same hit."""
    capacity = round(DISTINCT * share)
    expected = simulated(MIXED, capacity, eviction)
    assert 0 < sum(expected) < sum(map(len, MIXED)), "the workload must both hit and miss at this capacity"
    got = replay(MIXED, capacity, eviction, table)
    first = next((k for k, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b), None)
    assert first is None, f"request {first}: the store hit {got[first]} blocks, the simulation {expected[first]}"


def test_the_policies_differ_on_this_workload() -> None:
    """The replay above can tell the policies apart: their simulations disagree at 15 %."""
    capacity = round(DISTINCT * 0.15)
    hits = [simulated(MIXED, capacity, eviction) for eviction in EVICTION_POLICIES]
    assert all(a != b for k, a in enumerate(hits) for b in hits[k + 1 :])


@st.composite
def traces(draw: st.DrawFn) -> list[list[bytes]]:
    """Requests as hash chains over a small alphabet (block i's key is the prompt's first i + 1 tokens), so that
    prefixes are shared, re-saved and evicted; at most as long as the pool."""
    alphabet = draw(st.integers(2, 4))
    prompts = draw(st.lists(st.lists(st.integers(0, alphabet - 1), max_size=4), min_size=1, max_size=40))
    return [[bytes(tokens[: i + 1]).ljust(16, b"\xff") for i in range(len(tokens))] for tokens in prompts]


@settings(max_examples=150, deadline=None)
@given(trace=traces(), capacity=st.integers(4, 12), eviction=st.sampled_from(EVICTION_POLICIES))
def test_any_trace_hits_as_simulated(trace: list[list[bytes]], capacity: int, eviction: str) -> None:
    expected = simulated(trace, capacity, eviction)
    for table in TABLES:
        assert replay(trace, capacity, eviction, table) == expected, table


@pytest.mark.parametrize("eviction", EVICTION_POLICIES)
def test_the_stores_what_if_estimates_follow_the_simulation_of_larger_pools(eviction: str) -> None:
    """A namespace's what-if hit ratios (kvseal.core.ghost, fed by the store's queries, evictions and saves) are
    within 0.01 of the simulation of its policy with 2x and 4x the pool and with no eviction; the actual ratio is
    exact."""
    capacity = round(DISTINCT * 0.15)
    store = BlockStore(capacity * PAGE, slab_bytes=capacity * PAGE, eviction=eviction)
    ns = store.namespace("m.x", LAYOUT)
    for request in MIXED:
        lease = store.query(ns, LAYOUT, list(request), "inst", 1)
        if lease.lease_id:
            store.release(lease.lease_id, "inst")
        if request:
            store.finish_save(store.begin_save(ns, LAYOUT, list(request), 1), ok=True)
    [(record, _)] = store.namespace_stats()
    got = record.what_if.estimates()
    lookups = sum(map(len, MIXED))

    def ratio(blocks: int) -> float:
        return sum(simulated(MIXED, blocks, eviction)) / lookups

    assert got.ratio == pytest.approx(ratio(capacity), abs=1e-12)
    for estimate, blocks in (
        (got.ratio_2x, 2 * capacity),
        (got.ratio_4x, 4 * capacity),
        (got.ratio_unbounded, DISTINCT),
    ):
        assert estimate == pytest.approx(ratio(blocks), abs=0.01), blocks
    assert got.ratio < got.ratio_2x < got.ratio_4x <= got.ratio_unbounded
