"""The copier (kvseal.copy.copier) against a reference that moves one slot at a time: any block ids and pages,
consecutive or not, land byte-exact, and nothing else in the arena or the worker's memory changes. Every path:
the native kernel (cached and streaming stores), numpy (the fallback when the kernel is not built), and the CUDA
copier's plan of 2D copies or one batch, run on host memory by kvseal.testing.cuda.HostRuntime (the real calls run
on a GPU in `kvseal bench cuda`)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import xxhash
import xxhash._xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvseal.copy.copier import SlotSource, WorkerCopier, _spans
from kvseal.copy.kernel import COPY_PATH, NATIVE_CHECKSUMS, checksums, copy_page, kernel
from kvseal.core.store import PAGE_ALIGN, page_stride
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


PATHS = ["kernel", "kernel streaming", "numpy", "cuda 2d", "cuda batch"]


def test_the_kernel_is_built_and_chosen_unless_the_environment_says_numpy() -> None:
    assert kernel is not None, "kvseal/copy/_rows.c was not built: pip install -e . needs gcc and Python's headers"
    if os.environ.get("KVSEAL_COPY") == "numpy":
        assert (COPY_PATH, NATIVE_CHECKSUMS) == ("numpy", False)
    else:
        assert COPY_PATH.startswith("kernel")
        assert NATIVE_CHECKSUMS, "the kernel did not find XXH3_64bits in the xxhash package's extension module"


@given(batches, st.sampled_from(PATHS))
def test_save_then_load_moves_exactly_the_planned_slots(batch: tuple[list[int], list[int]], path: str) -> None:
    block_ids, pages = batch
    as_torch = path.startswith("cuda")
    memory, sources = worker_memory(as_torch)
    arena = np.zeros(PAGES * STRIDE + PAGE_ALIGN, dtype=np.uint8)
    runtime = HostRuntime()
    copier = WorkerCopier(
        sources,
        arena,
        STRIDE,
        runtime,
        cuda_batch_from=0 if path == "cuda batch" else 1 << 30,
        use_kernel=path.startswith("kernel"),
        stream_from=0 if path == "kernel streaming" else 1 << 30,
    )
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


@given(
    st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300), st.integers(0, 700)), min_size=1, max_size=6),
    st.booleans(),
)
def test_the_kernel_copies_rows_of_any_size_and_alignment(rows: list[tuple[int, int, int]], streaming: bool) -> None:
    """Heads before a 64-byte boundary, whole lines, tails: each row lands exactly, nothing around it changes."""
    assert kernel is not None
    src = np.random.default_rng(2).integers(0, 256, 1024, dtype=np.uint8)
    dst = np.zeros(len(rows) * 1024, dtype=np.uint8)
    expected = dst.copy()
    dsts, srcs, sizes = [], [], []
    for i, (d, s, n) in enumerate(rows):
        dsts.append(dst.ctypes.data + i * 1024 + d)
        srcs.append(src.ctypes.data + s)
        sizes.append(n)
        expected[i * 1024 + d : i * 1024 + d + n] = src[s : s + n]
    as_words = [np.array(v, dtype=np.uint64) for v in (dsts, srcs, sizes)]
    kernel.copy_rows(*as_words, streaming)
    assert np.array_equal(dst, expected)


def test_the_kernel_refuses_arrays_it_cannot_read_as_rows() -> None:
    assert kernel is not None
    one, two = np.zeros(1, dtype=np.uint64), np.zeros(2, dtype=np.uint64)
    with pytest.raises(ValueError, match="one length"):
        kernel.copy_rows(one, two, one, False)
    with pytest.raises(TypeError, match="8-byte integers"):
        kernel.copy_rows(np.zeros(1, dtype=np.uint32), one, one, False)
    with pytest.raises(TypeError):
        kernel.copy_rows(one, one, [0], False)  # not a buffer
    segments, blocks = [np.zeros(1, dtype=np.int64)] * 4, [np.zeros(1, dtype=np.int64)] * 2
    with pytest.raises(ValueError, match="one length"):
        kernel.copy_blocks(*segments[:3], two, *blocks, True, False)
    with pytest.raises(ValueError, match="one length"):
        kernel.copy_blocks(*segments, blocks[0], two, True, False)
    with pytest.raises(TypeError, match="block_ids must be a contiguous array of 8-byte integers"):
        kernel.copy_blocks(*segments, np.zeros(1, dtype=np.uint32), blocks[1], True, False)


def test_copy_page_moves_a_whole_page_or_refuses_another_size() -> None:
    page = np.random.default_rng(3).integers(0, 256, (2 << 20) + 24, dtype=np.uint8)
    into = bytearray(page.nbytes)
    copy_page(memoryview(into), page.tobytes())
    assert bytes(into) == page.tobytes()
    with pytest.raises(ValueError, match="bytes into"):
        copy_page(memoryview(into)[1:], page)


# lengths across XXH3's code paths: 0, 1-3, 4-8, 9-16, 17-128, 129-240, longer (one stripe, several blocks)
@given(st.lists(st.binary(max_size=300) | st.integers(0, 5000).map(lambda n: bytes(range(256)) * (n // 256 + 1))))
def test_the_kernels_checksums_are_xxh3_64(buffers: list[bytes]) -> None:
    views = [memoryview(b)[1:] if b else memoryview(b) for b in buffers]  # not always at the start of an allocation
    assert checksums(views) == [xxhash.xxh3_64_intdigest(v) for v in views]
    assert checksums(tuple(buffers)) == [xxhash.xxh3_64_intdigest(b) for b in buffers]


def test_the_kernel_refuses_to_checksum_what_is_no_contiguous_buffer() -> None:
    assert kernel is not None
    assert kernel.load_xxh3(xxhash._xxhash.__file__)  # already done at import unless KVSEAL_COPY=numpy
    with pytest.raises(TypeError, match="a sequence of buffers"):
        kernel.checksums(7)
    with pytest.raises(TypeError):
        kernel.checksums([b"page", "text"])  # a str exports no buffer: nothing is left acquired
    with pytest.raises(BufferError):
        kernel.checksums([memoryview(bytes(64))[::2]])
    assert kernel.load_xxh3("/no/such/library.so") is False
    assert kernel.checksums([b"still loaded"]) == [xxhash.xxh3_64_intdigest(b"still loaded")]
