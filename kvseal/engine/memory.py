"""Host memory the engine touches: its own pre-faulted arena, and the workers' KV tensors mapped from the sealed
memfds they handed over (or CUDA IPC handles). Clients never touch the arena; the engine does every copy."""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvseal.errors import FailedPrecondition, InvalidArgument


class Arena:
    """The pool's bytes: one anonymous mapping, faulted in at start (fresh memory copies 3-4x slower)."""

    def __init__(self, size: int, *, prefault: bool = True) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if prefault:
            flags |= getattr(mmap, "MAP_POPULATE", 0)
        self._map = mmap.mmap(-1, size, flags=flags)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE)
        self.bytes = np.frombuffer(self._map, dtype=np.uint8)
        if prefault:
            self.bytes[:: mmap.PAGESIZE] = 0  # touch every page in case MAP_POPULATE was ignored
        self.size = size


@dataclass(frozen=True, slots=True)
class ShmSpec:
    fd: int  # index into the descriptors that came with the registration
    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class CudaSpec:
    """The fields of torch's CUDA storage reduction (torch.multiprocessing.reductions)."""

    device: int
    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    offset: int


TMPFS_MAGIC = 0x01021994  # memfds live on the kernel's internal tmpfs; hugetlbfs ones (SIGBUS-prone) do not
_libc = ctypes.CDLL(None, use_errno=True)


def _fs_type(fd: int) -> int:
    buf = (ctypes.c_long * 16)()  # struct statfs: f_type is the first word
    if _libc.fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(buf[0])


def check_memfd(where: str, fd: int, size: int) -> None:
    """The engine maps only what cannot fail under it: a regular memfd on tmpfs, opened read-write, sealed against
    shrinking (so no page it maps can disappear: no SIGBUS), at least `size` bytes long. The descriptor came from
    the worker itself (SCM_RIGHTS), so it is memory the worker could open."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or _fs_type(fd) != TMPFS_MAGIC:
            raise InvalidArgument(f"{where}: the descriptor is not shared memory; hand over a memfd (kvseal.memfd)")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0  # not a memfd
        if not seals & fcntl.F_SEAL_SHRINK:
            raise InvalidArgument(
                f"{where}: the memory must be a memfd sealed with F_SEAL_SHRINK (kvseal.memfd does it), so it can "
                "never shrink under the engine"
            )
        if seals & (fcntl.F_SEAL_WRITE | getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)):
            raise InvalidArgument(f"{where}: the memfd is sealed against writes; the engine loads into it")
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
            raise InvalidArgument(f"{where}: the descriptor must be open read-write (the engine loads into it)")
    except OSError as e:
        raise InvalidArgument(f"{where}: the descriptor cannot be inspected: {e.strerror}") from None
    if size == 0 or size > st.st_size:
        raise InvalidArgument(f"{where}.size {size} must be in 1..{st.st_size} (the memfd's size)")


class MappedFile:
    """A window of a worker's memfd, bytes [start, start + size) of the file (page-aligned), mapped read-write and
    faulted in. Unmapped when the last view of it is gone."""

    def __init__(self, where: str, fd: int, start: int, size: int) -> None:
        try:
            self._map = mmap.mmap(fd, size, offset=start)
        except OSError as e:
            raise InvalidArgument(f"{where}: the memfd cannot be mapped read-write: {e.strerror}") from None
        _populate(self._map)
        self.bytes = np.frombuffer(self._map, dtype=np.uint8)
        self.start = start
        self.size = size


# Linux 5.14+: map every page of a file now. The worker's pages exist already, but the engine's first write to
# each 4 KiB page of its own mapping would fault, which halves the speed of the first loads into it (measured:
# 28 MiB load 12-17 ms untouched, 3.3 ms mapped, 5.2 ms to populate once).
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _populate(mapping: mmap.mmap) -> None:
    try:
        mapping.madvise(_MADV_POPULATE_WRITE)
    except OSError:
        pass  # an older kernel: pages fault in on first use instead


def layer_extent(num_blocks: int, segments: int, segment_bytes: int, strides: tuple[int, ...]) -> int:
    """Bytes from a layer's first byte to one past its last."""
    extent = (num_blocks - 1) * strides[0] + segment_bytes
    if segments == 2:
        extent += strides[1]
    return extent


@dataclass(frozen=True, slots=True)
class ShmLayer:
    """One layer's shared memory, as register asks for it: `extent` bytes from `memory.offset`."""

    where: str  # e.g. layers[3].memory
    memory: ShmSpec
    extent: int


@dataclass(frozen=True, slots=True)
class ShmWindow:
    """Bytes [start, start + size) of one memfd (page-aligned), covering the extents of one or more layers."""

    where: str  # the first layer it covers
    fd: int  # the descriptor to map it from
    start: int
    size: int


@dataclass(frozen=True, slots=True)
class ShmPlan:
    """What a registration maps: the windows, and for each layer (in the order given) its window's index and the
    offset of its first byte in that window. `bytes` is what mapping it costs (the windows' total)."""

    windows: list[ShmWindow]
    layers: list[tuple[int, int]]
    bytes: int


def plan_shm(layers: Sequence[ShmLayer], fds: Sequence[int]) -> ShmPlan:
    """Checks every layer's descriptor and bounds, and plans to map only what the layers cover: each layer's extent
    rounded out to pages, the extents within one memfd that overlap or touch merged into one window (vLLM's layers
    are views of one allocation: one window, so the copier sees one array). A 16 KiB layer at the start of a sparse
    1 GiB memfd costs the engine 16 KiB, not 1 GiB."""
    extents: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # memfd (dev, inode) -> (lo, hi, layer)
    first_fd: dict[tuple[int, int], tuple[int, str]] = {}
    for i, layer in enumerate(layers):
        where, memory = layer.where, layer.memory
        if memory.fd >= len(fds):
            raise InvalidArgument(
                f"{where}.shm.fd {memory.fd}: the registration carried {len(fds)} file descriptor(s) (SCM_RIGHTS)"
            )
        fd = fds[memory.fd]
        check_memfd(f"{where}.shm", fd, memory.size)
        if memory.offset + layer.extent > memory.size:
            raise InvalidArgument(
                f"{where}.shm.offset {memory.offset} + layer extent {layer.extent} exceeds size {memory.size}: "
                "strides, num_blocks or segment_bytes do not fit the shared memory"
            )
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)  # one memfd handed over twice (or dup'd) is mapped once
        first_fd.setdefault(key, (fd, where))
        lo = memory.offset - memory.offset % mmap.ALLOCATIONGRANULARITY
        hi = -(-(memory.offset + layer.extent) // mmap.PAGESIZE) * mmap.PAGESIZE
        extents.setdefault(key, []).append((lo, hi, i))
    windows: list[ShmWindow] = []
    placed: list[tuple[int, int]] = [(0, 0)] * len(layers)
    for key, spans in extents.items():
        fd, where = first_fd[key]
        spans.sort()
        groups: list[list[tuple[int, int, int]]] = []
        end = -1
        for span in spans:
            if groups and span[0] <= end:
                groups[-1].append(span)
            else:
                groups.append([span])
            end = max(end, span[1]) if len(groups[-1]) > 1 else span[1]
        for group in groups:
            start, stop = group[0][0], max(hi for _, hi, _ in group)
            for _, _, m in group:
                placed[m] = (len(windows), layers[m].memory.offset - start)
            windows.append(ShmWindow(where, fd, start, stop - start))
    return ShmPlan(windows, placed, sum(w.size for w in windows))


def map_shm(plan: ShmPlan) -> list[tuple[np.ndarray, int]]:
    """Maps and faults in a plan's windows: per layer, the array of its window and its offset in it."""
    mapped = [MappedFile(w.where + ".shm", w.fd, w.start, w.size) for w in plan.windows]
    return [(mapped[w].bytes, offset) for w, offset in plan.layers]


def map_cuda_storage(where: str, spec: CudaSpec, extent: int) -> Any:
    """Opens a CUDA IPC allocation as a torch uint8 tensor (needs torch with CUDA; exercised on a lent GPU)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - depends on the install
        raise FailedPrecondition(f"{where}.cuda: the engine was installed without torch") from None
    if not torch.cuda.is_available():
        raise FailedPrecondition(f"{where}.cuda: this engine has no CUDA device; register shared CPU memory")
    if spec.offset + extent > spec.storage_size:
        raise InvalidArgument(f"{where}.cuda.offset {spec.offset} + layer extent {extent} exceeds storage_size")
    try:
        torch.cuda.init()  # type: ignore[no-untyped-call]  # the caching allocator opens IPC handles; uninitialised, it crashes (seen on an H200)
        storage = torch.UntypedStorage._new_shared_cuda(
            spec.device,
            spec.handle,
            spec.storage_size,
            spec.storage_offset,
            spec.ref_counter_handle,
            spec.ref_counter_offset,
            spec.event_handle,
            spec.event_sync_required,
        )
    except (RuntimeError, TypeError, ValueError) as e:
        raise FailedPrecondition(f"{where}.cuda: the IPC handle cannot be opened: {e}") from None
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{spec.device}").set_(storage)
