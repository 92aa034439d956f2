"""The byte-moving kernel (kvseal/copy/_rows.c), when `pip install` built it, and which copy path runs; and the page
checksums (XXH3-64) of peer fetch and the SSD tier, computed by the kernel without the GIL when it found the xxhash
package's compiled library, else by python-xxhash (which holds the GIL while it hashes).

KVSEAL_COPY=numpy in the environment makes the engine copy with numpy and checksum with python-xxhash even when the
kernel is built (to compare the two, or to rule the kernel out)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence

import numpy as np
import xxhash

try:
    from kvseal.copy import _rows as kernel
except ImportError:  # not built: numpy copies
    kernel = None  # type: ignore[assignment]

STREAM_FROM = 4 << 20  # bytes per call from which the kernel uses non-temporal stores (measured: equal at 1-4 MiB)
USE_KERNEL = kernel is not None and os.environ.get("KVSEAL_COPY", "") != "numpy"
COPY_PATH = ("kernel (streaming stores)" if kernel.STREAMING else "kernel") if USE_KERNEL else "numpy"

__all__ = ["COPY_PATH", "NATIVE_CHECKSUMS", "STREAM_FROM", "USE_KERNEL", "checksums", "copy_page", "kernel"]


def _load_xxh3() -> bool:
    """Whether the kernel found XXH3_64bits in xxhash's own extension module and it hashes as xxhash does."""
    if not USE_KERNEL:
        return False
    spec = importlib.util.find_spec("xxhash._xxhash")
    if spec is None or spec.origin is None:  # another packaging of xxhash: python-xxhash hashes
        return False
    if not kernel.load_xxh3(spec.origin):
        return False
    probes = (b"", b"kvseal", bytes(range(256)) * 33)  # the short, middle and long code paths of XXH3
    return kernel.checksums(probes) == [xxhash.xxh3_64_intdigest(p) for p in probes]


NATIVE_CHECKSUMS = _load_xxh3()


def checksums(views: Sequence[memoryview | bytes]) -> list[int]:
    """XXH3-64 of each contiguous buffer: without the GIL when the kernel can, else with python-xxhash."""
    if NATIVE_CHECKSUMS:
        return kernel.checksums(views)
    return [xxhash.xxh3_64_intdigest(v) for v in views]


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
