"""The native page table against the Python reference, through BlockStore's public API only.

A hypothesis state machine builds two BlockStores with the same arguments except `table="native"` and
`table="python"`, on one shared FakeClock, and drives both with exactly the same calls: saves, refills (finished,
split, abandoned), queries, resident lookups and mixed leases over them, hit counts, loads with and without a lease,
releases (bogus ones too), purges, slab reclaim steps, SSD-style pins, and time passing. Pools are tiny (1-3 slabs of
4096 bytes, pages of 512 to 2048 bytes in four size classes, one of them shared by two namespaces, one with a 70-bit
cell mask; each run uses one to five of the instances) and hash lists short, with repeats, so eviction, cross-class
slab emptying and "not stored" happen all the time.

After every step it asserts that the two stores cannot be told apart: every call returned the same thing (plans
field by field, page ids and lease ids included) or raised the same exception type with the same message, and
statistics(), slab_statistics(), page_ids(), state_of() of every carved page, lru_order() of every size class,
sealed_hashes() and namespace_stats() of every namespace, page() of every hash, lease() of every lease id handed
out, take_changes() and reclaiming() are equal, and check_invariants() holds on both. So whatever the page table
runs in C (kvseal/core/_table.c) or in Python behaves the same to every caller of the store; when more of the table
goes native behind the same `table` switch, this test keeps covering it unchanged.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvseal.core import pages
from kvseal.core.eviction import EVICTION_POLICIES
from kvseal.core.layout import LayerGeometry, Layout, build_layout
from kvseal.core.store import BlockStore
from kvseal.errors import NotFound
from kvseal.testing.clock import FakeClock

if pages._table is None:  # the extension is not built: there is nothing to compare the reference with
    pytest.skip("the native page table (kvseal/core/_table.c) is not built", allow_module_level=True)

INFLIGHT_TIMEOUT = 60.0
LEASE_TTL = 30.0
SLAB = 4096
SIDES = ("native", "python")


def geo(name: str, segment_bytes: int, segments: int = 1, dtype: str = "bfloat16") -> LayerGeometry:
    return LayerGeometry(name, dtype, segment_bytes, segments, 0, "cpu_attn.avx512")


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def cells(layout: Layout, layers: range, tp_rank: int) -> int:
    return sum(1 << layout.slot(layer, tp_rank) for layer in layers)


# A: tp 2, one layer: 2048-byte pages, workers (0,0) and (1,0) write one cell each.
# B: tp 1, two layers split over two pipeline stages: 1000-byte pages (stride 1024), workers (0,0) and (0,1).
# C: tp 1, one layer: 512-byte pages, one worker.
# D: tp 1, one layer: 1024-byte pages, one worker: the size class of B, so two namespaces share its slabs and ring.
# W: tp 1, 70 layers of 8 bytes: 560-byte pages (stride 576) with a 70-bit cell mask, two stages of 35 layers.
L_A = build_layout(16, 2, [geo("model.layers.0.attn", 1024)])
L_B = build_layout(16, 1, [geo("model.layers.0.attn", 700), geo("model.layers.1.attn", 300)])
L_C = build_layout(16, 1, [geo("model.layers.0.attn", 512)])
L_D = build_layout(16, 1, [geo("model.layers.0.attn", 1024)])
L_W = build_layout(16, 1, [geo(f"model.layers.{i:02d}.attn", 8) for i in range(70)])
# the same slots as A in another dtype: a fingerprint collision under A's namespace, refused by every call
L_A_OTHER = build_layout(16, 2, [geo("model.layers.0.attn", 1024, dtype="float16")])
assert L_A_OTHER.digest != L_A.digest and L_W.num_slots == 70

INSTANCES: dict[str, tuple[Layout, str, tuple[int, ...]]] = {
    "A": (L_A, "ns.a", (cells(L_A, range(1), 0), cells(L_A, range(1), 1))),
    "B": (L_B, "ns.b", (cells(L_B, range(1), 0), cells(L_B, range(1, 2), 0))),
    "C": (L_C, "ns.c", (cells(L_C, range(1), 0),)),
    "D": (L_D, "ns.d", (cells(L_D, range(1), 0),)),
    "W": (L_W, "ns.w", (cells(L_W, range(35), 0), cells(L_W, range(35, 70), 0))),
}
NAMES = sorted(INSTANCES)
PAGE_BYTES = sorted({layout.page_bytes for layout, _, _ in INSTANCES.values()})
HASHES = [h(i) for i in range(7)]

hash_lists = st.lists(st.sampled_from(HASHES), min_size=0, max_size=5)  # repeats and empty lists too
instances = st.sampled_from(NAMES)
picks = st.integers(0, 1000)
ttls = st.sampled_from((None, 0.5, 5.0))
leads = st.integers(0, 3)  # lookups: how many of the namespace's sealed hashes lead the hashes asked for


def full_mask(layout: Layout) -> int:
    return (1 << layout.num_slots) - 1


class Pair(tuple[Any, Any]):
    """Per-side values (native, python): a call's results, or an argument that differs by side (the plans each store
    handed out, equal but not the same objects)."""

    __slots__ = ()


@dataclass
class Outcome:
    """What one call did on both stores: its results, or the exception both raised (the native one's)."""

    results: Pair
    error: BaseException | None = None


def same(what: str, native: Any, python: Any) -> None:
    """Asserts two results are equal and of the same types, dataclasses (SavePlan, LoadPlan, PinnedPrefix, ...)
    field by field and lists item by item, naming the first difference."""
    if dataclasses.is_dataclass(native) and not isinstance(native, type):
        assert type(native) is type(python), f"{what}: native {type(native)} != python {type(python)}"
        for f in dataclasses.fields(native):
            same(f"{what}.{f.name}", getattr(native, f.name), getattr(python, f.name))
    elif isinstance(native, (list, tuple)) and isinstance(python, (list, tuple)) and len(native) == len(python):
        for k, (a, b) in enumerate(zip(native, python, strict=True)):
            same(f"{what}[{k}]", a, b)
        assert type(native) is type(python), f"{what}: native {type(native)} != python {type(python)}"
    else:
        assert type(native) is type(python) and native == python, f"{what}: native {native!r} != python {python!r}"


def side_of(value: Any, side: int) -> Any:
    return value[side] if isinstance(value, Pair) else value


@dataclass
class OpenSave:
    instance: str
    refill: bool
    plans: Pair  # the SavePlan each store handed out


class TableMachine(RuleBasedStateMachine):
    @initialize(
        n_slabs=st.integers(1, 3),
        reclaim_step=st.sampled_from((1, 2, 3, 2048)),
        active=st.lists(st.sampled_from(NAMES), min_size=1, max_size=len(NAMES), unique=True),
        eviction=st.sampled_from(EVICTION_POLICIES),
    )
    def setup(self, n_slabs: int, reclaim_step: int, active: list[str], eviction: str) -> None:
        """`active`: the instances this run uses (the rules' other names stand for one of them, still as owners of
        their own): one or two instances fill the pool with blocks that queries find, five thrash it."""
        self.build(n_slabs, SLAB, reclaim_step, active, eviction)

    def build(self, n_slabs: int, slab_bytes: int, reclaim_step: int, active: list[str], eviction: str) -> None:
        self.clock = FakeClock()
        self.stores = tuple(
            BlockStore(
                n_slabs * slab_bytes,
                slab_bytes=slab_bytes,
                clock=self.clock,
                wall_clock=lambda: 1.7e9,
                inflight_timeout_s=INFLIGHT_TIMEOUT,
                lease_ttl_s=LEASE_TTL,
                reclaim_step_pages=reclaim_step,
                table=side,
                eviction=eviction,
            )
            for side in SIDES
        )
        assert tuple(store.table for store in self.stores) == SIDES, "a store ignored its table argument"
        self.all_ns = {name: self.do("namespace", nsf, layout)[0] for name, (layout, nsf, _) in INSTANCES.items()}
        alias = {name: name if name in active else active[k % len(active)] for k, name in enumerate(NAMES)}
        self.spec = {name: INSTANCES[alias[name]] for name in NAMES}
        self.ns = {name: self.all_ns[alias[name]] for name in NAMES}
        self.do("track_changes")
        self.saves: list[OpenSave] = []
        self.loads: list[Pair] = []  # the LoadPlan each store handed out, not finished yet
        self.lease_ids: list[tuple[int, str]] = []  # every lease handed out (open or not), with its owner
        self.pinned: list[list[int]] = []  # pin_pages runs not unpinned yet (the same page ids on both sides)

    # -- running one call on both

    def call(self, name: str, *args: Any, **kwargs: Any) -> Outcome:
        """store.name(*args, **kwargs) on the native store, then on the python one (a Pair argument gives each its
        own value): both must return equal results or raise the same exception type with the same message."""
        results: list[Any] = []
        errors: list[BaseException | None] = []
        for side, store in enumerate(self.stores):
            a = [side_of(arg, side) for arg in args]
            kw = {key: side_of(arg, side) for key, arg in kwargs.items()}
            try:
                results.append(getattr(store, name)(*a, **kw))
                errors.append(None)
            except Exception as e:  # whatever it is, compared across the two stores below
                results.append(None)
                errors.append(e)
        native, python = errors
        if native is not None or python is not None:
            assert native is not None and python is not None, (
                f"{name}: only the {SIDES[0] if native else SIDES[1]} store raised {native or python!r}"
            )
            assert type(native) is type(python) and str(native) == str(python), (
                f"{name}: native raised {native!r}, python raised {python!r}"
            )
            return Outcome(Pair((None, None)), native)
        same(name, results[0], results[1])
        return Outcome(Pair(results))

    def do(self, name: str, *args: Any, **kwargs: Any) -> Pair:
        """call() that must not raise; returns the results (native, python)."""
        out = self.call(name, *args, **kwargs)
        assert out.error is None, f"{name} raised {out.error!r} on both stores"
        return out.results

    def layout(self, instance: str) -> Layout:
        return self.spec[instance][0]

    def lookup(self, instance: str, hashes: list[bytes], lead: int) -> list[bytes]:
        """`hashes` after up to `lead` of the namespace's sealed hashes (so that lookups find something)."""
        return sorted(self.stores[1].sealed_hashes(self.ns[instance]))[:lead] + hashes

    # -- saves and refills

    @rule(instance=instances, which=st.integers(0, 1), hashes=hash_lists)
    def begin_save(self, instance: str, which: int, hashes: list[bytes]) -> None:
        """One worker's save, left open (finish_save finishes it)."""
        layout, _, masks = self.spec[instance]
        plans = self.do("begin_save", self.ns[instance], layout, hashes, masks[which % len(masks)])
        self.saves.append(OpenSave(instance, False, plans))

    @rule(instance=instances, hashes=hash_lists, refill=st.booleans())
    def save(self, instance: str, hashes: list[bytes], refill: bool) -> None:
        """A whole save: every worker of the instance writes its cells and finishes (or one refill writes them all),
        so the blocks seal (what fits)."""
        layout, _, masks = self.spec[instance]
        begin, finish = ("begin_refill", "finish_refill") if refill else ("begin_save", "finish_save_pages")
        for mask in (full_mask(layout),) if refill else masks:
            self.do(finish, self.do(begin, self.ns[instance], layout, hashes, mask), True)

    @rule(instance=instances, hashes=hash_lists)
    def begin_refill(self, instance: str, hashes: list[bytes]) -> None:
        layout = self.layout(instance)
        plans = self.do("begin_refill", self.ns[instance], layout, hashes, full_mask(layout))
        self.saves.append(OpenSave(instance, True, plans))

    @precondition(lambda self: any(save.refill for save in self.saves))
    @rule(i=picks)
    def abandon_refill(self, i: int) -> None:
        refills = [save for save in self.saves if save.refill]
        self.do("abandon_refill", refills[i % len(refills)].plans)

    @precondition(lambda self: self.saves)
    @rule(i=picks, ok=st.booleans(), how=st.sampled_from(("count", "pages", "split")), keep=st.lists(st.booleans()))
    def finish_save(self, i: int, ok: bool, how: str, keep: list[bool]) -> None:
        """finish_save (a count), finish_save_pages (the sealed pages), or split_plan into the entries kept and the
        others, finished as written and as not; a refill's plans through finish_refill."""
        save = self.saves.pop(i % len(self.saves))
        plans = save.plans
        if how != "split":
            self.do("finish_refill" if save.refill else f"finish_save{'_pages' * (how == 'pages')}", plans, ok)
            return
        flags = [keep[k] if k < len(keep) else k % 2 == 0 for k in range(len(plans[0].pages))]
        parts = self.do("split_plan", plans, flags)
        finish = "finish_refill" if save.refill else "finish_save_pages"
        self.do(finish, Pair(part[0] for part in parts), ok)
        self.do(finish, Pair(part[1] for part in parts), False)

    # -- queries, leases, loads

    @rule(instance=instances, hashes=hash_lists, lead=leads, shares=st.integers(1, 2), ttl=ttls, count=st.booleans())
    def query(self, instance: str, hashes: list[bytes], lead: int, shares: int, ttl: float | None, count: bool) -> None:
        hashes = self.lookup(instance, hashes, lead)
        found = self.do("query", self.ns[instance], self.layout(instance), hashes, instance, shares, ttl, count=count)
        if found[0].lease_id:
            self.lease_ids.append((found[0].lease_id, instance))

    @rule(
        first=instances,
        second=st.none() | instances,
        hashes=hash_lists,
        lead=leads,
        lease=st.booleans(),
        owner=instances,
        shares=st.integers(1, 2),
        ttl=ttls,
    )
    def resident_and_lease(
        self,
        first: str,
        second: str | None,
        hashes: list[bytes],
        lead: int,
        lease: bool,
        owner: str,
        shares: int,
        ttl: float | None,
    ) -> None:
        """resident() of one or two namespaces, then (maybe) lease_pages over every page found, as a hybrid
        query does: pages of several size classes under one lease."""
        found = [
            self.do("resident", self.ns[name], self.layout(name), self.lookup(name, hashes, lead))
            for name in ([first] if second is None else [first, second])
        ]
        if not lease:
            return
        pids = Pair([pid for part in found for pid in part[side] if pid is not None] for side in range(2))
        lease_id = self.do("lease_pages", pids, owner, shares, ttl)[0]
        if lease_id:
            self.lease_ids.append((lease_id, owner))

    @rule(instance=instances, hits=st.integers(0, 3), misses=st.integers(0, 3))
    def count_hits(self, instance: str, hits: int, misses: int) -> None:
        self.do("count_hits", self.ns[instance], hits, misses)

    @rule(
        instance=instances,
        which=st.integers(0, 1),
        hashes=hash_lists,
        lead=leads,
        use_lease=st.booleans(),
        pick=picks,
        foreign=st.booleans(),
    )
    def begin_load(
        self, instance: str, which: int, hashes: list[bytes], lead: int, use_lease: bool, pick: int, foreign: bool
    ) -> None:
        """A load, with a lease handed out earlier (open or ended) or none; `foreign`: the lease is another
        owner's, which the store must not let this load consume."""
        layout, ns = self.layout(instance), self.ns[instance]
        key = (which, 0) if instance == "A" else (0, which)
        hashes = self.lookup(instance, hashes, lead)
        lease_id, owner = 0, instance
        if use_lease and self.lease_ids:
            lease_id, owner = self.lease_ids[pick % len(self.lease_ids)]
            if foreign:
                owner = next(n for n in NAMES if n != owner)
        self.loads.append(self.do("begin_load", ns, layout, hashes, lease_id=lease_id, owner=owner, worker_key=key))

    @precondition(lambda self: self.loads)
    @rule(i=picks)
    def finish_load(self, i: int) -> None:
        self.do("finish_load", self.loads.pop(i % len(self.loads)))

    @rule(pick=picks, how=st.sampled_from(("handed out", "bogus", "wrong owner")))
    def release(self, pick: int, how: str) -> None:
        """Releases a lease handed out earlier (an ended one, or another owner's, raises NotFound on both), or
        a lease id never handed out (NotFound)."""
        if how == "bogus" or not self.lease_ids:
            out = self.call("release", 10_000 + pick, "A")
            assert isinstance(out.error, NotFound), out
            return
        lease_id, owner = self.lease_ids[pick % len(self.lease_ids)]
        if how == "wrong owner":
            owner = next(n for n in NAMES if n != owner)
        out = self.call("release", lease_id, owner)
        assert out.error is None or isinstance(out.error, NotFound), out

    @rule(instance=instances)
    def release_owner(self, instance: str) -> None:
        self.do("release_owner", instance)

    @rule(instance=instances)
    def purge(self, instance: str) -> None:
        self.do("purge", self.ns[instance])

    @rule(instance=instances, hashes=hash_lists, lead=leads)
    def pin_pages(self, instance: str, hashes: list[bytes], lead: int) -> None:
        """An SSD write pins sealed pages of one namespace (found by resident) until it unpins them."""
        found = self.do("resident", self.ns[instance], self.layout(instance), self.lookup(instance, hashes, lead))
        pids = [pid for pid in found[0] if pid is not None]
        self.do("pin_pages", pids)
        self.pinned.append(pids)

    @precondition(lambda self: self.pinned)
    @rule(i=picks)
    def unpin_pages(self, i: int) -> None:
        self.do("unpin_pages", self.pinned.pop(i % len(self.pinned)))

    @rule(hashes=hash_lists, use_lease=st.booleans(), pick=picks)
    def refused(self, hashes: list[bytes], use_lease: bool, pick: int) -> None:
        """Every call with a layout that collides with A's namespace is refused (nothing stored, found or pinned)."""
        ns, other = self.ns["A"], L_A_OTHER
        self.do("begin_save", ns, other, hashes, 1)
        self.do("begin_refill", ns, other, hashes, 0b11)
        self.do("query", ns, other, hashes, "A", 1)
        self.do("resident", ns, other, hashes)
        self.do("reclaim", ns, other, hashes)
        lease_id = self.lease_ids[pick % len(self.lease_ids)][0] if use_lease and self.lease_ids else 0
        self.loads.append(self.do("begin_load", ns, other, hashes, lease_id=lease_id, owner="A"))

    # -- slabs and time

    @rule(instance=instances, hashes=hash_lists)
    def reclaim(self, instance: str, hashes: list[bytes]) -> None:
        self.do("reclaim", self.ns[instance], self.layout(instance), hashes)

    @rule()
    def reclaim_step(self) -> None:
        self.do("reclaim_step")

    @rule(seconds=st.sampled_from((0.5, 4.5, 5.0, 25.0, 30.0, 31.0, 60.0, 61.0)))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.do("expire")

    @rule()
    def settle(self) -> None:
        """Every open save (as written) and load finishes, every pin_pages run is unpinned and every owner's leases
        end: slabs can be emptied again."""
        while self.saves:
            self.finish_save(0, True, "pages", [])
        while self.loads:
            self.finish_load(0)
        while self.pinned:
            self.unpin_pages(0)
        for name in NAMES:
            self.release_owner(name)

    # -- the two stores cannot be told apart

    @invariant()
    def indistinguishable(self) -> None:
        for side, store in zip(SIDES, self.stores, strict=True):
            try:
                store.check_invariants()
            except AssertionError as e:
                raise AssertionError(f"check_invariants failed on the {side} store: {e}") from e
        for name in ("statistics", "slab_statistics", "reclaiming", "take_changes"):
            self.do(name)
        for pid in self.do("page_ids")[0]:
            self.do("state_of", pid)
        for page_bytes in PAGE_BYTES:
            self.do("lru_order", page_bytes)
        for ns in self.all_ns.values():
            # in order: the index's iteration order is observable (a purge forgets pages in that order, which
            # orders take_changes() and the slabs' free lists, so the page ids later saves get)
            self.do("sealed_hashes", ns)
            for block_hash in HASHES:
                self.do("page", ns, block_hash)
        # the records without their index (the index is the table's own: its contents are compared above)
        same(
            "namespace_stats",
            *(
                [
                    (r.namespace_final, r.layout_id, r.tenant, r.resident_blocks, r.resident_bytes, r.hits, r.misses)
                    + (dict(r.refused), r.last_used, layout.digest)
                    for r, layout in store.namespace_stats()
                ]
                for store in self.stores
            ),
        )
        for lease_id, _ in self.lease_ids:
            self.do("lease", lease_id)


TestTableMachine = TableMachine.TestCase
TestTableMachine.settings = settings(
    max_examples=200, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# ------------------------------------------------------------------------------------------ at scale


@pytest.mark.parametrize(
    ("seed", "active", "n_slabs", "min_evictions", "eviction"),
    [(1, NAMES, 40, 2000, "prefix-slru"), (2, ["C", "W"], 36, 200, "prefix-lru")],
    ids=["five size classes", "two classes of small pages"],
)
def test_a_large_pool_under_a_long_random_workload_matches(
    seed: int, active: list[str], n_slabs: int, min_evictions: int, eviction: str
) -> None:
    """The same machine on a pool of thousands of pages (each index shard holds many hashes, deleted and added
    again), first filled with 512-byte pages (more than 4096 at once: the page table grows past its first chunk
    of ids), then prompts of up to 48 consecutive hashes out of thousands: the rules in a seeded random order,
    compared every 100 calls and at the end."""
    rng = random.Random(seed)
    m = TableMachine()
    m.build(n_slabs=n_slabs, slab_bytes=1 << 16, reclaim_step=rng.choice((64, 2048)), active=active, eviction=eviction)
    universe = 6000

    def prompt() -> list[bytes]:
        start, n = rng.randrange(universe), rng.randint(1, 48)
        hashes = [h(start + k) for k in range(n)]
        if rng.random() < 0.2:  # a repeat, or a block out of order
            k = rng.randrange(n)
            hashes.insert(rng.randrange(n), hashes[k])
        return hashes

    def name() -> str:
        return rng.choice(NAMES)

    def one_call(op: str) -> None:
        """The rule `op` with random arguments (those that need something open do nothing without it)."""
        if op == "save":
            m.save(name(), prompt(), rng.random() < 0.3)
        elif op == "begin_save":
            m.begin_save(name(), rng.randrange(2), prompt())
        elif op == "begin_refill":
            m.begin_refill(name(), prompt())
        elif op == "abandon_refill" and any(save.refill for save in m.saves):
            m.abandon_refill(rng.randrange(1000))
        elif op == "finish_save" and m.saves:
            how = rng.choice(("count", "pages", "split"))
            m.finish_save(rng.randrange(1000), rng.random() < 0.8, how, [rng.random() < 0.7 for _ in range(64)])
        elif op == "query":
            m.query(name(), prompt(), rng.choice((0, 8, 48)), rng.randint(1, 2), rng.choice((None, 5.0)), True)
        elif op == "resident_and_lease":
            m.resident_and_lease(name(), rng.choice((None, name())), prompt(), 16, True, name(), 1, None)
        elif op == "begin_load":
            m.begin_load(name(), rng.randrange(2), prompt(), rng.choice((0, 16)), True, rng.randrange(1000), False)
        elif op == "finish_load" and m.loads:
            m.finish_load(rng.randrange(1000))
        elif op == "release":
            m.release(rng.randrange(1000), rng.choice(("handed out", "handed out", "wrong owner")))
        elif op == "release_owner":
            m.release_owner(name())
        elif op == "purge":
            m.purge(name())
        elif op == "pin_pages":
            m.pin_pages(name(), prompt(), 8)
        elif op == "unpin_pages" and m.pinned:
            m.unpin_pages(rng.randrange(1000))
        elif op == "reclaim":
            m.reclaim(name(), prompt())
        elif op == "reclaim_step":
            m.reclaim_step()
        elif op == "advance":
            m.advance(rng.choice((1.0, 5.0, 31.0, 61.0)))
        elif op == "settle":
            m.settle()

    weights = {
        "save": 16,
        "begin_save": 6,
        "begin_refill": 3,
        "abandon_refill": 1,
        "finish_save": 8,
        "query": 8,
        "resident_and_lease": 4,
        "begin_load": 6,
        "finish_load": 6,
        "release": 4,
        "release_owner": 1,
        "purge": 0.2,  # rare, as settle: the pool is to stay full
        "pin_pages": 2,
        "unpin_pages": 2,
        "reclaim": 3,
        "reclaim_step": 3,
        "advance": 2,
        "settle": 0.2,
    }
    for start in range(0, universe, 48):  # C's 512-byte pages, until the pool is full
        m.save("C", [h(start + k) for k in range(48)], False)
        if m.stores[1].statistics().free_bytes == 0:
            break
    m.indistinguishable()
    carved = len(m.stores[1].page_ids())
    assert carved > 4096, carved
    for step in range(3000):
        one_call(rng.choices(list(weights), list(weights.values()))[0])
        if step % 100 == 99:
            m.indistinguishable()
    m.settle()
    m.indistinguishable()
    assert m.stores[1].statistics().evictions >= min_evictions  # and a busy one
