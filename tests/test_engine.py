"""The engine in-process (no server): a save with new, sealed and repeated hashes at scattered and consecutive
block ids loads back byte-exact with exact counts and balanced accounting; a copy that fails stores nothing. Both
with the default SAVE_STEP and with steps of 7 hashes (a Save reserves its pages a step per engine-lock hold, a
repeated hash landing in two steps). CUDA handles: another user's are refused before they are opened; an engine
without a GPU says so.

Every test runs once per page table (ids [python] / [native]): the engine builds its BlockStore with the default,
which reads KVSEAL_TABLE; the `engine` fixture asserts the store got the table asked for."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import numpy as np
import pytest

from kvseal.core import pages
from kvseal.core.layout import LayerGeometry, LayerRegistration, WorkerRegistration
from kvseal.engine.engine import SAVE_STEP, Caller, Engine, Session
from kvseal.engine.memory import CudaSpec
from kvseal.errors import FailedPrecondition, PermissionDenied
from kvseal.memfd import SharedArray
from kvseal.testing import register_one_rank

SLOT = 4096  # one layer, 4 KiB per block
BLOCKS = 64
WORKER = ("w", 0, 0)


SESSION = Session(Caller(uid=os.getuid(), pid=os.getpid(), privileged=True))
NOT_BUILT = "the native page table (kvseal/core/_table.c) is not built"
TABLES = ["python", pytest.param("native", marks=pytest.mark.skipif(pages._table is None, reason=NOT_BUILT))]


@pytest.fixture(autouse=True, params=TABLES)
def table(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test of this module, once per page table (the Engine has no table argument: its store's default
    reads KVSEAL_TABLE)."""
    monkeypatch.setenv("KVSEAL_TABLE", request.param)
    return str(request.param)


@pytest.fixture
def engine(table: str) -> Iterator[tuple[Engine, np.ndarray]]:
    shared = SharedArray((BLOCKS, SLOT))
    engine = Engine(8 << 20, slab_bytes=1 << 20)
    assert engine.store.table == table, (
        f"asked for the {table} page table, the engine's store runs {engine.store.table}"
    )
    register_one_rank(engine, "w", shared, namespace="ns", layout_tag="test", dtype="bfloat16", session=SESSION)
    memory = shared.array
    memory[:] = np.random.default_rng(7).integers(0, 256, memory.shape, dtype=np.uint8)
    yield engine, memory
    shared.close()


def hashes(start: int, n: int) -> list[bytes]:
    return [i.to_bytes(32, "big") for i in range(start, start + n)]


@pytest.fixture(params=[SAVE_STEP, 7], ids=["one step", "steps of 7"])
def step(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr("kvseal.engine.engine.SAVE_STEP", request.param)
    return int(request.param)


def test_a_save_loads_back_byte_exact(engine: tuple[Engine, np.ndarray], step: int) -> None:
    eng, memory = engine
    holds = eng.lock_statistics().holds
    first = eng.save(WORKER, hashes(0, 10), list(range(10)), SESSION)
    assert (first.written, first.completed) == (10, 10)

    # 5 hashes already sealed, one hash twice, block ids in consecutive runs and scattered
    batch = hashes(5, 39) + hashes(20, 1)
    ids = list(range(5, 30)) + [43, 31, 30, 42, 41, 40, 39, 32, 33, 34, 35, 36, 37, 38] + [20]
    r = eng.save(WORKER, batch, ids, SESSION)
    assert (r.written, r.skipped, r.not_stored, r.completed) == (35, 5, 0, 34)
    eng.store.check_invariants()
    steps = -(-10 // step) + -(-len(batch) // step)  # each step one hold to reserve and one to finish
    assert eng.lock_statistics().holds - holds == 2 * steps + 2  # and one each for the counters

    source = memory[:44].copy()
    memory[:44] = 0
    q = eng.query("w", hashes(0, 44), SESSION.caller)
    assert q.hits == 44
    order = list(range(44))
    order[10:20] = order[19:9:-1]  # load into a scattered order too
    loaded = eng.load(WORKER, [hashes(0, 44)[i] for i in order], order, SESSION, q.lease_id)
    assert (loaded.outcome, loaded.loaded) == ("loaded", 44)
    expected = source.copy()
    expected[5:44] = source[ids[:39]]  # hash 5 + k was saved from block ids[k], and is loaded into block 5 + k
    assert np.array_equal(memory[:44], expected)
    eng.store.check_invariants()


def test_a_failed_copy_stores_nothing(
    engine: tuple[Engine, np.ndarray], step: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    eng, _ = engine
    (worker,) = eng.registry.instances["w"].workers.values()
    copier = worker.copiers[(0, 0)]

    def failing(block_ids: list[int], offsets: list[int]) -> None:
        raise OSError("the worker's memory went away")

    monkeypatch.setattr(copier, "save", failing)
    with pytest.raises(OSError):
        eng.save(WORKER, hashes(0, 48), list(range(48)), SESSION)
    assert eng.query("w", hashes(0, 48), SESSION.caller).hits == 0
    s = eng.store.statistics()
    assert (s.resident_blocks, s.inflight_blocks, s.free_bytes) == (0, 0, s.arena_bytes)
    eng.store.check_invariants()


def _cuda_registration(instance: str) -> WorkerRegistration:
    handle = CudaSpec(0, b"\0" * 64, 1 << 20, 0, b"\0" * 64, 0, b"", False, 0)
    layer = LayerRegistration(LayerGeometry("model.layers.0.attn", "bfloat16", SLOT, 1, 0, "test"), 8, (SLOT,), handle)
    return WorkerRegistration(instance, "ns", 0, 1, 0, 1, 16, (layer,))


def test_another_users_cuda_handle_is_refused_before_it_is_opened(engine: tuple[Engine, np.ndarray]) -> None:
    """The driver does not tie a CUDA IPC handle to the process that exported it: a handle from another user could
    name any tenant's GPU memory, so the engine takes them from its own user or root only."""
    eng, _ = engine
    stranger = Session(Caller(uid=os.getuid() + 4242, pid=1))
    with pytest.raises(PermissionDenied, match="CUDA IPC handles are accepted only from the engine's own user"):
        eng.register(_cuda_registration("stranger"), stranger, [])
    assert "stranger" not in eng.registry.instances


def test_a_cuda_handle_on_an_engine_without_a_gpu_says_so(engine: tuple[Engine, np.ndarray]) -> None:
    """Without a GPU, or without torch to open CUDA handles with (the engine installed without it), a CUDA
    registration is refused saying which."""
    eng, _ = engine
    why = (
        "no CUDA device; register shared CPU memory" if importlib.util.find_spec("torch") else "installed without torch"
    )
    with pytest.raises(FailedPrecondition, match=why):
        eng.register(_cuda_registration("gpu"), SESSION, [])
    assert "gpu" not in eng.registry.instances
    eng.store.check_invariants()
