"""`kvseal bench mooncake [NBYTES]`: Mooncake Transfer Engine's own TCP read between two processes on loopback, the
reference `kvseal bench peer` sets kvseal's peer fetch against, measured in the same run on the same bytes.

A child process (`python -m kvseal.bench.mooncake --serve NBYTES`) maps an arena of NBYTES, fills it, starts a
MooncakeDataPlane on 127.0.0.1 and prints its offer; the parent reads the whole arena with one Mooncake batch of
`page_bytes` pages, `repeats` times, and keeps the best rate. The timed part is Mooncake's own
`batch_transfer_sync_read`, nothing of kvseal's around it.
"""

from __future__ import annotations

import mmap
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvseal.peer.mooncake import MooncakeDataPlane, TransferFailed, decode_offer

_START_TIMEOUT_S = 60.0


def _pattern(arena: np.ndarray) -> None:
    """Fills the arena (touching every page) with bytes the reader can check: MiB k is a fixed random MiB xor k."""
    block = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    for start in range(0, arena.nbytes, block.nbytes):
        end = min(start + block.nbytes, arena.nbytes)
        np.bitwise_xor(block[: end - start], (start >> 20) & 0xFF, out=arena[start:end])


def _serve(nbytes: int) -> None:
    mem = mmap.mmap(-1, nbytes)
    arena = np.frombuffer(mem, dtype=np.uint8)
    _pattern(arena)
    plane = MooncakeDataPlane(arena, "127.0.0.1")
    sys.stdout.write(plane.offer().hex() + "\n")
    sys.stdout.flush()
    sys.stdin.read()  # until the parent closes stdin (or dies)
    os._exit(0)  # skips Mooncake's 1 s teardown; the process is going away


def _read_offer(child: subprocess.Popen[str], deadline: float) -> bytes:
    assert child.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(child.stdout, selectors.EVENT_READ)
    try:
        while time.monotonic() < deadline:
            if sel.select(timeout=max(0.0, deadline - time.monotonic())):
                line = child.stdout.readline()
                if not line:
                    raise RuntimeError(f"the Mooncake bench server exited (status {child.wait()})")
                return bytes.fromhex(line.strip())
    finally:
        sel.close()
    raise RuntimeError(f"the Mooncake bench server did not start within {_START_TIMEOUT_S:g} s")


def mooncake_tcp_read_gbps(nbytes: int, page_bytes: int, repeats: int = 3) -> float:
    """Best rate in GB/s (1e9 bytes/s) of Mooncake's TCP read of `nbytes`, in pages of `page_bytes`, from another
    process on loopback. nbytes must be a positive multiple of page_bytes."""
    if nbytes <= 0 or page_bytes <= 0 or nbytes % page_bytes or repeats < 1:
        raise ValueError("nbytes must be a positive multiple of page_bytes, and repeats at least 1")
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    child = subprocess.Popen(
        [sys.executable, "-m", "kvseal.bench.mooncake", "--serve", str(nbytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        offer = _read_offer(child, time.monotonic() + _START_TIMEOUT_S)
        host, port, remote_base, _ = decode_offer(offer)
        mem = mmap.mmap(-1, nbytes)
        arena = np.frombuffer(mem, dtype=np.uint8)
        arena[:] = 0  # fault every page in before timing
        count = nbytes // page_bytes
        with MooncakeDataPlane(arena, "127.0.0.1") as plane:
            engine = plane._engine
            local = [plane._base + i * page_bytes for i in range(count)]
            remote = [remote_base + i * page_bytes for i in range(count)]
            sizes = [page_bytes] * count
            best = 0.0
            for _ in range(repeats):
                t0 = time.perf_counter()
                rc = engine.batch_transfer_sync_read(f"{host}:{port}", local, remote, sizes)
                dt = time.perf_counter() - t0
                if rc != 0:
                    raise TransferFailed(f"Mooncake bench read failed (rc {rc})")
                best = max(best, nbytes / dt / 1e9)
            expected = np.empty(nbytes, dtype=np.uint8)
            _pattern(expected)
            if not np.array_equal(arena, expected):
                raise TransferFailed("Mooncake bench read returned wrong bytes")
        return best
    finally:
        if child.stdin:
            child.stdin.close()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        if child.stdout:
            child.stdout.close()


def main(nbytes: int = 256 << 20) -> int:
    """Prints the rate of reading `nbytes` in one page, in 2 MiB pages and in 128 KiB pages (those that divide it)."""
    for page in (nbytes, 2 << 20, 128 << 10):
        if nbytes % page == 0:
            print(f"{nbytes} bytes in {page}-byte pages: {mooncake_tcp_read_gbps(nbytes, page):.2f} GB/s")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        _serve(int(sys.argv[2]))
    else:
        sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 256 << 20))
