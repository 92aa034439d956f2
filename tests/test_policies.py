"""The eviction policies (kvseal.core.policies) keep their contract, the hit-ratio simulator (kvseal.bench.hitsim)
agrees with a naive LRU and with Belady's bound, and the workloads (kvseal.bench.workload) are reproducible:

- every policy, under any sequence of hit / refresh / admit / insert / evict, holds exactly what a model set
  says, and `evict(n, protected)` returns n distinct held unprotected keys, or [] with nothing changed exactly
  when fewer than n are evictable;
- LRU and prefix-LRU evict in the orders worked out by hand below;
- `simulate` with LRU finds, request by request, what a plain-list LRU finds; Belady (with admission) finds at
  least as much as any policy, and with admission at least as much as without;
- `MixedWorkload` is the same for the same seed, and the chat `Workload` is what it was before MixedWorkload
  was added (constants taken before the change)."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvseal.bench.hitsim import belady, simulate
from kvseal.bench.workload import ChatTrace, MixedWorkload, Workload
from kvseal.core.policies import LRU, POLICIES, AdaptiveSLRU, PrefixLRU, _Sketch

UNIVERSE = [bytes([i]) for i in range(10)]
CAPACITY = 6

keys = st.lists(st.sampled_from(UNIVERSE), max_size=6, unique=True)
operations = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["hit", "refresh", "admit", "insert"]), keys),
        st.tuples(st.just("evict"), st.integers(-1, 8), keys),
    ),
    max_size=40,
)


@settings(max_examples=400, deadline=None)
@given(name=st.sampled_from(sorted(POLICIES)), ops=operations)
def test_every_policy_keeps_the_evict_contract(name: str, ops: list[tuple[Any, ...]]) -> None:
    policy = POLICIES[name](CAPACITY)
    held: set[bytes] = set()
    for op, *args in ops:
        if op == "evict":
            n, protected = args[0], set(args[1])
            before = set(held)
            victims = policy.evict(n, protected)
            if n > 0 and len(held - protected) >= n:
                assert len(victims) == n and len(set(victims)) == n
                assert set(victims) <= held and not set(victims) & protected
                held -= set(victims)
            else:
                assert victims == [] and held == before
        else:
            chosen = args[0]
            if op == "hit":
                policy.hit([k for k in chosen if k in held])
            elif op == "refresh":
                policy.refresh([k for k in chosen if k in held])
            elif op == "admit":
                new = [k for k in chosen if k not in held]
                assert 0 <= policy.admit(new) <= len(new)
            else:
                new = [k for k in chosen if k not in held][: CAPACITY - len(held)]
                policy.insert(new)
                held |= set(new)
        assert len(policy) == len(held)
        assert all((k in policy) == (k in held) for k in UNIVERSE)


def test_lru_and_prefix_lru_evict_in_the_orders_worked_out_by_hand() -> None:
    a, b, c, d = b"a", b"b", b"c", b"d"
    orders = {}
    for policy in (LRU(4), PrefixLRU(4)):
        policy.hit([])  # request 1: nothing resident, stores a b c
        policy.insert([a, b, c])
        policy.hit([a, b])  # request 2: hits a b, stores d
        policy.insert([d])
        policy.hit([a])  # request 3: hits a, re-saves c
        policy.refresh([c])
        orders[policy.name] = policy.evict(1, {d}) + policy.evict(2, set()) + policy.evict(1, set())
    # LRU (least recent first): a b c -> c a b -> c a b d -> c b d a; refresh touches nothing
    assert orders["lru"] == [c, b, d, a]
    # prefix-LRU touches each call in reverse, earlier calls of the request above it: c b a -> c d b a
    # (d below the hit a b) -> d b c a (c re-saved, below the hit a)
    assert orders["prefix-lru"] == [b, d, c, a]


def test_evict_refuses_when_too_few_keys_are_unprotected() -> None:
    for name, make in POLICIES.items():
        policy = make(4)
        policy.hit([])
        policy.insert([b"a", b"b", b"c"])
        assert policy.evict(3, [b"a"]) == [] and len(policy) == 3, name
        assert policy.evict(0, ()) == [] and policy.evict(3, ()) != [] and len(policy) == 0, name


@st.composite
def traces(draw: st.DrawFn) -> list[list[bytes]]:
    """Requests as hash chains: block i's key is the request's first i + 1 tokens, over a small alphabet so that
    prefixes are shared."""
    alphabet = draw(st.integers(2, 4))
    prompts = draw(st.lists(st.lists(st.integers(0, alphabet - 1), max_size=7), min_size=1, max_size=25))
    return [[bytes(tokens[: i + 1]) for i in range(len(tokens))] for tokens in prompts]


def naive_lru(requests: Sequence[Sequence[bytes]], capacity: int) -> list[int]:
    """Each request's hit under LRU with simulate's rules, on a plain list (least recent first)."""
    cache: list[bytes] = []
    hits = []
    for request in requests:
        h = 0
        while h < len(request) and request[h] in cache:
            h += 1
        for key in request[:h]:
            cache.remove(key)
            cache.append(key)
        missing = [key for key in request if key not in cache]
        if capacity > 0:
            for key in missing:
                if len(cache) >= capacity:
                    victim = next((k for k in cache if k not in request), None)
                    if victim is None:
                        break
                    cache.remove(victim)
                cache.append(key)
        hits.append(h)
    return hits


@settings(max_examples=300, deadline=None)
@given(requests=traces(), capacity=st.integers(0, 10))
def test_simulated_lru_is_a_plain_list_lru(requests: list[list[bytes]], capacity: int) -> None:
    result = simulate(requests, capacity, LRU(capacity))
    assert result.per_request == naive_lru(requests, capacity)
    assert result.hits == sum(result.per_request) and result.lookups == sum(map(len, requests))


@settings(max_examples=300, deadline=None)
@given(requests=traces(), capacity=st.integers(0, 10))
def test_belady_finds_at_least_what_any_policy_finds(requests: list[list[bytes]], capacity: int) -> None:
    optimum = belady(requests, capacity, admission=False)
    with_admission = belady(requests, capacity, admission=True)
    assert with_admission.hits >= optimum.hits
    for name, make in POLICIES.items():
        hits = simulate(requests, capacity, make(capacity)).hits
        assert hits <= optimum.hits, name  # every policy here stores what it is given
        assert hits <= with_admission.hits, name
    if capacity == 0:
        assert with_admission.hits == 0


def test_the_sketch_counts_behind_its_doorkeeper_and_ages() -> None:
    sketch = _Sketch(10)  # ages every 100 increments
    assert sketch.estimate(b"k") == 0
    for n in range(1, 5):
        sketch.add(b"k")
        assert sketch.estimate(b"k") == n  # 1 from the doorkeeper, the rest from the counters
    for i in range(96):
        sketch.add(i.to_bytes(2, "little"))
    assert sketch.estimate(b"k") == 1  # counters 3 -> 1, doorkeeper cleared


MIXED = MixedWorkload(chat=Workload(seed=3, conversations=20), agents=4, rag=30, documents=10, one_offs=10)


def test_the_mixed_workload_is_the_same_for_the_same_seed() -> None:
    labelled = MIXED.labelled(16)
    assert labelled == MIXED.labelled(16) and MIXED.requests(16) == [h for _, h in labelled]
    assert {kind for kind, _ in labelled} == set(MixedWorkload.KINDS)
    assert dataclasses.replace(MIXED, seed=1).requests(16) != MIXED.requests(16)
    assert all(len(key) == 32 for _, hashes in labelled for key in hashes)
    one_offs = [set(h) for kind, h in labelled if kind == "one-off"]
    others = {key for kind, h in labelled if kind != "one-off" for key in h}
    assert all(not (o & others) for o in one_offs)  # one-off prompts share no block with anything
    coarse = MIXED.requests(512)
    assert len(coarse) == len(labelled) and sum(map(len, coarse)) < sum(len(h) for _, h in labelled)


def test_the_chat_workload_is_unchanged() -> None:
    requests = Workload().requests(16)
    flat = [key for request in requests for key in request]
    assert (len(requests), len(flat), len(set(flat))) == (1225, 325355, 42661)
    assert requests[0][0].hex() == "e7e0a433b3d8733887bcf832565dd836f5cb51e30401ded9f305070cbf1b4b20"
    assert (
        hashlib.sha256(b"".join(flat)).hexdigest() == "61bea35e718b514e766540ebd787203b067e520964dbef1cbff81830551fce9b"
    )


def chain(prefix: bytes, n: int) -> list[bytes]:
    """A request of n blocks whose keys are unique to `prefix`."""
    return [prefix + i.to_bytes(2, "little") for i in range(n)]


def test_the_adaptive_share_falls_to_prefix_lru_where_recency_pays() -> None:
    """Conversations that come back once, a little later than the pool's reach under recency: the blocks that come
    back were evicted never hit, so every adaptation shrinks protected, and the policy is PrefixLRU request for
    request."""
    requests = []
    for c in range(60):
        requests.append(chain(b"c%d" % c, 8))
        if c >= 3:
            requests.append(chain(b"c%d" % (c - 3), 12))  # turn 2 of the conversation started 3 earlier
    capacity = 30
    adaptive = AdaptiveSLRU(capacity, start=0.5)
    result = simulate(requests, capacity, adaptive)
    assert adaptive.moves > 0 and adaptive._target == 0.0
    tail = requests[len(requests) // 2 :]  # once the target is 0, from an empty start too
    assert (
        simulate(tail, capacity, AdaptiveSLRU(capacity)).per_request
        == simulate(tail, capacity, PrefixLRU(capacity)).per_request
    )
    assert result.hits >= simulate(requests, capacity, POLICIES["prefix-slru"](capacity)).hits


def test_the_adaptive_share_grows_where_frequency_pays_and_stays_in_bounds() -> None:
    """A hot set of prompts asked again and again between floods of one-off prompts: the hot blocks are evicted
    after a hit, come back, and each time protected grows, up to max_share; the policy then keeps them through the
    floods, as prefix-LRU cannot."""
    capacity = 40
    hot = [chain(b"hot%d" % i, 5) for i in range(5)]  # 25 blocks
    requests = []
    for r in range(40):
        requests += hot
        requests += [chain(b"once%d.%d" % (r, i), 10) for i in range(3)]  # 30 blocks never seen again
    adaptive = AdaptiveSLRU(capacity, max_share=0.75)
    targets = []
    for i in range(0, len(requests), 8):
        simulate(requests[i : i + 8], capacity, adaptive)  # one policy, fed in pieces
        targets.append(adaptive._target)
        assert 0.0 <= adaptive._target <= 0.75 * capacity and len(adaptive._hot) <= adaptive._target
    assert targets[-1] > targets[0] and targets[-1] >= 25
    late = requests[len(requests) // 2 :]
    assert simulate(late, capacity, adaptive).hits > simulate(late, capacity, PrefixLRU(capacity)).hits


def test_the_chat_trace_is_reproducible_and_shaped_like_its_source() -> None:
    """The calibrated chat trace, small: seeded; one-shot API calls share nothing; a chat's turn extends its
    previous turn's prompt."""
    small = ChatTrace(sessions=200)
    requests = small.requests(512)
    assert requests == small.requests(512) and ChatTrace(sessions=200, seed=1).requests(512) != requests
    flat = [key for request in requests for key in request]
    counts = {}
    for key in flat:
        counts[key] = counts.get(key, 0) + 1
    never = sum(1 for v in counts.values() if v == 1) / len(counts)
    assert 0.4 < never < 0.9 and 0.1 < 1 - len(counts) / len(flat) < 0.6
    by_first: dict[bytes, list[list[bytes]]] = {}
    for request in requests:
        if request:
            by_first.setdefault(request[0], []).append(request)
    extended = sum(
        later[: len(earlier)] == earlier
        for turns in by_first.values()
        for earlier, later in zip(turns, turns[1:], strict=False)
    )
    assert extended >= 10  # follow-up turns re-send their conversation so far
