"""The SSD tier's device seam: where a segment's bytes live. A device knows capacity and files, nothing of records.

An implementation must: create a segment of `segment_bytes` (raising OSError, e.g. ENOSPC, if the space cannot be
had), write and read at byte offsets inside it, list the segments present, and remove one. Writes are given
aligned offsets and lengths (multiples of ALIGN); reads may be unaligned (the device widens them). A read past what
was ever written returns zeros or fewer bytes, never an error. The caller guarantees that no read or write of a
segment is in flight when it removes it. A device also keeps the tier's notes (quarantined records, purged
namespaces: one line each) across restarts. kvseal.testing.MemoryDevice is the in-memory one.

FileDevice keeps one file per segment in a directory, opened with O_DIRECT where the filesystem supports it (the
page cache would otherwise hold a second copy of what the pool already holds) and buffered where it does not
(tmpfs): `direct` says which, and the tier logs it.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import threading
from pathlib import Path
from typing import Protocol

ALIGN = 4096
_SEGMENT_NAME = re.compile(r"^seg-(\d{8})\.kvs$")


class Device(Protocol):
    segment_bytes: int
    max_segments: int
    direct: bool
    name: str

    def segments(self) -> list[int]: ...

    def create(self, seq: int) -> None: ...

    def write(self, seq: int, offset: int, data: memoryview) -> None: ...

    def read(self, seq: int, offset: int, length: int) -> memoryview: ...

    def remove(self, seq: int) -> None: ...

    def sync(self, seq: int) -> None: ...

    def note(self, line: str) -> None: ...

    def notes(self) -> list[str]: ...

    def close(self) -> None: ...


class _AlignedBuffers(threading.local):
    """One page-aligned read buffer per thread, grown on demand (O_DIRECT needs aligned memory)."""

    def get(self, n: int) -> mmap.mmap:
        buf: mmap.mmap | None = getattr(self, "buf", None)
        if buf is None or len(buf) < n:
            if buf is not None:
                buf.close()
            buf = self.buf = mmap.mmap(-1, max(n, 1 << 20))
        return buf


def aligned_buffer(n: int) -> mmap.mmap:
    """Fresh page-aligned memory of at least n bytes (anonymous mmap), for writes built in place."""
    return mmap.mmap(-1, max(-(-n // ALIGN) * ALIGN, ALIGN))


class FileDevice:
    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: int, segment_bytes: int) -> None:
        if segment_bytes % ALIGN or segment_bytes <= 0:
            raise ValueError(f"segment size must be a positive multiple of {ALIGN}, got {segment_bytes}")
        self.dir = Path(directory)
        self.name = str(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)  # other tenants' KV: the engine's user only
        self.segment_bytes = segment_bytes
        self.max_segments = capacity_bytes // segment_bytes
        if self.max_segments < 2:
            raise ValueError(
                f"{self.dir}: capacity {capacity_bytes} bytes holds fewer than 2 segments of {segment_bytes} bytes"
            )
        self.direct = _supports_direct(self.dir)
        self.readonly = False
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self._buffers = _AlignedBuffers()

    @classmethod
    def existing(cls, directory: str | os.PathLike[str]) -> FileDevice:
        """A read-only view of a tier directory (a stopped engine's, for inspection): opens files O_RDONLY, creates
        and changes nothing; the segment size is the files'."""
        dev = cls.__new__(cls)
        dev.dir = Path(directory)
        dev.name = str(dev.dir)
        if not dev.dir.is_dir():
            raise FileNotFoundError(f"{dev.dir} is not a directory")
        dev._fds, dev._lock, dev._buffers = {}, threading.Lock(), _AlignedBuffers()
        dev.direct, dev.readonly = False, True
        sizes = {os.stat(dev.path(seq)).st_size for seq in dev.segments()}
        dev.segment_bytes = max(sizes, default=ALIGN)
        dev.max_segments = len(sizes) + 2
        return dev

    def path(self, seq: int) -> Path:
        return self.dir / f"seg-{seq:08d}.kvs"

    def segments(self) -> list[int]:
        return sorted(int(m.group(1)) for p in self.dir.iterdir() if (m := _SEGMENT_NAME.match(p.name)))

    def create(self, seq: int) -> None:
        fd = os.open(self.path(seq), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | self._direct_flag(), 0o600)
        try:
            os.posix_fallocate(fd, 0, self.segment_bytes)  # ENOSPC now, not in the middle of a batch
        except OSError:
            os.close(fd)
            os.unlink(self.path(seq))
            raise
        with self._lock:
            self._fds[seq] = fd

    def _fd(self, seq: int) -> int:
        with self._lock:
            fd = self._fds.get(seq)
            if fd is None:
                mode = os.O_RDONLY if self.readonly else os.O_RDWR | self._direct_flag()
                fd = self._fds[seq] = os.open(self.path(seq), mode | os.O_CLOEXEC)
            return fd

    def _direct_flag(self) -> int:
        return os.O_DIRECT if self.direct else 0

    def write(self, seq: int, offset: int, data: memoryview) -> None:
        assert offset % ALIGN == 0 and len(data) % ALIGN == 0, "device writes are aligned"
        fd = self._fd(seq)
        done = 0
        while done < len(data):
            done += os.pwrite(fd, data[done:], offset + done)

    def read(self, seq: int, offset: int, length: int) -> memoryview:
        """The bytes [offset, offset + length) of a segment (fewer at its end), valid until this thread reads
        again."""
        start = offset // ALIGN * ALIGN
        end = min(-(-(offset + length) // ALIGN) * ALIGN, self.segment_bytes)
        buf = self._buffers.get(end - start)
        view = memoryview(buf)
        got = os.preadv(self._fd(seq), [view[: end - start]], start)
        return view[offset - start : min(offset - start + length, got)]

    def remove(self, seq: int) -> None:
        with self._lock:
            fd = self._fds.pop(seq, None)
        if fd is not None:
            os.close(fd)
        try:
            os.unlink(self.path(seq))
        except FileNotFoundError:
            pass

    def sync(self, seq: int) -> None:
        os.fdatasync(self._fd(seq))

    def note(self, line: str) -> None:
        with open(self.dir / "notes.log", "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def notes(self) -> list[str]:
        try:
            return (self.dir / "notes.log").read_text().splitlines()
        except FileNotFoundError:
            return []

    def close(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)


def _supports_direct(directory: Path) -> bool:
    probe = directory / ".direct-probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_DIRECT, 0o600)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    try:
        buf = aligned_buffer(ALIGN)
        os.pwrite(fd, memoryview(buf), 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(probe)
