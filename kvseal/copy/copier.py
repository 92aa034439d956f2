"""Moves bytes between a worker's KV tensors and pool pages. The store plans (which pages, which offsets); this
module only copies.

Three ways move them:

- **the kernel** (kvseal/copy/_rows.c, built by `pip install` when a C compiler is there): the worker's layer
  segments as a table (kvseal.copy.rows) and the batch's block ids and page addresses as arrays, copied in one
  call without the GIL (the kernel computes each segment's two addresses itself), with non-temporal stores when
  the call moves STREAM_FROM bytes or more (they skip reading every destination line into the cache first: ~1.8x
  the speed of cached stores for copies beyond a few MiB on the project's machines, while small copies gain from
  the cache);
- **numpy**, when the kernel is not built (or KVSEAL_COPY=numpy): layers grouped into *runs* (slots that follow
  each other in the page at a constant distance and sit in the worker's memory at a constant distance too; vLLM
  allocates a group's layers as views of one buffer, so usually one run covers every layer), each a pair of
  strided views

      src[block_id]  -> (layers, segments, words) view into the worker's mapped memory
      dst[offset//64]-> (layers, segments, words) view into the arena, for a page at `offset`

  so a span costs one `np.copyto` per run; views use 8-byte words when every offset and stride allows it (uint8
  views copy 3-6x slower, docs/design.md §6);
- **CUDA** memory: kvseal.copy.cuda (the GPU's DMA engines, 2D copies of the same spans or one batch of rows).

The numpy and CUDA paths move blocks in *spans*: consecutive block ids whose pages are also consecutive in one
slab (a batch saved together is carved or evicted in order, and vLLM hands out fresh block ids in order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from kvseal.copy.cuda import BATCH_FROM, CudaCopier, Runtime, cuda_runtime
from kvseal.copy.kernel import STREAM_FROM, USE_KERNEL, kernel
from kvseal.copy.rows import Segment, SegmentTable
from kvseal.core.slabs import PAGE_ALIGN


@dataclass(frozen=True, slots=True)
class SlotSource:
    """Where one layer's blocks live in a worker's memory and where its slot goes in a page."""

    memory: Any  # np.ndarray of uint8 (a mapped file) or a torch uint8 tensor over a CUDA IPC storage
    src_offset: int
    block_stride: int
    segment_stride: int  # 0 when segments == 1
    num_blocks: int
    segments: int
    segment_bytes: int
    dst_offset: int  # byte offset of the slot in the page


def _runs(sources: Sequence[SlotSource]) -> list[list[SlotSource]]:
    ordered = sorted(sources, key=lambda s: s.dst_offset)
    runs: list[list[SlotSource]] = []
    for s in ordered:
        run = runs[-1] if runs else None
        if run is not None and _extends(run, s):
            run.append(s)
        else:
            runs.append([s])
    return runs


def _extends(run: list[SlotSource], s: SlotSource) -> bool:
    last = run[-1]
    same_shape = (
        s.memory is last.memory
        and s.segments == last.segments
        and s.segment_bytes == last.segment_bytes
        and s.block_stride == last.block_stride
        and s.segment_stride == last.segment_stride
        and s.num_blocks == last.num_blocks
        and s.src_offset > last.src_offset
    )
    if not same_shape:
        return False
    if len(run) == 1:
        return True
    return (s.src_offset - last.src_offset == last.src_offset - run[-2].src_offset) and (
        s.dst_offset - last.dst_offset == last.dst_offset - run[-2].dst_offset
    )


class WorkerCopier:
    """Copies one worker's slots of many blocks at once. The caller guarantees that pages stay allocated (pinned
    or inflight) and that block ids were range-checked. `page_stride` is the distance between consecutive pages
    of one slab (kvseal.core.store.page_stride)."""

    def __init__(
        self,
        sources: Sequence[SlotSource],
        arena: np.ndarray,
        page_stride: int,
        runtime: Runtime | None = None,
        cuda_batch_from: int = BATCH_FROM,
        *,
        use_kernel: bool = USE_KERNEL,
        stream_from: int = STREAM_FROM,
    ) -> None:
        """`runtime`: what copies the torch (CUDA) layers, libcudart by default; `cuda_batch_from`: the number of
        spans x layer segments from which their copies go in one batched call (kvseal.copy.cuda);
        `use_kernel`: host copies by the kernel rather than numpy; `stream_from`: see STREAM_FROM."""
        host = [s for s in sources if isinstance(s.memory, np.ndarray)]
        self._arena_address = arena.ctypes.data
        self._page_stride = page_stride
        self._stream_from = stream_from
        self._rows: SegmentTable | None = None
        self._runs: list[tuple[np.ndarray, np.ndarray]] = []
        if host and use_kernel:
            self._rows = SegmentTable([_segment(s, k) for s in host for k in range(s.segments)])
            self._row_bytes = int(self._rows.width.sum())
            self._mapped = [s.memory for s in host] + [arena]  # the kernel has addresses only: keep the maps alive
        else:
            self._runs = [_build_run(run, arena) for run in _runs(host)]
        tensors = [s for s in sources if not isinstance(s.memory, np.ndarray)]
        self._cuda = _cuda_copiers(tensors, arena, page_stride, runtime, cuda_batch_from) if tensors else []
        self._step = page_stride // PAGE_ALIGN

    def save(self, block_ids: Sequence[int], offsets: Sequence[int]) -> None:
        """Copies block_ids[k] into the page at offsets[k], for every k."""
        if self._rows is not None:
            self._kernel_copy(block_ids, offsets, to_pool=True)
        spans = _spans(block_ids, offsets, self._step) if self._runs or self._cuda else []
        for first, pos, n in spans:
            end, stop = first + n, pos + n * self._step
            for src, dst in self._runs:
                np.copyto(dst[pos : stop : self._step], src[first:end])
        for cuda in self._cuda:
            cuda.save(spans, PAGE_ALIGN)

    def load(self, block_ids: Sequence[int], offsets: Sequence[int]) -> None:
        """Copies the page at offsets[k] into block_ids[k], for every k. Copies into CUDA memory are complete on
        return."""
        if self._rows is not None:
            self._kernel_copy(block_ids, offsets, to_pool=False)
        spans = _spans(block_ids, offsets, self._step) if self._runs or self._cuda else []
        for first, pos, n in spans:
            end, stop = first + n, pos + n * self._step
            for src, dst in self._runs:
                np.copyto(src[first:end], dst[pos : stop : self._step])
        for cuda in self._cuda:
            cuda.load(spans, PAGE_ALIGN)

    def _kernel_copy(self, block_ids: Sequence[int], offsets: Sequence[int], to_pool: bool) -> None:
        """Every host segment of every block in one kernel call (no row arrays: the kernel walks the segment table
        and the batch's block ids and page addresses itself)."""
        n = len(block_ids)
        if not n:
            return
        t = self._rows
        assert t is not None
        ids = np.asarray(block_ids, dtype=np.int64)
        pages = np.asarray(offsets, dtype=np.int64) + self._arena_address
        streaming = n * self._row_bytes >= self._stream_from
        kernel.copy_blocks(t.address, t.pitch, t.width, t.page_offset, ids, pages, to_pool, streaming)


def _segment(s: SlotSource, k: int) -> Segment:
    """Segment k of a layer: its address in the worker's memory (a mapped memfd or a CUDA tensor)."""
    base = s.memory.ctypes.data if isinstance(s.memory, np.ndarray) else s.memory.data_ptr()
    return Segment(
        base + s.src_offset + k * s.segment_stride, s.block_stride, s.segment_bytes, s.dst_offset + k * s.segment_bytes
    )


def _cuda_copiers(
    sources: Sequence[SlotSource], arena: np.ndarray, page_stride: int, runtime: Runtime | None, batch_from: int
) -> list[CudaCopier]:
    """One CudaCopier per device of the worker's CUDA layers (the engine page-locked the pool when it mapped them)."""
    runtime = runtime or cuda_runtime()
    by_device: dict[int, list[SlotSource]] = {}
    for s in sources:
        by_device.setdefault(s.memory.device.index or 0, []).append(s)
    copiers = []
    for device, group in by_device.items():
        segments = [_segment(s, k) for s in group for k in range(s.segments)]
        copiers.append(CudaCopier(segments, device, arena, page_stride, runtime, [s.memory for s in group], batch_from))
    return copiers


def _spans(block_ids: Sequence[int], offsets: Sequence[int], step: int) -> list[tuple[int, int, int]]:
    """(first block id, first page position, length) of each maximal span where both the block ids and the
    pages are consecutive; page positions count PAGE_ALIGN units."""
    n = len(block_ids)
    if n == 0:
        return []
    ids = np.asarray(block_ids, dtype=np.int64)
    pos = np.asarray(offsets, dtype=np.int64) // PAGE_ALIGN
    cuts = np.flatnonzero((np.diff(ids) != 1) | (np.diff(pos) != step)) + 1
    starts = [0, *cuts.tolist()]
    ends = [*starts[1:], n]
    firsts, positions = ids[starts].tolist(), pos[starts].tolist()
    return [(firsts[k], positions[k], ends[k] - starts[k]) for k in range(len(starts))]


def _build_run(run: list[SlotSource], arena: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    first, n = run[0], len(run)
    src_delta = run[1].src_offset - first.src_offset if n > 1 else 0
    dst_delta = run[1].dst_offset - first.dst_offset if n > 1 else 0
    slot_bytes = first.segments * first.segment_bytes
    dst_extent = (n - 1) * dst_delta + slot_bytes
    positions = (arena.nbytes - first.dst_offset - dst_extent) // PAGE_ALIGN + 1
    word = 8
    for v in (
        first.src_offset,
        first.block_stride,
        first.segment_stride,
        first.segment_bytes,
        src_delta,
        first.dst_offset,
        dst_delta,
    ):
        if v % 8:
            word = 1
            break
    mem_words = _words(first.memory, word)
    arena_words = _words(arena, word)
    src = as_strided(
        mem_words[first.src_offset // word :],
        shape=(first.num_blocks, n, first.segments, first.segment_bytes // word),
        strides=(first.block_stride, src_delta, first.segment_stride, word),
        writeable=True,
    )
    dst = as_strided(
        arena_words[first.dst_offset // word :],
        shape=(positions, n, first.segments, first.segment_bytes // word),
        strides=(PAGE_ALIGN, dst_delta, first.segment_bytes, word),
        writeable=True,
    )
    return src, dst


def _words(buf: np.ndarray, word: int) -> np.ndarray:
    if word == 1:
        return buf
    return buf[: buf.nbytes // word * word].view(np.uint64)
