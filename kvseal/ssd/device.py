"""The SSD tier's device seam: where a segment's bytes live. A device knows capacity and files, nothing of records.

The contract is the Device protocol's (each method's docstring); kvseal.testing.device_checks checks it, and every
implementation runs those checks (tests/test_ssd_device.py): FileDevice here, kvseal.testing.MemoryDevice in memory.
In short: segments of `segment_bytes` are created, written at aligned offsets, read at any offset, listed and
removed; a read past what was ever written returns zeros or fewer bytes, never an error; the tier's notes
(quarantined records, purged namespaces: one line each) are kept across restarts. A device may have `untrusted`
({seq: why}): segment names it found but will not read or write; the tier counts them and never reuses their
numbers.

FileDevice keeps one file per segment in a directory, opened with O_DIRECT where the filesystem supports it (the
page cache would otherwise hold a second copy of what the pool already holds) and buffered where it does not
(tmpfs): `direct` says which, and the tier logs it.

Trust (docs/design.md, the SSD tier). The directory holds every tenant's KV, and its records are believed, so it is
the engine's only if its user owns it and nobody else can write to it: a directory owned by another user, or
writable by group or others, is refused (TierDirectoryError), never adopted, re-owned or chmod-ed; the engine creates
a missing one with mode 0700. The path is walked one component at a time from `/`, each opened with O_NOFOLLOW under
its parent's descriptor: a symlink on it is followed only when root or the engine's user owns it, and every
directory on it must belong to root or that user and be writable by nobody else unless sticky (like /tmp), so that
nobody else can swap the directory after the check. Every file inside is then opened with O_NOFOLLOW relative to the
directory's descriptor, never by a joined path; a segment that is not a regular file of the engine's user with one
link is untrusted (listed, never read or written through). One engine per directory: an exclusive flock on
`kvseal.lock` (holding its pid), released by the kernel when the engine dies, kill -9 included.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import logging
import mmap
import os
import pwd
import re
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvseal.errors import FailedPrecondition

ALIGN = 4096
LOCK_FILE = "kvseal.lock"
NOTES_FILE = "notes.log"
SEGMENT_NAME = re.compile(r"^seg-(\d{8})\.kvs$")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC  # a FIFO or tty under a name: no hang
_MAX_SYMLINKS = 40

log = logging.getLogger("kvseal.ssd")


class Device(Protocol):
    """Segment files of one path. Segments are named by a number (`seq`, > 0) the caller chooses. The caller
    guarantees: a segment it writes, reads or syncs is present (listed or created, not removed); no read or write of
    a segment is in flight while it removes it; every write lies inside the segment; a device is not used once
    closed. Reads, writes and syncs of different segments, and reads of one, may come from several threads at once.
    What was written and synced, and the notes, are there when the same storage is opened again after `close`."""

    segment_bytes: int  # every segment's size: a positive multiple of ALIGN
    max_segments: int  # how many segments the capacity holds (at least 2: one being written, one to reclaim)
    direct: bool  # whether writes bypass the page cache (O_DIRECT): logged by the tier, changes nothing else
    name: str  # for messages and metrics: the path

    def segments(self) -> list[int]:
        """The (trusted) segments present, ascending."""
        ...

    def create(self, seq: int) -> None:
        """Makes a new segment of `segment_bytes` bytes, all zero, that `seq` does not name yet. OSError (ENOSPC...)
        when the space cannot be had now, not at a later write; the segment is then not present."""
        ...

    def write(self, seq: int, offset: int, data: memoryview) -> None:
        """Writes `data` at `offset` of the segment. The caller guarantees that `offset` and len(data) are multiples
        of ALIGN and that `data` lies in page-aligned memory (O_DIRECT needs both); OSError (EIO, ENOSPC...) on
        failure, after which what that range holds is undefined."""
        ...

    def read(self, seq: int, offset: int, length: int) -> memoryview:
        """The bytes [offset, offset + length) of the segment, at any offset and length: fewer only where the
        segment ends (none at or past its end); zeros where nothing was written. The view is valid until the
        calling thread's next read from this device. OSError on failure."""
        ...

    def remove(self, seq: int) -> None:
        """Removes the segment and frees its space; its number is no longer listed. Nothing when it is absent."""
        ...

    def sync(self, seq: int) -> None:
        """Returns once what was written to the segment is durable (a crash keeps it)."""
        ...

    def note(self, line: str) -> None:
        """Appends one line (no newline in it) to the tier's notes, durably. OSError when it cannot."""
        ...

    def notes(self) -> list[str]:
        """Every line noted, in order, across restarts ([] when none; unreadable notes are logged and ignored)."""
        ...

    def close(self) -> None:
        """Releases what the device holds (descriptors, the directory's lock). Idempotent."""
        ...


@dataclass(frozen=True, slots=True)
class DirectorySpace:
    """What a tier directory's filesystem has for the tier, measured at start (FileDevice.space)."""

    filesystem: int  # st_dev: paths that share one add their capacities up against one free space
    held: int  # bytes the engine's own (trusted) segment files there take on the disk
    free: int  # bytes this user may still write there (f_bavail)


class TierDirectoryError(FailedPrecondition, OSError):
    """A tier directory the engine must not use; the message (one line) says why and what to do."""


class TierDirectoryInUse(TierDirectoryError):
    """Another engine holds the directory's lock; `pid` is its pid (0 when it could not be read)."""

    def __init__(self, pid: int, message: str) -> None:
        super().__init__(message)
        self.pid = pid


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


def user_name(uid: int, gid: int | None = None) -> str:
    """'nobody:nogroup (uid 65534)', 'root (uid 0)': who owns something, for messages."""
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = str(uid)
    if gid is not None:
        try:
            name += ":" + grp.getgrgid(gid).gr_name
        except KeyError:
            name += f":{gid}"
    return f"{name} (uid {uid})"


def _root_or(me: int) -> str:
    return "root" if me == 0 else f"root or {user_name(me)}"


def _segment_name(seq: int) -> str:
    return f"seg-{seq:08d}.kvs"


class FileDevice:
    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: int, segment_bytes: int) -> None:
        """Opens (or creates, mode 0700) the tier directory and locks it. TierDirectoryError when it is not the
        engine's own (see the module's doc) or another engine uses it; OSError when it cannot be opened."""
        if segment_bytes % ALIGN or segment_bytes <= 0:
            raise ValueError(f"segment size must be a positive multiple of {ALIGN}, got {segment_bytes}")
        self.dir = Path(directory)
        self.name = str(self.dir)
        self.segment_bytes = segment_bytes
        self.max_segments = capacity_bytes // segment_bytes
        if self.max_segments < 2:
            raise ValueError(
                f"{self.dir}: capacity {capacity_bytes} bytes holds fewer than 2 segments of {segment_bytes} bytes"
            )
        self.readonly = False
        self.owner = os.geteuid()
        self.untrusted: dict[int, str] = {}
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self._buffers = _AlignedBuffers()
        self._lock_fd = -1
        self._dir_fd = open_private_directory(self.name)
        try:
            self._lock_fd = lock_directory(self._dir_fd)
            self.direct = _supports_direct(self._dir_fd)
        except BaseException:
            self.close()
            raise

    @classmethod
    def existing(cls, directory: str | os.PathLike[str]) -> FileDevice:
        """A read-only view of a tier directory (a stopped engine's, for inspection): opens files O_RDONLY, creates
        and changes nothing, takes no lock; the segment size is the files'. The path itself is followed as given
        (an operator's offline read); files in it are trusted only as regular files of the directory's owner."""
        dev = cls.__new__(cls)
        dev.dir = Path(directory)
        dev.name = str(dev.dir)
        dev._fds, dev._lock, dev._buffers = {}, threading.Lock(), _AlignedBuffers()
        dev.direct, dev.readonly = False, True
        dev.untrusted, dev._lock_fd = {}, -1
        try:
            dev._dir_fd = os.open(dev.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            raise FileNotFoundError(f"{dev.dir} is not a directory") from None
        dev.owner = os.fstat(dev._dir_fd).st_uid
        sizes = {os.fstat(dev._fd(seq)).st_size for seq in dev.segments()}
        dev.segment_bytes = max(sizes, default=ALIGN)
        dev.max_segments = len(sizes) + 2
        return dev

    def segments(self) -> list[int]:
        """The trusted segments present (each opened now, under the directory's descriptor); the others go to
        `untrusted`."""
        found = []
        for name in os.listdir(self._dir_fd):
            m = SEGMENT_NAME.match(name)
            if not m:
                continue
            seq = int(m.group(1))
            with self._lock:
                if seq in self._fds:
                    found.append(seq)
                    continue
            why = self._open_segment(seq)
            if why:
                self.untrusted[seq] = why
            else:
                found.append(seq)
        return sorted(found)

    def space(self) -> DirectorySpace:
        """The directory's filesystem, what the trusted segments in it take (allocated blocks: none but files of
        this user in its own locked directory count) and what is free there now."""
        held = sum(os.fstat(self._fd(seq)).st_blocks * 512 for seq in self.segments())
        vfs = os.fstatvfs(self._dir_fd)
        return DirectorySpace(os.fstat(self._dir_fd).st_dev, held, vfs.f_bavail * vfs.f_frsize)

    def resize(self, capacity_bytes: int) -> None:
        """Holds `capacity_bytes` from now on (whole segments, at least 2): before the tier opens, never after."""
        if capacity_bytes // self.segment_bytes < 2:
            raise ValueError(f"{self.dir}: capacity {capacity_bytes} bytes holds fewer than 2 segments")
        self.max_segments = capacity_bytes // self.segment_bytes

    def _open_segment(self, seq: int) -> str:
        """Opens an existing segment file and keeps its descriptor; returns why it is not trusted ('' when it is)."""
        mode = os.O_RDONLY if self.readonly else os.O_RDWR | self._direct_flag()
        try:
            fd = os.open(_segment_name(seq), mode | _FILE_FLAGS, dir_fd=self._dir_fd)
        except OSError as e:
            return "a symlink" if e.errno == errno.ELOOP else f"cannot be opened: {e.strerror}"
        why = _untrusted_file(fd, self.owner)
        if why:
            os.close(fd)
            return why
        os.set_blocking(fd, True)
        with self._lock:
            self._fds[seq] = fd
        return ""

    def create(self, seq: int) -> None:
        name = _segment_name(seq)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | self._direct_flag()
        fd = os.open(name, flags, 0o600, dir_fd=self._dir_fd)
        try:
            os.posix_fallocate(fd, 0, self.segment_bytes)  # ENOSPC now, not in the middle of a batch
        except OSError:
            os.close(fd)
            os.unlink(name, dir_fd=self._dir_fd)
            raise
        with self._lock:
            self._fds[seq] = fd

    def _fd(self, seq: int) -> int:
        with self._lock:
            fd = self._fds.get(seq)
        if fd is not None:
            return fd
        why = self.untrusted.get(seq) or self._open_segment(seq)  # one this device did not list (or distrusted)
        if why:
            raise OSError(errno.EPERM, f"segment {seq} is not trusted: {why}")
        with self._lock:
            return self._fds[seq]

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
            os.unlink(_segment_name(seq), dir_fd=self._dir_fd)  # unlinkat removes the name, never a link's target
        except FileNotFoundError:
            pass

    def sync(self, seq: int) -> None:
        os.fdatasync(self._fd(seq))

    def note(self, line: str) -> None:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | _FILE_FLAGS
        fd = os.open(NOTES_FILE, flags, 0o600, dir_fd=self._dir_fd)
        try:
            why = _untrusted_file(fd, self.owner)
            if why:
                raise OSError(errno.EPERM, f"{NOTES_FILE} is not trusted: {why}")
            data = (line + "\n").encode()
            while data:
                data = data[os.write(fd, data) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    def notes(self) -> list[str]:
        try:
            fd = os.open(NOTES_FILE, os.O_RDONLY | _FILE_FLAGS, dir_fd=self._dir_fd)
        except FileNotFoundError:
            return []
        except OSError as e:
            log.warning("ssd %s: %s cannot be opened (%s): its notes are ignored", self.name, NOTES_FILE, e.strerror)
            return []
        try:
            why = _untrusted_file(fd, self.owner)
            if why:
                log.warning("ssd %s: %s is not trusted (%s): its notes are ignored", self.name, NOTES_FILE, why)
                return []
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            return b"".join(chunks).decode(errors="replace").splitlines()
        finally:
            os.close(fd)

    def close(self) -> None:
        """Closes every descriptor; the directory's lock goes with its file's (idempotent)."""
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
            own, self._lock_fd, self._dir_fd = [self._lock_fd, getattr(self, "_dir_fd", -1)], -1, -1
        for fd in fds + [fd for fd in own if fd >= 0]:
            os.close(fd)


def _untrusted_file(fd: int, owner: int) -> str:
    """Why an opened file is not one the engine may believe or write ('' when it is): a regular file of `owner`
    with one link (a hard link would share another file's bytes)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != owner:
        return f"owned by {user_name(st.st_uid)}, not {user_name(owner)}"
    if st.st_nlink != 1:
        return f"{st.st_nlink} hard links"
    return ""


def open_private_directory(path: str) -> int:
    """A descriptor of the directory at `path` (created mode 0700 where missing, parents too), after checking that
    it is this user's alone and that nobody else can swap it (see the module's doc). TierDirectoryError when it is
    not; OSError (ENOTDIR, EACCES, ELOOP...) when it cannot be reached."""
    me = os.geteuid()
    trusted = (0, me)
    parts = list(reversed(os.path.join(os.getcwd(), path).split("/")))  # the next component last
    stack: list[tuple[str, int]] = [("/", os.open("/", _DIR_FLAGS))]
    links = 0
    try:
        while parts:
            name = parts.pop()
            if name in ("", "."):
                continue
            if name == "..":
                if len(stack) > 1:
                    os.close(stack.pop()[1])
                continue
            where, here = stack[-1]
            _check_on_path(here, where, trusted, me)
            child = os.path.join(where, name)
            try:
                st = os.stat(name, dir_fd=here, follow_symlinks=False)
            except FileNotFoundError:
                try:
                    os.mkdir(name, 0o700, dir_fd=here)
                except FileExistsError:
                    pass  # made meanwhile: look at it again
                else:
                    fd = os.open(name, _DIR_FLAGS, dir_fd=here)
                    try:
                        os.fchmod(fd, 0o700)  # the umask may have taken the owner's bits: one just made is ours
                    finally:
                        os.close(fd)
                parts.append(name)
                continue
            if stat.S_ISLNK(st.st_mode):
                if st.st_uid not in trusted:
                    raise TierDirectoryError(
                        f"{child} on its path is a symlink owned by {user_name(st.st_uid)}: symlinks on it are "
                        f"followed only when {_root_or(me)} owns them: pass the directory it points to"
                    )
                links += 1
                if links > _MAX_SYMLINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
                target = os.readlink(name, dir_fd=here)
                if target.startswith("/"):
                    while len(stack) > 1:
                        os.close(stack.pop()[1])
                parts.extend(reversed(target.split("/")))
                continue
            stack.append((child, os.open(name, _DIR_FLAGS, dir_fd=here)))  # ENOTDIR; ELOOP if swapped for a link
        here = stack[-1][1]
        st = os.fstat(here)
        if st.st_uid != me:
            raise TierDirectoryError(
                f"it is owned by {user_name(st.st_uid, st.st_gid)}, mode {stat.S_IMODE(st.st_mode):04o}, not by "
                f"{user_name(me)}, the user this engine runs as: records another user put there would be served: "
                "remove it (the engine then creates it, mode 0700) or pass a directory of this user that only it "
                "can write"
            )
        if st.st_mode & 0o022:
            who = {0o020: "its group", 0o002: "other users"}.get(st.st_mode & 0o022, "its group and other users")
            raise TierDirectoryError(
                f"its mode {stat.S_IMODE(st.st_mode):04o} lets {who} write to it (owner "
                f"{user_name(st.st_uid, st.st_gid)}): records they put there would be served: chmod 700 it once its "
                "contents are checked, or pass another --ssd-path"
            )
        return os.dup(here)
    finally:
        for _, fd in stack:
            os.close(fd)


def _check_on_path(fd: int, where: str, trusted: tuple[int, int], me: int) -> None:
    """A directory the path goes through: only root or this user may own it, and nobody else may write to it
    unless it is sticky (then nobody else can rename or remove what this user put in it)."""
    st = os.fstat(fd)
    if st.st_uid not in trusted:
        raise TierDirectoryError(
            f"{where} on its path is owned by {user_name(st.st_uid)}, who could swap the directory: pass a path "
            f"whose every directory belongs to {_root_or(me)}"
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise TierDirectoryError(
            f"{where} on its path has mode {stat.S_IMODE(st.st_mode):04o}: other users can write to it without "
            f"the sticky bit, and so swap the directory: pass a path whose every directory only {_root_or(me)} can "
            "write (or that is sticky, like /tmp)"
        )


def lock_directory(dir_fd: int) -> int:
    """Takes the directory's exclusive lock (flock on LOCK_FILE, which then holds this process's pid); returns the
    lock file's descriptor, whose closing (the process's end included) releases it. TierDirectoryInUse naming the
    holder's pid when another engine has it."""
    flags = os.O_RDWR | os.O_CREAT | _FILE_FLAGS
    try:
        fd = os.open(LOCK_FILE, flags, 0o600, dir_fd=dir_fd)
    except OSError as e:
        why = "is a symlink" if e.errno == errno.ELOOP else f"cannot be opened ({e.strerror})"
        raise TierDirectoryError(f"its lock file {LOCK_FILE} {why}: remove it") from None
    try:
        why = _untrusted_file(fd, os.geteuid())
        if why:
            raise TierDirectoryError(f"its lock file {LOCK_FILE} is {why}: remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _holder(fd)
            raise TierDirectoryInUse(
                pid,
                f"another kvseal engine (pid {pid or 'unknown'}) uses it: one engine per directory: stop that "
                "engine or pass another --ssd-path",
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _holder(fd: int, wait_s: float = 1.0) -> int:
    """The pid the lock's holder wrote (it writes it just after locking: wait for it a moment); 0 if none."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return int(os.pread(fd, 32, 0).decode().strip())
        except ValueError:
            if time.monotonic() > deadline:
                return 0
            time.sleep(0.02)  # the holder has the lock but has not written its pid yet


def _supports_direct(dir_fd: int) -> bool:
    probe = ".direct-probe"
    try:
        os.unlink(probe, dir_fd=dir_fd)  # left by an engine that died here (the directory is ours and locked)
    except FileNotFoundError:
        pass
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECT
    try:
        fd = os.open(probe, flags, 0o600, dir_fd=dir_fd)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        try:
            os.unlink(probe, dir_fd=dir_fd)  # some filesystems create it before refusing O_DIRECT
        except FileNotFoundError:
            pass
        return False
    try:
        buf = aligned_buffer(ALIGN)
        os.pwrite(fd, memoryview(buf), 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(probe, dir_fd=dir_fd)
