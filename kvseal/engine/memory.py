"""Host memory the engine touches: its own pre-faulted arena, and the workers' KV tensors mapped from shared memory
(or CUDA IPC handles). Clients never touch the arena; the engine does every copy."""

from __future__ import annotations

import mmap
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvseal.errors import FailedPrecondition, InvalidArgument

_PROC_FD_RE = re.compile(r"^/proc/(\d+)/fd/(\d+)$")
_SHM_DIR = "/dev/shm/"


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
    path: str
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


def check_shm_path(where: str, path: str) -> None:
    """Only shared-memory files may be mapped: the engine writes into what it maps."""
    if "\x00" in path:
        raise InvalidArgument(f"{where}.path {path!r} contains a NUL byte")
    m = _PROC_FD_RE.match(path)
    if m:
        try:
            target = os.readlink(path)
        except OSError as e:
            raise FailedPrecondition(f"{where}.path {path!r} cannot be resolved: {e.strerror}") from None
        if target.startswith(_SHM_DIR) or target.startswith("/memfd:"):
            return
        raise InvalidArgument(f"{where}.path {path!r} points to {target!r}, which is not a shared-memory file")
    if os.path.realpath(path).startswith(_SHM_DIR) and "/../" not in path:
        return
    raise InvalidArgument(f"{where}.path {path!r} must be a file in /dev/shm or /proc/PID/fd/FD of one")


class MappedFile:
    """A worker's shared-memory file, mapped read-write. Unmapped when the last view of it is gone."""

    def __init__(self, where: str, path: str, size: int) -> None:
        check_shm_path(where, path)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise FailedPrecondition(f"{where}.path {path!r} cannot be opened: {e.strerror}") from None
        try:
            file_size = os.fstat(fd).st_size
            if size == 0 or size > file_size:
                raise InvalidArgument(f"{where}.size {size} must be in 1..{file_size} (the file's size)")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        _populate(self._map)
        self.bytes = np.frombuffer(self._map, dtype=np.uint8)
        self.path = path
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


def map_layer_memory(where: str, memory: Any, extent: int, cache: dict[tuple[str, int], MappedFile]) -> MappedFile:
    """Maps (or reuses, for layers that share one allocation) the file behind a layer and checks its bounds."""
    if isinstance(memory, CudaSpec):
        raise FailedPrecondition(f"{where}: CUDA memory must be mapped with map_cuda_storage")
    if not isinstance(memory, ShmSpec):
        raise InvalidArgument(f"{where} must be set (shm or cuda)")
    key = (memory.path, memory.size)
    mapped = cache.get(key)
    if mapped is None:
        mapped = cache[key] = MappedFile(f"{where}.shm", memory.path, memory.size)
    if memory.offset + extent > memory.size:
        raise InvalidArgument(
            f"{where}.shm.offset {memory.offset} + layer extent {extent} exceeds size {memory.size}: "
            "strides, num_blocks or segment_bytes do not fit the shared memory"
        )
    return mapped


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
