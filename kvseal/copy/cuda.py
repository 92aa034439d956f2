"""Copies between a worker's CUDA KV tensors (opened from its IPC handles) and pool pages.

One layer segment of one block is `width` contiguous bytes in GPU memory; consecutive blocks are `pitch` bytes
apart there and `page_stride` bytes apart in the pool. A span of n consecutive blocks going to n consecutive pages
(kvseal.copy.copier._spans) is therefore one 2D copy per layer segment, n rows on both sides:

    GPU   base + first*pitch -> |width|....pitch....|width|....     (n rows)
    pool  page + slot offset -> |width|..page_stride..|width|....

which the GPU's copy engines do without staging (cudaMemcpy2DAsync on the copier's own stream, one synchronize
per call: the bytes are in place when save/load return). The pool is page-locked (cudaHostRegister) at the first
CUDA registration, so the copies run at the link's speed; if the kernel refuses (RLIMIT_MEMLOCK), they still work
from pageable memory, at a fraction of it. The addresses are plain integers, so the plan of copies is tested on
the CPU with host memory (tests/test_copy.py) and exercised on a GPU by `kvseal bench cuda`.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from kvseal.copy.rows import Segment, SegmentTable
from kvseal.errors import FailedPrecondition

log = logging.getLogger(__name__)

HOST_TO_DEVICE, DEVICE_TO_HOST = 1, 2  # cudaMemcpyKind
BATCH_FROM = 512  # spans x segments from which one batched call beats a 2D copy per span and segment


class Runtime(Protocol):
    """The few CUDA runtime calls the copier makes (CudaRuntime; tests run the same plan on host memory)."""

    def set_device(self, device: int) -> None: ...
    def new_stream(self) -> int: ...
    def copy_2d(
        self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, kind: int, stream: int
    ) -> None: ...
    def copy_batch(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> bool:
        """Enqueues len(dsts) 1D copies in one call; False (nothing enqueued) when the runtime has no batch API."""
        ...

    def synchronize(self, stream: int) -> None: ...
    def destroy_stream(self, stream: int) -> None: ...


class CudaRuntime:
    """libcudart through ctypes: the copy of torch's own (already loaded by `import torch`; dlopen finds it by its
    soname), else the one in the nvidia wheels. ctypes releases the GIL during each call."""

    def __init__(self) -> None:
        self._lib = _load_cudart()
        lib = self._lib
        sz, vp = ctypes.c_size_t, ctypes.c_void_p
        lib.cudaMemcpy2DAsync.argtypes = [vp, sz, vp, sz, sz, sz, ctypes.c_int, vp]
        lib.cudaStreamCreateWithFlags.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
        lib.cudaStreamSynchronize.argtypes = [vp]
        lib.cudaStreamDestroy.argtypes = [vp]
        lib.cudaSetDevice.argtypes = [ctypes.c_int]
        lib.cudaHostRegister.argtypes = [vp, sz, ctypes.c_uint]
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        self._batch = getattr(lib, "cudaMemcpyBatchAsync", None)  # CUDA 12.8+
        if self._batch is not None:
            # CUDA 12.x has a failIdx argument before the stream; 13 dropped it
            self._batch_fail_idx = _major_version(lib) < 13
            self._batch.argtypes = [vp, vp, vp, sz, vp, vp, sz] + ([vp] if self._batch_fail_idx else []) + [vp]
            self._attrs = _MemcpyAttributes(srcAccessOrder=1)  # cudaMemcpySrcAccessOrderStream
            self._attrs_idx = (ctypes.c_size_t * 1)(0)
        self._pinned: set[int] = set()
        self._pin_lock = threading.Lock()

    def _check(self, err: int, what: str) -> None:
        if err:
            raise RuntimeError(f"{what}: {self._lib.cudaGetErrorString(err).decode()} (cudaError {err})")

    def set_device(self, device: int) -> None:
        self._check(self._lib.cudaSetDevice(device), "cudaSetDevice")

    def new_stream(self) -> int:
        stream = ctypes.c_void_p()
        self._check(self._lib.cudaStreamCreateWithFlags(ctypes.byref(stream), 1), "cudaStreamCreate")  # non-blocking
        return stream.value or 0

    def copy_2d(
        self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, kind: int, stream: int
    ) -> None:
        err = self._lib.cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, kind, stream)
        self._check(err, "cudaMemcpy2DAsync")

    def copy_batch(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> bool:
        if self._batch is None:
            return False
        args: list[Any] = [dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, len(dsts)]
        args += [ctypes.addressof(self._attrs), ctypes.addressof(self._attrs_idx), 1]
        if self._batch_fail_idx:
            fail = ctypes.c_size_t(0)
            args.append(ctypes.addressof(fail))
        err = self._batch(*args, stream)
        if err:  # refused before anything was enqueued: 2D copies from now on
            self._lib.cudaGetLastError()
            log.warning(
                "kvseal: cudaMemcpyBatchAsync refused (%s); CUDA copies of scattered blocks take one call per block",
                self._lib.cudaGetErrorString(err).decode(),
            )
            self._batch = None
            return False
        return True

    def synchronize(self, stream: int) -> None:
        self._check(self._lib.cudaStreamSynchronize(stream), "cudaStreamSynchronize")

    def destroy_stream(self, stream: int) -> None:
        self._lib.cudaStreamDestroy(stream)

    def pin(self, address: int, size: int) -> bool:
        """Page-locks host memory once (portable: every device sees it pinned). False when refused."""
        with self._pin_lock:
            if address in self._pinned:
                return True
            err = self._lib.cudaHostRegister(address, size, 1)  # cudaHostRegisterPortable
            if err:
                self._lib.cudaGetLastError()  # clear it, so that the next call does not report it
                log.warning(
                    "kvseal: the pool (%d bytes) could not be page-locked for CUDA copies (%s); they run from "
                    "pageable memory, several times slower: raise the engine's RLIMIT_MEMLOCK (ulimit -l)",
                    size,
                    self._lib.cudaGetErrorString(err).decode(),
                )
                return False
            self._pinned.add(address)
            log.info("kvseal: page-locked the pool (%d bytes) for CUDA copies", size)
            return True


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]  # type 0: no hint


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


def _major_version(lib: ctypes.CDLL) -> int:
    version = ctypes.c_int(0)
    lib.cudaRuntimeGetVersion(ctypes.byref(version))
    return version.value // 1000


def _load_cudart() -> ctypes.CDLL:
    try:
        import torch
    except ImportError:
        raise FailedPrecondition("CUDA memory: the engine was installed without torch") from None
    major = (torch.version.cuda or "").split(".")[0]
    names = [f"libcudart.so.{major}"] if major else []
    site_packages = os.path.dirname(os.path.dirname(torch.__file__))
    names += sorted(glob.glob(os.path.join(site_packages, "nvidia", "**", "libcudart.so*"), recursive=True))
    names.append("libcudart.so")
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise FailedPrecondition(f"CUDA memory: libcudart cannot be loaded (tried {', '.join(names)})")


_runtime: CudaRuntime | None = None
_runtime_lock = threading.Lock()


def cuda_runtime() -> CudaRuntime:
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            _runtime = CudaRuntime()
        return _runtime


class CudaCopier:
    """The 2D copies of one worker's CUDA layer segments. `segments` on one device; `tensors` keeps the opened IPC
    allocations alive while the copier is."""

    def __init__(
        self,
        segments: Sequence[Segment],
        device: int,
        arena: np.ndarray,
        page_stride: int,
        runtime: Runtime,
        tensors: Sequence[Any] = (),
        batch_from: int = BATCH_FROM,
    ) -> None:
        self._table = SegmentTable(segments)
        self._device = device
        self._arena = arena
        self._arena_address = arena.ctypes.data
        self._page_stride = page_stride
        self._rt = runtime
        self._tensors = list(tensors)
        self.batch_from = batch_from
        runtime.set_device(device)
        self._stream = runtime.new_stream()

    def __del__(self) -> None:  # a worker that registers again gets a new copier: its stream goes with the old one
        if getattr(self, "_stream", None):
            self._rt.destroy_stream(self._stream)

    def save(self, spans: Sequence[tuple[int, int, int]], align: int) -> None:
        """Copies each span (first block id, first page position in `align` units, length) into its pages."""
        self._copy(spans, align, DEVICE_TO_HOST)

    def load(self, spans: Sequence[tuple[int, int, int]], align: int) -> None:
        self._copy(spans, align, HOST_TO_DEVICE)

    def _copy(self, spans: Sequence[tuple[int, int, int]], align: int, kind: int) -> None:
        if not spans:
            return
        rt, stream = self._rt, self._stream
        rt.set_device(self._device)
        if len(spans) * len(self._table.segments) < self.batch_from or not self._copy_batch(spans, align, kind):
            self._copy_2d(spans, align, kind)
        rt.synchronize(stream)

    def _copy_2d(self, spans: Sequence[tuple[int, int, int]], align: int, kind: int) -> None:
        """One 2D copy per span and layer segment: long spans (a batch saved together, a prompt's blocks)."""
        rt, stream, stride, arena = self._rt, self._stream, self._page_stride, self._arena_address
        for first, pos, n in spans:
            page = arena + pos * align
            for s in self._table.segments:
                gpu, host = s.address + first * s.pitch, page + s.page_offset
                if kind == DEVICE_TO_HOST:
                    rt.copy_2d(host, stride, gpu, s.pitch, s.width, n, kind, stream)
                else:
                    rt.copy_2d(gpu, s.pitch, host, stride, s.width, n, kind, stream)

    def _copy_batch(self, spans: Sequence[tuple[int, int, int]], align: int, kind: int) -> bool:
        """One 1D copy per block and layer segment, all enqueued by one call: many short spans (scattered block
        ids), where a call per span and segment would cost more than the copies. Addresses computed in numpy."""
        host, gpu, sizes = self._table.rows(spans, self._arena_address, align, self._page_stride)
        dsts, srcs = (host, gpu) if kind == DEVICE_TO_HOST else (gpu, host)
        return self._rt.copy_batch(dsts, srcs, sizes, self._stream)
