"""The Mooncake Transfer Engine data plane: the fetcher reads the serving node's arena with Mooncake, so a cluster
with RDMA NICs moves pages with RDMA; kvseal runs it over Mooncake's TCP protocol, which works everywhere.

Needs the PyPI package `mooncake-transfer-engine-non-cuda==0.3.13.post1` (`pip install 'kvseal[mooncake]'`) and
Debian's `libibverbs1`; `mooncake` is imported only when a MooncakeDataPlane is made, so the rest of kvseal runs
without it.

What Mooncake 0.3.13.post1 does, found by experiment (kvseal relies on each):

- Addressing. `initialize(host, "P2PHANDSHAKE", "tcp", "")` needs no metadata server: the engine listens for the
  handshake on a port of its own choosing (a port in `host` is ignored; `get_rpc_port()` tells it) and peers name
  it `host:rpc_port`. `host` is an IPv4 address or a hostname; an IPv6 literal does not work.
- Exposure. The handshake port and the TCP data port listen on ALL interfaces (0.0.0.0 and [::]), whatever
  `host` says, and have no authentication: any process that can connect can read AND write every byte of a
  registered buffer (the whole arena here) with a 24-byte request. The server refuses ranges outside registered
  buffers, and that is all. kvseal's own control plane authenticates peers; Mooncake's data port does not, so run
  this plane only on a network where every host that can reach the node is trusted, or firewall the ports
  (Mooncake picks them in 15000-17000 by default).
- The local side is not checked: Mooncake writes wherever the local address says, registered or not, so
  `receive` checks every local range against the arena itself.
- A peer that dies (SIGKILL: the kernel resets its sockets) fails the call with rc -1 within milliseconds, before
  or during a transfer. A peer that stops answering without closing (SIGSTOP, a dead host, a partition) blocks the
  call until Mooncake's progress timeout, `MC_TCP_PROGRESS_TIMEOUT_SEC` / `MC_TCP_STATUS_TIMEOUT_SEC` (30 s by
  default; this module sets both to 10 unless they are set). `receive` therefore runs the call on a worker thread
  and gives up waiting after `timeout_s` (see TransferFailed.pending).
- Logging is glog on stderr, INFO by default (about 10 lines per engine start). `MC_LOG_LEVEL` (INFO, WARNING or
  ERROR), read when `mooncake` is first imported, sets the level; this module sets ERROR unless it is set, and
  silences the one spurious error every start logs ("Local segment descriptor not found") by raising glog's
  minimum level to FATAL around the start when MC_LOG_LEVEL was not set. Errors of later transfers still log.
- Dropping a TransferEngine takes about 1 s (holding the GIL): `close` costs that.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import os
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kvseal.errors import Unavailable

PACKAGE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
INSTALL_PACKAGE = f"pip install '{PACKAGE}' (or pip install 'kvseal[mooncake]')"
INSTALL_VERBS = "apt-get install libibverbs1 (Debian's libibverbs.so.1, which Mooncake links against)"

# offer: magic | u64 arena base address | u64 arena size | u16 rpc port | u8 host length | host (ASCII)
_OFFER = struct.Struct("<4sQQHB")
_OFFER_MAGIC = b"KVM1"
_MAX_HOST = 255

_ENV_DEFAULTS = {"MC_LOG_LEVEL": "ERROR", "MC_TCP_PROGRESS_TIMEOUT_SEC": "10", "MC_TCP_STATUS_TIMEOUT_SEC": "10"}
# close() waits this long for reads that outlived their timeout (they end by Mooncake's progress timeout)
_CLOSE_WAIT_S = 15.0


class MooncakeUnavailable(Unavailable, RuntimeError):
    """Mooncake cannot run here: the package or libibverbs1 is missing, or its engine would not start."""


class TransferFailed(Unavailable, OSError):
    """A Mooncake read failed or did not finish within its timeout.

    `pending` is True when the library call is still running (the receive timed out): until it ends, which
    Mooncake's progress timeout bounds (MC_TCP_PROGRESS_TIMEOUT_SEC, 10 s here), it may still write into the
    destination pages, so keep them out of use until `MooncakeDataPlane.wait_settled()` says so (close() waits too).
    """

    def __init__(self, message: str, *, pending: bool = False, code: int = errno.EIO) -> None:
        super().__init__(code, message)
        self.pending = pending

    def __str__(self) -> str:
        return str(self.strerror)


_own_log_level: bool | None = None  # whether kvseal chose MC_LOG_LEVEL (decided at the first import)


def _import_engine() -> tuple[Any, bool]:
    """(TransferEngine class, whether kvseal chose the log level) after setting the environment's defaults."""
    global _own_log_level
    if _own_log_level is None:
        _own_log_level = "MC_LOG_LEVEL" not in os.environ
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        if "libibverbs" in str(e):
            raise MooncakeUnavailable(f"Mooncake needs libibverbs.so.1: {INSTALL_VERBS}") from e
        raise MooncakeUnavailable(f"Mooncake Transfer Engine is not installed: {INSTALL_PACKAGE}") from e
    return TransferEngine, _own_log_level


def missing() -> str | None:
    """Why Mooncake Transfer Engine cannot run here (its package or libibverbs1 missing), or None when it can."""
    try:
        _import_engine()
    except MooncakeUnavailable as e:
        return str(e)
    return None


def _glog_min_level() -> ctypes.c_int32 | None:
    """glog's FLAGS_minloglevel in the copy of glog bundled with the mooncake wheel, or None where not found."""
    try:
        import mooncake

        site = os.path.dirname(os.path.dirname(os.path.abspath(mooncake.__file__)))
        for path in sorted(glob.glob(os.path.join(site, "mooncake_transfer_engine*.libs", "libglog*.so*"))):
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
            return ctypes.c_int32.in_dll(lib, "_ZN3fLI17FLAGS_minloglevelE")
    except (ImportError, OSError, ValueError):
        pass
    return None


@contextlib.contextmanager
def _quiet_glog(enabled: bool) -> Iterator[None]:
    flag = _glog_min_level() if enabled else None
    if flag is None:
        yield
        return
    saved = flag.value
    flag.value = 3  # FATAL only
    try:
        yield
    finally:
        flag.value = saved


def encode_offer(host: str, rpc_port: int, base: int, size: int) -> bytes:
    raw = host.encode("ascii")
    if not raw or len(raw) > _MAX_HOST:
        raise ValueError(f"host must be 1 to {_MAX_HOST} ASCII characters")
    return _OFFER.pack(_OFFER_MAGIC, base, size, rpc_port, len(raw)) + raw


def decode_offer(remote: bytes) -> tuple[str, int, int, int]:
    """(host, rpc_port, base, size) of an offer; TransferFailed when it is not one."""
    remote = bytes(remote)
    if len(remote) < _OFFER.size:
        raise TransferFailed(f"not a Mooncake offer: {len(remote)} bytes, at least {_OFFER.size}", code=errno.EPROTO)
    magic, base, size, port, n = _OFFER.unpack_from(remote)
    raw = remote[_OFFER.size :]
    if magic != _OFFER_MAGIC:
        raise TransferFailed(f"not a Mooncake offer: magic {magic!r}", code=errno.EPROTO)
    if n == 0 or len(raw) != n or port == 0 or size == 0 or base == 0:
        raise TransferFailed("malformed Mooncake offer", code=errno.EPROTO)
    try:
        host = raw.decode("ascii")
    except UnicodeDecodeError:
        raise TransferFailed("malformed Mooncake offer: host is not ASCII", code=errno.EPROTO) from None
    if ":" in host or not host.isprintable():
        raise TransferFailed(f"malformed Mooncake offer: host {host!r}", code=errno.EPROTO)
    return host, port, base, size


def _ranges(offsets: Sequence[int], lengths: np.ndarray, what: str) -> np.ndarray:
    try:
        arr = np.asarray(offsets, dtype=np.int64)
    except (OverflowError, TypeError, ValueError):
        raise ValueError(f"{what} offsets must be integers below 2**63") from None
    if arr.shape != lengths.shape:
        raise ValueError(f"{len(arr)} {what} offsets for {len(lengths)} lengths")
    return arr


class MooncakeDataPlane:
    """Pull plane: the fetcher reads the serving node's arena with Mooncake; the server keeps the pages pinned until
    the fetcher says DONE. One Mooncake TransferEngine per plane, with the whole arena registered."""

    name = "mooncake"
    # the fetcher reads the serving node's memory: the server keeps pages pinned until the fetcher says DONE
    pulls = True

    def __init__(self, arena: np.ndarray, host: str) -> None:
        """Starts a Mooncake TransferEngine on `host` (P2PHANDSHAKE, tcp) and registers the whole arena.
        MooncakeUnavailable (one line saying what to install) when the package or libibverbs1 is missing, or when the
        engine does not start."""
        if not isinstance(arena, np.ndarray) or arena.dtype != np.uint8 or arena.ndim != 1:
            raise ValueError("arena must be a 1-D numpy uint8 array")
        if not arena.flags.c_contiguous or not arena.flags.writeable or arena.nbytes == 0:
            raise ValueError("arena must be contiguous, writable and not empty")
        if (
            not isinstance(host, str)
            or not host.isascii()
            or not host.isprintable()
            or ":" in host
            or not (0 < len(host) <= _MAX_HOST)
        ):
            raise ValueError("host must be an IPv4 address or a hostname, without a port (Mooncake picks its own)")
        transfer_engine, own_log_level = _import_engine()
        self._arena = arena
        self._base = int(arena.ctypes.data)
        self._size = int(arena.nbytes)
        self._host = host
        self._lock = threading.Lock()
        self._pending: set[threading.Thread] = set()
        self._closed = False
        engine = transfer_engine()
        with _quiet_glog(own_log_level):
            rc = engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
            if rc != 0:
                raise MooncakeUnavailable(f"Mooncake Transfer Engine would not start on {host!r} (rc {rc})")
            rc = engine.register_memory(self._base, self._size)
            if rc != 0:
                raise MooncakeUnavailable(f"Mooncake would not register the {self._size}-byte arena (rc {rc})")
        self._engine: Any = engine
        self._port = int(engine.get_rpc_port())
        self._offer = encode_offer(host, self._port, self._base, self._size)

    @property
    def endpoint(self) -> str:
        """This engine's Mooncake segment name, host:rpc_port."""
        return f"{self._host}:{self._port}"

    def offer(self) -> bytes:
        """What a fetcher needs to read this node's arena: Mooncake endpoint (host:rpc_port), arena base and size."""
        if self._closed:
            raise RuntimeError("the Mooncake data plane is closed")
        return self._offer

    def receive(
        self,
        remote: bytes,
        remote_offsets: list[int],
        local_offsets: list[int],
        lengths: list[int],
        timeout_s: float,
    ) -> None:
        """Reads each remote page (remote arena base + remote_offsets[i], lengths[i]) into this node's arena at
        local_offsets[i], in one Mooncake batch.

        TransferFailed on any failure of the transfer: a bad offer, a remote range outside the offered arena, a
        peer that is gone or refuses the range, or no answer within `timeout_s`. The call runs on a worker thread;
        after a timeout it goes on until Mooncake gives up (e.pending is True, see TransferFailed). ValueError for
        arguments that are this node's own mistake (local ranges outside the arena, mismatched lists)."""
        host, port, remote_base, remote_size = decode_offer(remote)
        if not timeout_s > 0:
            raise ValueError("timeout_s must be positive")
        try:
            lens = np.asarray(lengths, dtype=np.int64)
        except (OverflowError, TypeError, ValueError):
            raise ValueError("lengths must be integers below 2**63") from None
        if lens.ndim != 1:
            raise ValueError("lengths must be a flat list")
        local = _ranges(local_offsets, lens, "local")
        rem = _ranges(remote_offsets, lens, "remote")
        if len(lens) and min(lens.min(), local.min()) < 0:
            raise ValueError("local offsets and lengths must not be negative")
        if len(lens) and rem.min() < 0:
            raise TransferFailed("a remote offset is negative", code=errno.EINVAL)
        ulens = lens.astype(np.uint64)  # each term < 2**63: the sums below cannot wrap
        if len(lens) and (local.astype(np.uint64) + ulens).max() > self._size:
            raise ValueError(f"a local range falls outside this node's {self._size}-byte arena")
        if len(lens) and (rem.astype(np.uint64) + ulens).max() > remote_size:
            raise TransferFailed(f"a remote range falls outside the peer's {remote_size}-byte arena", code=errno.EINVAL)
        keep = lens > 0
        if not keep.all():
            lens, local, rem = lens[keep], local[keep], rem[keep]
        if len(lens) == 0:
            return
        target = f"{host}:{port}"
        local_addrs = [self._base + x for x in local.tolist()]
        remote_addrs = [remote_base + x for x in rem.tolist()]
        sizes = lens.tolist()
        outcome: list[Any] = []

        def read(engine: Any, _arena: np.ndarray) -> None:  # holding the arena keeps it mapped while the call runs
            try:
                outcome.append(engine.batch_transfer_sync_read(target, local_addrs, remote_addrs, sizes))
            except BaseException as e:  # handed to the caller's thread
                outcome.append(e)
            finally:
                with self._lock:
                    self._pending.discard(worker)

        with self._lock:  # close() sees every read that got past this check
            if self._closed:
                raise TransferFailed("the Mooncake data plane is closed", code=errno.EBADF)
            worker = threading.Thread(
                target=read, args=(self._engine, self._arena), name="kvseal-mooncake-read", daemon=True
            )
            self._pending.add(worker)
        try:
            worker.start()
        except RuntimeError as e:  # no thread to be had
            with self._lock:
                self._pending.discard(worker)
            raise TransferFailed(f"cannot start a Mooncake read: {e}") from e
        worker.join(timeout_s)
        total = int(lens.sum())
        what = f"Mooncake read of {len(sizes)} pages ({total} bytes) from {target}"
        if worker.is_alive():
            raise TransferFailed(
                f"{what} did not finish within {timeout_s:g} s (the peer stopped answering); the call goes on until "
                f"Mooncake's progress timeout and may still write the destination pages",
                pending=True,
                code=errno.ETIMEDOUT,
            )
        result = outcome[0]
        if isinstance(result, BaseException):
            raise TransferFailed(f"{what} failed: {result}") from result
        if result != 0:
            raise TransferFailed(
                f"{what} failed (rc {result}): the peer is gone, refused the range, or the network failed",
                code=errno.ECONNABORTED,
            )

    def wait_settled(self, timeout_s: float) -> bool:
        """Waits for reads that outlived their receive's timeout; True once none is running."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                threads = list(self._pending)
            if not threads:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            threads[0].join(left)

    def close(self) -> None:
        """Unregisters the arena and stops the engine (about 1 s: Mooncake's teardown). Reads still running after a
        timeout are waited for first (Mooncake ends them within its progress timeout); if one still runs after
        that, the engine is left to it and stops when it ends, keeping the arena mapped until then."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        settled = self.wait_settled(_CLOSE_WAIT_S)
        engine, self._engine = self._engine, None
        if settled:
            engine.unregister_memory(self._base)
            self._arena = None  # type: ignore[assignment]
        del engine

    def __enter__(self) -> MooncakeDataPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
