"""The engine in-process (no server): saves large enough to go in chunks, whose store bookkeeping runs on the
bookkeeping thread while the handler copies, give the same result as one plan: byte-exact pages, exact counts,
balanced accounting, and a copy that fails midway keeps the chunks already copied and nothing else."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvseal.core.layout import LayerGeometry, LayerRegistration, WorkerRegistration
from kvseal.engine import engine as engine_module
from kvseal.engine.engine import Engine
from kvseal.engine.memory import ShmSpec

SLOT = 4096  # one layer, 4 KiB per block
BLOCKS = 64
WORKER = ("w", 0, 0)


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch, shm_files: Callable[[int], str]) -> Iterator[tuple[Engine, np.ndarray]]:
    monkeypatch.setattr(engine_module, "SAVE_CHUNK_BYTES", 1)  # chunks of SAVE_CHUNK_MIN_BLOCKS (16) blocks
    path = shm_files(BLOCKS * SLOT)
    engine = Engine(8 << 20, slab_bytes=1 << 20)
    layer = LayerRegistration(
        LayerGeometry("model.layers.0.attn", "bfloat16", SLOT, 1, 0, "test"),
        BLOCKS,
        (SLOT,),
        ShmSpec(path, 0, BLOCKS * SLOT),
    )
    engine.register(WorkerRegistration("w", "ns", 0, 1, 0, 1, 16, (layer,)))
    memory = np.memmap(path, dtype=np.uint8, mode="r+", shape=(BLOCKS, SLOT))
    memory[:] = np.random.default_rng(7).integers(0, 256, memory.shape, dtype=np.uint8)
    yield engine, memory


def hashes(start: int, n: int) -> list[bytes]:
    return [i.to_bytes(32, "big") for i in range(start, start + n)]


def test_a_chunked_save_loads_back_byte_exact(engine: tuple[Engine, np.ndarray]) -> None:
    eng, memory = engine
    first = eng.save(WORKER, hashes(0, 10), list(range(10)))  # one chunk, saved before
    assert (first.written, first.completed) == (10, 10)

    # 40 blocks = 3 chunks; 5 of them already sealed, one hash twice (in the first and the last chunk: written
    # twice, or skipped the second time when the first chunk was sealed before the last one began)
    batch = hashes(5, 39) + hashes(20, 1)
    ids = list(range(5, 44)) + [20]
    r = eng.save(WORKER, batch, ids)
    assert r.written + r.skipped == 40 and r.skipped in (5, 6)
    assert (r.not_stored, r.completed) == (0, 34)
    eng.store.check_invariants()

    source = memory[:44].copy()
    memory[:44] = 0
    q = eng.query("w", hashes(0, 44))
    assert q.hits == 44
    loaded = eng.load(WORKER, hashes(0, 44), list(range(44)), q.lease_id)
    assert (loaded.outcome, loaded.loaded) == ("loaded", 44)
    assert np.array_equal(memory[:44], source)
    eng.store.check_invariants()


def test_a_copy_failing_midway_keeps_the_chunks_already_copied(
    engine: tuple[Engine, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    eng, _ = engine
    (worker,) = eng._instances["w"].workers.values()
    assert worker.copier is not None
    copy = worker.copier.save
    calls = []

    def failing(block_ids: list[int], offsets: list[int]) -> None:
        calls.append(len(block_ids))
        if len(calls) == 2:
            raise OSError("the worker's memory went away")
        copy(block_ids, offsets)

    monkeypatch.setattr(worker.copier, "save", failing)
    with pytest.raises(OSError):
        eng.save(WORKER, hashes(0, 48), list(range(48)))
    assert calls == [16, 16]
    assert eng.query("w", hashes(0, 48)).hits == 16  # the first chunk; the second and third are gone
    s = eng.store.statistics()
    assert (s.resident_blocks, s.inflight_blocks) == (16, 0)
    eng.store.check_invariants()
