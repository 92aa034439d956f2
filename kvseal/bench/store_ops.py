"""Bookkeeping micro-benchmark: µs per block of the store's and the engine's hot calls, in-process, 1 thread.

    kvseal bench store_ops [--quick]

store      BlockStore alone (no bytes move), 1 KiB pages, at 256 and 8192 blocks per call:
             begin_save (carve)   into a fresh pool: every page id is new
             begin_save (evict)   into a full pool: every page evicts the least recently used one
             finish_save          seals the plan's pages
             query / release      pins / unpins a lease over every block
             begin_load / finish_load
stall      one Save of another size class into a pool whose only slab is full of evictable 64-byte pages: the
           whole slab (1M pages; 64k with --quick) is emptied under the engine lock
engine     Engine.save / query / release / load with 64-byte pages from a worker's sealed memfd
           (kvseal.memfd.SharedArray), registered through a Session as the lane does; the block lists are Python
           lists, as the lane's decoder hands them over (copies included)

Figures are medians over repetitions (best in brackets). Nothing is asserted.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from kvseal.bench.harness import Hashes
from kvseal.core.layout import LayerGeometry, build_layout
from kvseal.core.store import BlockStore
from kvseal.engine.engine import Caller, Engine, Session
from kvseal.memfd import SharedArray
from kvseal.testing.worker import register_one_rank

BATCHES = (256, 8192)
MiB = 1 << 20


def geometry(name: str, nbytes: int) -> LayerGeometry:
    return LayerGeometry(name, "bfloat16", nbytes, 1, 0, "bench.cpu")


class Samples:
    """Seconds per call, per operation name, turned into µs per block."""

    def __init__(self) -> None:
        self.s: dict[str, list[float]] = {}

    def timed(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.s.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    def us_per_block(self, name: str, n: int) -> tuple[float, float]:
        v = self.s.get(name, [])
        if not v:
            return float("nan"), float("nan")
        return statistics.median(v) / n * 1e6, min(v) / n * 1e6


def store_ops(n: int, reps: int) -> Samples:
    layout = build_layout(16, 1, [geometry("model.layers.0.attn", 1024)])
    out = Samples()
    hashes = Hashes()
    arena = 4 * n * layout.page_bytes  # one slab of 4 batches: from the 5th batch on every save evicts

    def new_store() -> tuple[BlockStore, int]:
        store = BlockStore(arena, slab_bytes=arena, inflight_timeout_s=1e9, lease_ttl_s=1e9)
        return store, store.namespace("bench.00000000", layout)

    for _ in range(reps):  # a fresh pool per repetition: every page id is carved
        store, ns = new_store()
        gc.collect()
        plan = out.timed("begin_save (carve)", store.begin_save, ns, layout, hashes.take(n), 1)
        assert len(plan.entries) == n
        store.finish_save(plan, True)

    store, ns = new_store()
    for _ in range(4):
        store.finish_save(store.begin_save(ns, layout, hashes.take(n), 1), True)
    assert store.statistics().free_bytes == 0
    for _ in range(reps):
        h = hashes.take(n)
        gc.collect()
        plan = out.timed("begin_save (evict)", store.begin_save, ns, layout, h, 1)
        assert len(plan.entries) == n
        assert out.timed("finish_save", store.finish_save, plan, True) == n
        q = out.timed("query", store.query, ns, layout, h, "bench", 1)
        assert q.hits == n
        out.timed("release", store.release, q.lease_id, "bench")
        load = out.timed("begin_load", store.begin_load, ns, layout, h)
        assert load.outcome == "loaded"
        out.timed("finish_load", store.finish_load, load)
    store.check_invariants()
    return out


def cross_class_stall(pages: int) -> tuple[float, float, int]:
    """Emptying a slab of `pages` 64-byte pages for one page of another size class, the way the engine does it:
    reclaim() steps (the engine lock is released between them), then begin_save. Returns (longest step in
    seconds, all steps together, number of steps)."""
    small = build_layout(16, 1, [geometry("model.layers.0.attn", 64)])
    big = build_layout(16, 1, [geometry("model.layers.0.attn", 128)])
    store = BlockStore(pages * 64, slab_bytes=pages * 64)
    ns_small = store.namespace("bench.small", small)
    ns_big = store.namespace("bench.big", big)
    hashes = Hashes()
    left = pages
    while left:
        m = min(8192, left)
        store.finish_save(store.begin_save(ns_small, small, hashes.take(m), 1), True)
        left -= m
    assert store.statistics().free_bytes == 0
    gc.collect()
    wanted = hashes.take(1)
    steps: list[float] = []
    more = True
    while more:
        t0 = time.perf_counter()
        more = store.reclaim(ns_big, big, wanted)
        steps.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    plan = store.begin_save(ns_big, big, wanted, 1)
    steps.append(time.perf_counter() - t0)
    assert len(plan.entries) == 1 and store.statistics().evictions == pages
    return max(steps), sum(steps), len(steps)


def engine_ops(n: int, reps: int) -> Samples:
    """Engine.save/query/release/load of n 64-byte blocks of one session's worker, as the lane server calls them."""
    page = 64
    num_blocks = 2 * n
    shared = SharedArray((num_blocks * page,))
    session = Session(Caller(uid=os.getuid(), pid=os.getpid(), privileged=True))
    try:
        engine = Engine(max(64 * MiB, 4 * n * page * (reps + 2)), prefault=True)
        layers = {"model.layers.0.attn": shared.array.reshape(num_blocks, page)}
        register_one_rank(
            engine,
            "bench",
            shared,
            layers,
            namespace="bench",
            layout_tag="bench.cpu",
            dtype="bfloat16",
            session=session,
        )
        worker = ("bench", 0, 0)
        hashes = Hashes()
        out = Samples()
        for _ in range(reps):
            block_hashes = hashes.take(n)
            gc.collect()
            r = out.timed("engine save", engine.save, worker, block_hashes, list(range(n)), session)
            assert r.completed == n
            q = out.timed("engine query", engine.query, "bench", block_hashes, session.caller)
            assert q.hits == n
            out.timed("engine release", engine.release, "bench", q.lease_id, session.caller)
            q = engine.query("bench", block_hashes, session.caller)
            ids = list(range(n, 2 * n))
            lr = out.timed("engine load (lease)", engine.load, worker, block_hashes, ids, session, q.lease_id)
            assert lr.loaded == n and engine.store.lease(q.lease_id) is None
        engine.store.check_invariants()
        return out
    finally:
        shared.close()


def main(quick: bool = False) -> int:
    reps = {256: 10, 8192: 3} if quick else {256: 200, 8192: 20}
    print(f"kvseal store-ops micro-benchmark ({'quick' if quick else 'full'}), python {sys.version.split()[0]}")
    print("µs per block: median of the repetitions [best]")
    rows: dict[str, dict[int, tuple[float, float]]] = {}
    for n in BATCHES:
        s = store_ops(n, reps[n])
        for name in s.s:
            rows.setdefault(name, {})[n] = s.us_per_block(name, n)
    for n in BATCHES:
        s = engine_ops(n, max(3, reps[n] // 4))
        for name in s.s:
            rows.setdefault(name, {})[n] = s.us_per_block(name, n)
    print(f"{'operation':<22}" + "".join(f"{f'{n} blocks':>20}" for n in BATCHES))
    for name, by_n in rows.items():
        cells = "".join(f"{f'{by_n[n][0]:.3f} [{by_n[n][1]:.3f}]':>20}" for n in BATCHES)
        print(f"{name:<22}{cells}")
    pages = (1 << 16) if quick else (1 << 20)
    longest, total, steps = cross_class_stall(pages)
    print(
        f"cross-class stall: emptying a slab of {pages} evictable pages for one page of another class took "
        f"{total * 1e3:.1f} ms in {steps} steps ({total / pages * 1e9:.0f} ns/page), the longest "
        f"{longest * 1e3:.2f} ms (one engine-lock hold)"
    )
    return 0
