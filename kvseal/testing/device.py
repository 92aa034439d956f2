"""An in-memory SSD device (kvseal.ssd.device's contract) for testing the tier's logic without a disk, with the
faults a disk has: a capacity that runs out (ENOSPC), and failing writes or reads (EIO) from a chosen point on."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np

from kvseal.ssd.device import ALIGN


class MemoryDevice:
    direct = False

    def __init__(self, capacity_bytes: int, segment_bytes: int, name: str = "memory") -> None:
        self.name = name
        self.segment_bytes = segment_bytes
        self.max_segments = capacity_bytes // segment_bytes
        self.files: dict[int, bytearray] = {}  # tests may corrupt these
        self.space_bytes: int | None = None  # bytes that may still be allocated (None: unlimited)
        self.fail_writes = False
        self.fail_reads = False
        self.writes = 0
        self.lines: list[str] = []  # the tier's notes
        self._lock = threading.Lock()

    def segments(self) -> list[int]:
        with self._lock:
            return sorted(self.files)

    def create(self, seq: int) -> None:
        with self._lock:
            if self.space_bytes is not None:
                if self.space_bytes < self.segment_bytes:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                self.space_bytes -= self.segment_bytes
            self.files[seq] = bytearray(self.segment_bytes)

    def write(self, seq: int, offset: int, data: memoryview) -> None:
        assert offset % ALIGN == 0 and len(data) % ALIGN == 0, "device writes are aligned"
        assert np.frombuffer(data, np.uint8).ctypes.data % ALIGN == 0, "O_DIRECT needs page-aligned memory"
        if self.fail_writes:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        with self._lock:
            self.files[seq][offset : offset + len(data)] = data
            self.writes += 1

    def read(self, seq: int, offset: int, length: int) -> memoryview:
        if self.fail_reads:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        with self._lock:
            return memoryview(bytes(self.files[seq][offset : offset + length]))

    def remove(self, seq: int) -> None:
        with self._lock:
            if self.files.pop(seq, None) is not None and self.space_bytes is not None:
                self.space_bytes += self.segment_bytes

    def sync(self, seq: int) -> None:
        pass

    def note(self, line: str) -> None:
        self.lines.append(line)

    def notes(self) -> list[str]:
        return list(self.lines)

    def close(self) -> None:
        pass
