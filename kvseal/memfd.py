"""Worker memory the engine may map: memfds sealed against shrinking, handed over as file descriptors.

Why: the engine maps every worker's KV memory and copies into and out of it. A file the worker could shrink would
let it kill the engine with SIGBUS on the next copy (every tenant's cache lost); a path the engine opened by name
would let a client name a file it could not open itself. So workers hand the engine a descriptor (SCM_RIGHTS on the
local lane) of a memfd carrying F_SEAL_SHRINK: its size can never drop below what the engine mapped, and the
engine never opens a path (kvseal.engine.memory checks what it receives).

`share_storage` moves an existing CPU torch storage into such a memfd *in place*: the storage's pages are copied
into the memfd and the memfd is mapped over the very same addresses (mmap MAP_FIXED), chunk by chunk. Every
tensor and view keeps its data pointer and keeps working, which is what vLLM needs (it holds views of one KV
allocation in several places). `shared_array` allocates fresh memfd-backed memory for callers without torch.

    [lo ............................. hi)      page-aligned range around the storage, one memfd of hi - lo bytes
        | storage.data_ptr() ... + nbytes |    offset of the data inside the memfd = data_ptr - lo
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

PAGE = mmap.PAGESIZE
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_CHUNK = 64 << 20  # bytes copied and remapped at a time: bounds the transient extra memory
_MAP_FIXED = 0x10

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]


@dataclass(frozen=True, slots=True)
class SharedRegion:
    """A sealed memfd and where a storage's bytes start in it. The fd stays open for the life of the process."""

    fd: int
    offset: int
    size: int


_regions: dict[int, SharedRegion] = {}  # storage data_ptr -> its memfd (several layers may view one storage)
_pages: dict[int, tuple[int, int]] = {}  # storage data_ptr -> the address range its memfd is mapped over
_lock = threading.Lock()


def new_memfd(size: int, name: str = "kvseal-kv") -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    return fd


def seal(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)


def share_storage(tensor: Any) -> SharedRegion:
    """Moves the CPU storage under `tensor` into a sealed memfd in place (once per storage) and returns it.

    The caller guarantees that nothing writes to the storage while it moves (at registration, before inference
    runs). Pinned (page-locked) memory is refused: remapping it would break its CUDA registration."""
    if tensor.device.type != "cpu":
        raise ValueError(f"share_storage takes CPU tensors, got one on {tensor.device}")
    if tensor.is_pinned():
        raise ValueError("pinned (page-locked) CPU memory cannot be shared with the engine: allocate it unpinned")
    storage = tensor.untyped_storage()
    base, nbytes = storage.data_ptr(), storage.nbytes()
    with _lock:
        region = _regions.get(base)
        if region is not None and region.size - region.offset >= nbytes:
            return region
        lo, hi = _page_range(base, nbytes)
        for other, (olo, ohi) in _pages.items():
            if other != base and lo < ohi and olo < hi:
                # its first or last page is already another memfd's: moving it would cut that page out of one
                raise ValueError(
                    "this tensor's memory shares a page with another shared tensor (a small heap allocation): "
                    "allocate the KV cache as one tensor, or page-aligned (kvseal.memfd.SharedArray)"
                )
        region = _regions[base] = _move_in_place(base, nbytes)
        _pages[base] = (lo, hi)
        return region


def _page_range(base: int, nbytes: int) -> tuple[int, int]:
    return base & ~(PAGE - 1), (base + max(nbytes, 1) + PAGE - 1) & ~(PAGE - 1)


def _move_in_place(base: int, nbytes: int) -> SharedRegion:
    lo, hi = _page_range(base, nbytes)
    fd = new_memfd(hi - lo)
    try:
        for start in range(0, hi - lo, _CHUNK):
            n = min(_CHUNK, hi - lo - start)
            view = memoryview((ctypes.c_char * n).from_address(lo + start)).cast("B")
            done = 0
            while done < n:
                done += os.pwrite(fd, view[done:], start + done)
            flags = mmap.MAP_SHARED | _MAP_FIXED | mmap.MAP_POPULATE
            addr = _libc.mmap(lo + start, n, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, start)
            if addr != lo + start:
                err = ctypes.get_errno()
                raise OSError(err, f"mmap of the KV memory onto its memfd failed: {os.strerror(err)}")
        seal(fd)
    except BaseException:
        os.close(fd)
        raise
    return SharedRegion(fd, base - lo, hi - lo)


class SharedArray:
    """Fresh memfd-backed memory (sealed) as a numpy array, for workers and benchmarks without torch."""

    def __init__(self, shape: tuple[int, ...], dtype: Any = np.uint8) -> None:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        size = max(PAGE, (nbytes + PAGE - 1) & ~(PAGE - 1))
        self.fd = new_memfd(size)
        seal(self.fd)
        self._map = mmap.mmap(self.fd, size)
        self.array: np.ndarray = np.frombuffer(self._map, dtype=dtype, count=int(np.prod(shape))).reshape(shape)
        self.region = SharedRegion(self.fd, 0, size)
        base = self.array.ctypes.data
        with _lock:  # a torch tensor made from this array (torch.from_numpy) shares this memfd as it is
            _regions[base] = self.region
            _pages[base] = (base, base + size)

    def close(self) -> None:
        """Closes the descriptor (the mapping lives while the array does)."""
        with _lock:
            _regions.pop(self.array.ctypes.data, None)
            _pages.pop(self.array.ctypes.data, None)
        os.close(self.fd)
