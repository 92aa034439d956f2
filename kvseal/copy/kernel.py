"""The byte-moving kernel (kvseal/copy/_rows.c), when `pip install` built it, and which copy path runs.

KVSEAL_COPY=numpy in the environment makes the engine copy with numpy even when the kernel is built (to compare
the two, or to rule the kernel out)."""

from __future__ import annotations

import os

import numpy as np

try:
    from kvseal.copy import _rows as kernel
except ImportError:  # not built: numpy copies
    kernel = None  # type: ignore[assignment]

STREAM_FROM = 4 << 20  # bytes per call from which the kernel uses non-temporal stores (measured: equal at 1-4 MiB)
USE_KERNEL = kernel is not None and os.environ.get("KVSEAL_COPY", "") != "numpy"
COPY_PATH = ("kernel (streaming stores)" if kernel.STREAMING else "kernel") if USE_KERNEL else "numpy"

__all__ = ["COPY_PATH", "STREAM_FROM", "USE_KERNEL", "copy_page", "kernel"]


def copy_page(dst: memoryview | np.ndarray, src: memoryview | bytes | np.ndarray) -> None:
    """Copies one page's bytes between the pool and an SSD buffer (refills and write-back: nobody reads the
    destination next, so with streaming stores when the kernel is built)."""
    d, s = np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8)
    if d.nbytes != s.nbytes:
        raise ValueError(f"copy_page: {s.nbytes} bytes into {d.nbytes}")
    if USE_KERNEL:
        dsts, srcs, sizes = (np.array([v], dtype=np.uint64) for v in (d.ctypes.data, s.ctypes.data, d.nbytes))
        kernel.copy_rows(dsts, srcs, sizes, True)
    else:
        np.copyto(d, s)
