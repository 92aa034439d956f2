"""The copier (kvseal.engine.copy) against a reference that moves one slot at a time: any block ids and pages,
consecutive or not, land byte-exact, and nothing else in the arena or the worker's memory changes. Worker memory
as a numpy array (shared memory), and as a torch tensor copied by the CUDA copier's plan of 2D copies, run on host
memory by kvseal.testing.cuda.HostRuntime (the plan CUDA memory takes; the real calls run on a GPU in
`kvseal bench cuda`)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvseal.core.store import PAGE_ALIGN, page_stride
from kvseal.engine.copy import SlotSource, WorkerCopier, _spans
from kvseal.testing.cuda import HostRuntime

NUM_BLOCKS, LAYERS, SEGMENT = 12, 3, 64
SLOT = 2 * SEGMENT  # K and V
PAGE = LAYERS * SLOT + 8  # not a multiple of 64: the stride between pages is larger than a page
STRIDE = page_stride(PAGE)
PAGES = 16


def worker_memory(as_torch: bool) -> tuple[np.ndarray, list[SlotSource]]:
    """All layers as views of one allocation, [layer][K/V][block][SEGMENT] (a split-K/V layout). The numpy array
    returned shares its bytes with the memory the copier is given."""
    memory = np.random.default_rng(1).integers(0, 256, LAYERS * 2 * NUM_BLOCKS * SEGMENT, dtype=np.uint8)
    given = torch.from_numpy(memory) if as_torch else memory
    sources = [
        SlotSource(
            memory=given,
            src_offset=layer * 2 * NUM_BLOCKS * SEGMENT,
            block_stride=SEGMENT,
            segment_stride=NUM_BLOCKS * SEGMENT,
            num_blocks=NUM_BLOCKS,
            segments=2,
            segment_bytes=SEGMENT,
            dst_offset=layer * SLOT,
        )
        for layer in range(LAYERS)
    ]
    return memory, sources


def slot(memory: np.ndarray, layer: int, block: int) -> bytes:
    base = layer * 2 * NUM_BLOCKS * SEGMENT + block * SEGMENT
    k = memory[base : base + SEGMENT]
    v = memory[base + NUM_BLOCKS * SEGMENT : base + NUM_BLOCKS * SEGMENT + SEGMENT]
    return k.tobytes() + v.tobytes()


# a batch: distinct pages (as a store hands out) and block ids, often in consecutive spans
batches = st.integers(0, 8).flatmap(
    lambda n: st.tuples(
        st.permutations(range(NUM_BLOCKS)).map(lambda p: p[:n])
        | st.integers(0, NUM_BLOCKS - n).map(lambda a: list(range(a, a + n))),
        st.permutations(range(PAGES)).map(lambda p: p[:n])
        | st.integers(0, PAGES - n).map(lambda a: list(range(a, a + n))),
    )
)


@given(batches, st.sampled_from(["numpy", "cuda 2d", "cuda batch"]))
def test_save_then_load_moves_exactly_the_planned_slots(batch: tuple[list[int], list[int]], path: str) -> None:
    block_ids, pages = batch
    as_torch = path != "numpy"
    memory, sources = worker_memory(as_torch)
    arena = np.zeros(PAGES * STRIDE + PAGE_ALIGN, dtype=np.uint8)
    runtime = HostRuntime()
    copier = WorkerCopier(sources, arena, STRIDE, runtime, cuda_batch_from=0 if path == "cuda batch" else 1 << 30)
    offsets = [p * STRIDE for p in pages]

    copier.save(block_ids, offsets)
    expected = np.zeros_like(arena)
    for block, offset in zip(block_ids, offsets, strict=True):
        page = b"".join(slot(memory, layer, block) for layer in range(LAYERS))
        expected[offset : offset + len(page)] = np.frombuffer(page, dtype=np.uint8)
    assert np.array_equal(arena, expected)
    if as_torch:  # one synchronize per call; one batch, or one 2D copy per span and layer segment
        spans = len(_spans(block_ids, offsets, STRIDE // PAGE_ALIGN))
        assert runtime.synchronized == (1 if spans else 0)
        assert (runtime.batches, runtime.copies) == (
            (1, 0) if path == "cuda batch" and spans else (0, spans * LAYERS * 2)
        )

    before = memory.copy()
    targets = [(b + 5) % NUM_BLOCKS for b in block_ids]  # other blocks, still distinct
    copier.load(targets, offsets)
    for target, block in zip(targets, block_ids, strict=True):
        for layer in range(LAYERS):
            assert slot(memory, layer, target) == slot(before, layer, block)
    untouched = set(range(NUM_BLOCKS)) - set(targets)
    for block in untouched:
        for layer in range(LAYERS):
            assert slot(memory, layer, block) == slot(before, layer, block)
