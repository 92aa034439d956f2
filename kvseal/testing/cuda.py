"""A stand-in for the CUDA runtime that runs the CUDA copier's plan on host memory, so the plan (which rows go
where) is tested on machines without a GPU. The real calls are exercised by `kvseal bench cuda` on a GPU."""

from __future__ import annotations

import ctypes
from typing import Any


class HostRuntime:
    """kvseal.copy.cuda.Runtime over host addresses: each 2D copy is `height` row memmoves and a batch one
    memmove per copy, done at once."""

    def __init__(self) -> None:
        self.copies = 0
        self.batches = 0
        self.synchronized = 0

    def set_device(self, device: int) -> None:
        pass

    def new_stream(self) -> int:
        return 1

    def copy_2d(
        self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, kind: int, stream: int
    ) -> None:
        assert width <= dst_pitch and width <= src_pitch, "cudaMemcpy2D refuses a width wider than a pitch"
        for row in range(height):
            ctypes.memmove(dst + row * dst_pitch, src + row * src_pitch, width)
        self.copies += 1

    def copy_batch(self, dsts: Any, srcs: Any, sizes: Any, stream: int) -> bool:
        for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
            ctypes.memmove(dst, src, size)
        self.batches += 1
        return True

    def synchronize(self, stream: int) -> None:
        self.synchronized += 1

    def destroy_stream(self, stream: int) -> None:
        pass
