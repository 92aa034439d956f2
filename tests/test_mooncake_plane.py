"""MooncakeDataPlane between real processes: a child process serves its arena with Mooncake Transfer Engine (TCP),
this process reads pages of it. Byte-exact batches, bad offers, a serving process SIGKILLed before and during a
read, one that stops answering (SIGSTOP), and the one-line install hints."""

from __future__ import annotations

import importlib.abc
import mmap
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvseal.bench.mooncake import mooncake_tcp_read_gbps
from kvseal.peer import mooncake as mc
from kvseal.peer.mooncake import MooncakeDataPlane, MooncakeUnavailable, TransferFailed

REPO = Path(__file__).resolve().parent.parent
ARENA = 16 << 20
MiB2 = 2 << 20
START_TIMEOUT_S = 30.0

# the serving node: an arena of random bytes (seeded), its plane's offer on stdout, serving until stdin closes
SERVER = """
import mmap, os, sys
import numpy as np
from kvseal.peer.mooncake import MooncakeDataPlane
size, seed = int(sys.argv[1]), int(sys.argv[2])
mem = mmap.mmap(-1, size)
arena = np.frombuffer(mem, dtype=np.uint8)
arena[:] = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
plane = MooncakeDataPlane(arena, "127.0.0.1")
print(plane.offer().hex(), flush=True)
sys.stdin.read()
os._exit(0)
"""


def content(seed: int, size: int = ARENA) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


class Server:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(ARENA), str(seed)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.offer = self._read_offer()

    def _read_offer(self) -> bytes:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if sel.select(timeout=deadline - time.monotonic()):
                    line = self.proc.stdout.readline()
                    assert line, f"the serving process exited with status {self.proc.wait()}"
                    return bytes.fromhex(line.strip())
        pytest.fail(f"the serving process printed no offer within {START_TIMEOUT_S}s")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe:
                pipe.close()


@pytest.fixture
def server() -> Iterator[Callable[[int], Server]]:
    started: list[Server] = []

    def start(seed: int) -> Server:
        s = Server(seed)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def local() -> Iterator[tuple[MooncakeDataPlane, np.ndarray]]:
    mem = mmap.mmap(-1, ARENA)
    arena = np.frombuffer(mem, dtype=np.uint8)
    plane = MooncakeDataPlane(arena, "127.0.0.1")
    yield plane, arena
    plane.close()


def test_batch_read_is_byte_exact(local: tuple[MooncakeDataPlane, np.ndarray], server: Callable[[int], Server]) -> None:
    plane, arena = local
    srv = server(11)
    expected = content(11)
    rng = np.random.default_rng(5)
    lengths = [MiB2] * 4 + [1, 3, 4097, 65537, 123457, MiB2 + 1, MiB2 - 1]
    rng.shuffle(lengths)
    remote = [int(rng.integers(0, ARENA - n + 1)) for n in lengths]  # anywhere, unaligned, may overlap
    local_offsets, at = [], 17
    for n in lengths:  # disjoint, unaligned, with gaps that must stay untouched
        local_offsets.append(at)
        at += n + int(rng.integers(1, 5000))
    assert at < ARENA
    arena[:] = 0xA5
    plane.receive(srv.offer, remote, local_offsets, [int(n) for n in lengths], timeout_s=5)
    mask = np.zeros(ARENA, dtype=bool)
    for r, lo, n in zip(remote, local_offsets, lengths, strict=True):
        assert np.array_equal(arena[lo : lo + n], expected[r : r + n])
        mask[lo : lo + n] = True
    assert (arena[~mask] == 0xA5).all()

    # many small pages in one batch, into a permutation of slots
    count, page = 1500, 4096
    remote = (rng.permutation(ARENA // page)[:count] * page).tolist()
    local_offsets = (rng.permutation(ARENA // page)[:count] * page).tolist()
    plane.receive(srv.offer, remote, local_offsets, [page] * count, timeout_s=5)
    for r, lo in zip(remote, local_offsets, strict=True):
        assert np.array_equal(arena[lo : lo + page], expected[r : r + page])

    plane.receive(srv.offer, [], [], [], timeout_s=1)  # nothing to read


def test_bad_offers_fail(local: tuple[MooncakeDataPlane, np.ndarray], server: Callable[[int], Server]) -> None:
    plane, _ = local
    srv = server(12)
    host, port, base, size = mc.decode_offer(srv.offer)
    assert (host, size) == ("127.0.0.1", ARENA)
    for bad in (b"", b"garbage", b"XXXX" + srv.offer[4:], srv.offer[:-1], srv.offer + b"x"):
        with pytest.raises(TransferFailed, match="offer"):
            plane.receive(bad, [0], [0], [4096], timeout_s=2)

    with socket_nobody_listens_on() as dead_port:
        t0 = time.monotonic()
        with pytest.raises(TransferFailed) as e:
            plane.receive(mc.encode_offer(host, dead_port, base, size), [0], [0], [4096], timeout_s=2)
        assert time.monotonic() - t0 < 2 and not e.value.pending

    # the server refuses ranges outside the memory it registered (a lying or stale offer)
    with pytest.raises(TransferFailed):
        plane.receive(mc.encode_offer(host, port, base - 8192, size + 8192), [0], [0], [4096], timeout_s=2)
    # ranges outside the offered arena never leave this node
    with pytest.raises(TransferFailed, match="outside the peer"):
        plane.receive(srv.offer, [ARENA - 10], [0], [11], timeout_s=2)
    with pytest.raises(TransferFailed, match="negative"):
        plane.receive(srv.offer, [-1], [0], [10], timeout_s=2)
    # ... and neither do local ones: Mooncake itself would write wherever it is told
    with pytest.raises(ValueError, match="local range"):
        plane.receive(srv.offer, [0], [ARENA - 10], [11], timeout_s=2)
    with pytest.raises(ValueError):
        plane.receive(srv.offer, [0, 1], [0], [1], timeout_s=2)
    plane.receive(srv.offer, [0], [0], [4096], timeout_s=2)  # the good offer still works


class socket_nobody_listens_on:
    """A loopback port held bound but not listening, so connecting to it is refused."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


def test_server_killed_during_and_before_a_read(
    local: tuple[MooncakeDataPlane, np.ndarray], server: Callable[[int], Server]
) -> None:
    plane, arena = local
    srv = server(13)
    expected = content(13)
    whole = (list(range(0, ARENA, MiB2)), list(range(0, ARENA, MiB2)), [MiB2] * (ARENA // MiB2))
    plane.receive(srv.offer, *whole, timeout_s=5)
    assert np.array_equal(arena, expected)

    killer = threading.Thread(target=srv.kill)
    killer.start()  # races the reads below: the first to start after the kill fails, whichever it is
    deadline = time.monotonic() + 10
    while True:
        t0 = time.monotonic()
        try:
            plane.receive(srv.offer, *whole, timeout_s=3)
        except TransferFailed as e:
            assert time.monotonic() - t0 < 3 and not e.pending
            break
        assert time.monotonic() < deadline, "reads from a SIGKILLed server kept succeeding"
    killer.join()
    t0 = time.monotonic()  # and a read after it, with the peer long gone
    with pytest.raises(TransferFailed, match="failed"):
        plane.receive(srv.offer, [0], [0], [4096], timeout_s=3)
    assert time.monotonic() - t0 < 3


def test_server_that_stops_answering_times_out(
    local: tuple[MooncakeDataPlane, np.ndarray], server: Callable[[int], Server]
) -> None:
    plane, _ = local
    srv = server(14)
    plane.receive(srv.offer, [0], [0], [4096], timeout_s=5)
    srv.proc.send_signal(signal.SIGSTOP)  # alive, sockets open, never answers: Mooncake alone would wait 10 s
    t0 = time.monotonic()
    with pytest.raises(TransferFailed, match="did not finish within 0.5 s") as e:
        plane.receive(srv.offer, [0, MiB2], [0, MiB2], [MiB2, MiB2], timeout_s=0.5)
    assert 0.5 <= time.monotonic() - t0 < 1.5
    assert e.value.pending and isinstance(e.value, OSError)
    assert not plane.wait_settled(0.05)  # the library call still runs
    srv.kill()  # its sockets reset: the call ends
    assert plane.wait_settled(5)


def test_close(server: Callable[[int], Server]) -> None:
    mem = mmap.mmap(-1, 1 << 20)
    arena = np.frombuffer(mem, dtype=np.uint8)
    srv = server(15)
    plane = MooncakeDataPlane(arena, "127.0.0.1")
    assert plane.endpoint.startswith("127.0.0.1:") and plane.name == "mooncake" and plane.pulls
    plane.receive(srv.offer, [100], [0], [1000], timeout_s=5)
    assert np.array_equal(arena[:1000], content(15)[100:1100])
    plane.close()
    plane.close()
    with pytest.raises(TransferFailed, match="closed"):
        plane.receive(srv.offer, [0], [0], [8], timeout_s=1)
    with pytest.raises(RuntimeError):
        plane.offer()
    with pytest.raises(ValueError):
        MooncakeDataPlane(arena, "127.0.0.1:5000")
    with pytest.raises(ValueError):
        MooncakeDataPlane(np.zeros(10, dtype=np.int32), "127.0.0.1")  # type: ignore[arg-type]


class _Refuse(importlib.abc.MetaPathFinder):
    def __init__(self, message: str) -> None:
        self.message = message

    def find_spec(self, name: str, path: object, target: object = None) -> None:
        if name == "mooncake.engine":
            raise ImportError(self.message)
        return None


@pytest.mark.parametrize(
    ("error", "hint"),
    [
        ("No module named 'mooncake'", "pip install 'mooncake-transfer-engine-non-cuda==0.3.13.post1'"),
        ("libibverbs.so.1: cannot open shared object file: No such file or directory", "apt-get install libibverbs1"),
    ],
)
def test_missing_dependency_says_what_to_install(monkeypatch: pytest.MonkeyPatch, error: str, hint: str) -> None:
    monkeypatch.delitem(sys.modules, "mooncake.engine", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_Refuse(error), *sys.meta_path])
    with pytest.raises(MooncakeUnavailable) as e:
        MooncakeDataPlane(np.zeros(4096, dtype=np.uint8), "127.0.0.1")
    assert hint in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, RuntimeError)


def test_bench_reads_between_two_processes() -> None:
    assert mooncake_tcp_read_gbps(8 << 20, MiB2, repeats=1) > 0
