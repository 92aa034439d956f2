"""The engine lock, timed (kvseal.engine.lock.TimedLock): each hold lands in its histogram bucket, the longest is
kept with where it was; the engine empties a slab for another size class in bounded holds, releasing the lock
between them; a real `kvseal serve` exposes the holds on /metrics."""

from __future__ import annotations

import os
import re
import threading
import time
from bisect import bisect_left
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import save_blocks
from prometheus_client.utils import floatToGoString

from kvseal.engine.engine import Caller, Engine, Session
from kvseal.engine.lock import HOLD_BUCKETS, TimedLock
from kvseal.memfd import SharedArray
from kvseal.testing import EngineProcess, register_one_rank

HOLD_S = 0.02  # a hold at least this long: past the 10 ms bucket

# ------------------------------------------------------------------------------------------ TimedLock


def hold_until_told(lock: TimedLock, taken: threading.Event, go: threading.Event, times: list[float]) -> None:
    t0 = time.perf_counter()
    with lock:
        taken.set()
        go.wait()
    times.append(time.perf_counter() - t0)  # the hold, and the acquire and release around it


HOLDER_LINE = hold_until_told.__code__.co_firstlineno + 2  # the `with` line


def test_a_hold_lands_in_its_bucket_and_the_longest_names_where() -> None:
    lock = TimedLock()
    taken, go, outer = threading.Event(), threading.Event(), []
    holder = threading.Thread(target=hold_until_told, args=(lock, taken, go, outer))
    holder.start()
    assert taken.wait(30)
    start = time.perf_counter()
    assert lock.locked() and lock.statistics().holds == 0  # read while held, without the lock: the hold is not over
    while time.perf_counter() - start < HOLD_S:  # the holder waits on `go` until at least HOLD_S after it took it
        pass
    go.set()
    holder.join()

    stats = lock.statistics()
    assert stats.holds == 1 and not lock.locked()
    assert HOLD_S <= stats.max_seconds <= outer[0] and stats.total_seconds == stats.max_seconds
    expected = [0] * (len(HOLD_BUCKETS) + 1)
    expected[bisect_left(HOLD_BUCKETS, stats.max_seconds)] = 1
    assert list(stats.bucket_counts) == expected
    assert sum(stats.bucket_counts[: HOLD_BUCKETS.index(10e-3) + 1]) == 0  # not in any bucket up to 10 ms
    assert stats.max_where == f"hold_until_told:{HOLDER_LINE}"

    def short() -> None:
        with lock:
            pass

    for _ in range(100):
        short()
    after = lock.statistics()
    assert after.holds == 101 and sum(after.bucket_counts) == 101
    assert after.max_seconds == stats.max_seconds and after.max_where == stats.max_where  # still the longest
    assert after.total_seconds >= stats.total_seconds
    assert after.bucket_counts[-1] == stats.bucket_counts[-1]


def test_a_block_that_raises_is_timed_and_releases() -> None:
    lock = TimedLock()

    def fails() -> None:
        with lock:
            raise ValueError("in the block")

    with pytest.raises(ValueError, match="in the block"):
        fails()
    stats = lock.statistics()
    assert stats.holds == 1 and not lock.locked() and stats.max_where.startswith("fails:")
    with lock:  # released: taken again at once
        assert lock.locked()


# ------------------------------------------------------------------------------------------ the engine

SESSION = Session(Caller(uid=os.getuid(), pid=os.getpid(), privileged=True))
SLAB = 1 << 20
TINY_PAGES = SLAB // 64  # 16384 pages of 64 bytes fill the pool's one slab
STEP = 1000


def register(engine: Engine, instance: str, slot_bytes: int, blocks: int) -> SharedArray:
    shared = SharedArray((blocks, slot_bytes))
    shared.array[:] = np.random.default_rng(slot_bytes).integers(0, 256, shared.array.shape, dtype=np.uint8)
    register_one_rank(
        engine, instance, shared, namespace=instance, layout_tag="test", dtype="bfloat16", session=SESSION
    )
    return shared


@pytest.fixture
def full_engine() -> Iterator[Engine]:
    """An engine whose one-slab pool is full of 64-byte pages ("tiny"), with a 4 KiB-page instance ("big")."""
    engine = Engine(SLAB, slab_bytes=SLAB, prefault=False)
    engine.store.reclaim_step_pages = STEP
    memories = [register(engine, "tiny", 64, 1024), register(engine, "big", 4096, 4)]
    hashes = [i.to_bytes(32, "big") for i in range(TINY_PAGES)]
    assert engine.save(("tiny", 0, 0), hashes, [i % 1024 for i in range(TINY_PAGES)], SESSION).completed == TINY_PAGES
    assert engine.statistics().store.free_bytes == 0
    assert isinstance(engine._lock, TimedLock)
    yield engine
    engine.close()
    for shared in memories:
        shared.close()


def test_a_save_that_needs_another_class_slab_empties_it_in_separate_holds(
    full_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = full_engine
    seen = []  # (lock holds finished, evictions) at each reclaim() call: every call is in a hold of its own
    reclaim = engine.store.reclaim

    def watched(*args: object) -> bool:
        assert engine._lock.locked()
        seen.append((engine.lock_statistics().holds, engine.store.statistics().evictions))
        return reclaim(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.store, "reclaim", watched)
    r = engine.save(("big", 0, 0), [b"big" * 8], [0], SESSION)
    assert (r.written, r.not_stored, r.completed) == (1, 0, 1)
    steps = -(-TINY_PAGES // STEP)
    assert len(seen) == steps + 1  # each step, then the call that found room
    holds = [h for h, _ in seen]
    assert holds == sorted(set(holds))  # the lock was released and taken again between any two calls
    assert all(b - a <= STEP for (_, a), (_, b) in zip(seen, seen[1:], strict=False))
    assert engine.statistics().store.evictions == TINY_PAGES
    engine.store.check_invariants()


def test_tick_finishes_a_slab_a_refill_began_emptying(full_engine: Engine) -> None:
    engine = full_engine
    store = engine.store
    ns_big = engine.registry.instances["big"].ns_id
    layout = store.layout_of(ns_big)
    with engine._lock:  # as a refill does: begin_save alone, under the lock, spends one step
        plan = store.begin_save(ns_big, layout, [b"big" * 8], 1)
    assert plan.not_stored == 1 and store.statistics().evictions == STEP and store.reclaiming() >= 0
    holds = engine.lock_statistics().holds
    engine.tick()
    assert store.reclaiming() == -1 and store.statistics().evictions == TINY_PAGES
    assert engine.lock_statistics().holds - holds >= -(-(TINY_PAGES - STEP) // STEP)  # one hold per step
    assert store.statistics().free_bytes == SLAB
    store.check_invariants()


# ------------------------------------------------------------------------------------------ /metrics


def test_metrics_of_a_real_engine_expose_the_lock_holds(engine: EngineProcess) -> None:
    save_blocks(engine, "solo", "ns-lock", [bytes([i]) * 32 for i in range(4)])
    text = engine.metrics_text()
    les = re.findall(r'^kvseal_engine_lock_hold_seconds_bucket\{le="([^"]+)"\} ', text, re.M)
    assert les == [*map(floatToGoString, HOLD_BUCKETS), "+Inf"]
    count = engine.metric("kvseal_engine_lock_hold_seconds_count")
    assert count is not None and count >= 4  # the registration, the save's two, the session's end
    values = [engine.metric("kvseal_engine_lock_hold_seconds_bucket", le=le) for le in les]
    assert None not in values and values == sorted(values)  # type: ignore[type-var]
    assert values[-1] >= count  # each scrape takes the lock too: a later one counts more holds
    total = engine.metric("kvseal_engine_lock_hold_seconds_sum")
    longest = engine.metric("kvseal_engine_lock_max_hold_seconds")  # the name the benchmarks read
    assert total is not None and longest is not None and 0 < longest <= total
    assert re.search(r'^kvseal_engine_lock_max_hold_info\{where="\w+:\d+"\} 1\.0$', text, re.M), text
