"""What the benchmarks share (kvseal.bench.engine, ssd, peer, cuda, vllm_ttft, pd): a `kvseal serve` subprocess
started the way they all start it, a worker's KV memory in a sealed memfd registered through the local lane, fresh
block hashes, the memcpy ceiling, the CPU that others took while a benchmark ran, and how sizes, counts and the CPU
are written in their reports."""

from __future__ import annotations

import os
import platform
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvseal.client import EngineClient
from kvseal.copy.kernel import kernel
from kvseal.memfd import SharedArray
from kvseal.testing.process import EngineProcess
from kvseal.testing.worker import register_one_rank

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
LAYOUT_TAG = "bench.cpu"


# ------------------------------------------------------------------------------------------ engine process


BENCH_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
START_TIMEOUT_S = 120.0  # a pool of GiBs is pre-faulted before the engine serves


def start_engine(
    workdir: Path,
    name: str,
    pool_bytes: int | str,
    extra: Sequence[str] = (),
    listen: str | None = None,
    wrapper: Sequence[str] = (),
    python: str = sys.executable,
    cwd: Path | None = None,
) -> EngineProcess:
    """`python -m kvseal serve` as the benchmarks run it: free loopback ports unless `listen` says, the engine's
    own slab size, --log-level WARNING (extra may say otherwise), one thread for numpy, stdout and stderr in
    workdir/NAME.log, run by `python` in `cwd` (another environment's engine: kvseal.bench.baseline). Returns at once;
    wait_ready(START_TIMEOUT_S) waits for it."""
    return EngineProcess(
        workdir,
        extra,
        listen,
        wrapper,
        name=name,
        pool_size=pool_bytes,
        slab_size=None,
        log_level="WARNING",
        env=BENCH_ENV if cwd is None else {**BENCH_ENV, "PYTHONPATH": ""},  # another environment's: its own kvseal
        merge_output=True,
        python=python,
        cwd=cwd,
    )


# ------------------------------------------------------------------------------------------ worker side


class Hashes:
    """Fresh 32-byte block hashes: a random 16-byte run prefix and a counter."""

    def __init__(self) -> None:
        self._prefix = os.urandom(16)
        self._next = 0

    def take(self, n: int) -> list[bytes]:
        start, self._next = self._next, self._next + n
        p = self._prefix
        return [p + i.to_bytes(16, "big") for i in range(start, start + n)]


class SharedKV:
    """A worker's KV allocation in one sealed memfd: [layers, num_blocks, words] of 8-byte words (the bytes of bf16
    [kv_heads, block_size, 2*head_dim] blocks), filled with a random pattern with each (layer, block)'s first and
    last word made unique, so a misplaced block or layer shows in the round-trip check. `layer(i)` is layer i's
    [num_blocks, words] view, which is what gets registered."""

    def __init__(self, layers: int, num_blocks: int, block_bytes: int, rng: np.random.Generator) -> None:
        self.shared = SharedArray((layers, num_blocks, block_bytes // 8), np.int64)
        self.words = self.shared.array
        self.words[...] = rng.integers(-(1 << 62), 1 << 62, size=self.words.shape[2], dtype=np.int64)
        ids = np.arange(layers * num_blocks, dtype=np.int64).reshape(layers, num_blocks)
        self.words[:, :, 0] = ids
        self.words[:, :, -1] = ids * 7919 + 1

    def layer(self, i: int) -> np.ndarray:
        return self.words[i]

    def close(self) -> None:
        self.shared.close()


@dataclass
class Worker:
    key: tuple[str, int, int]
    namespace_final: str
    page_bytes: int


def register(client: EngineClient, instance_id: str, kv: SharedKV, block_size: int, names: Sequence[str]) -> Worker:
    layers = {name: kv.layer(i) for i, name in enumerate(names)}
    status = register_one_rank(
        client,
        instance_id,
        kv.shared,
        layers,
        namespace=f"bench-{instance_id}",
        layout_tag=LAYOUT_TAG,
        dtype="bfloat16",
        block_size=block_size,
    )
    key = (instance_id, 0, 0)  # the client's lane connection is the worker's session
    return Worker(key, status.namespace_final, status.page_bytes)


def layer_names(n: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


# ------------------------------------------------------------------------------------------ measurements


class Memcpy:
    """The ceiling: np.copyto of 8-byte words between two pre-faulted buffers, 1 thread. Each copy takes the next
    window of buffers several times the last-level cache, so (like the engine's copies) it runs from DRAM."""

    def __init__(self, max_bytes: int) -> None:
        size = max(max_bytes, 256 * MiB) // 8
        self.a = np.empty(size, dtype=np.uint64)
        self.b = np.empty(size, dtype=np.uint64)
        self.a.fill(0x0123456789ABCDEF)  # faults both buffers in
        self.b.fill(0)
        self._at = 0

    def seconds(self, nbytes: int, reps: int, *, streaming: bool = False) -> float:
        """Best of `reps` copies of `nbytes`: np.copyto, or with streaming, the kernel's non-temporal copy (also
        when KVSEAL_COPY=numpy makes the engine copy with numpy; inf when the kernel is not built)."""
        if streaming and kernel is None:
            return float("inf")
        n = nbytes // 8
        best = float("inf")
        for _ in range(reps):
            if self._at + n > self.a.size:
                self._at = 0
            a, b = self.a[self._at : self._at + n], self.b[self._at : self._at + n]
            self._at += n
            if streaming:
                rows = [np.array([v], dtype=np.uint64) for v in (b.ctypes.data, a.ctypes.data, nbytes)]
                best = min(best, timed(kernel.copy_rows, *rows, True))
            else:
                best = min(best, timed(np.copyto, b, a))
        return best


def timed(fn: Any, *args: Any) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------ reports


class CpuWatch:
    """How much CPU other processes and the hypervisor took while the benchmark ran: on a 2-vCPU machine a busy
    neighbour halves what the engine gets, so the figures are only comparable when both numbers are near 0."""

    def __init__(self) -> None:
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float, float]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        hz = os.sysconf("SC_CLK_TCK")
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
        t = os.times()
        own = t.user + t.system + t.children_user + t.children_system
        return (user + nice + system + irq + softirq) / hz, steal / hz, own, time.monotonic()

    def report(self, ours: str = "this benchmark and its engines") -> str:
        busy0, steal0, own0, t0 = self._start
        busy1, steal1, own1, t1 = self._sample()
        others = max(0.0, (busy1 - busy0) - (own1 - own0))
        return (
            f"CPU while running: {ours} {own1 - own0:.1f} s, other processes "
            f"{others:.1f} s, stolen by the hypervisor {steal1 - steal0:.1f} s, over {t1 - t0:.1f} s wall on "
            f"{os.cpu_count()} CPUs{' -- CONTENDED, figures are noisy' if others > 0.1 * (t1 - t0) else ''}"
        )


def size_text(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.2f} {unit}"
    return f"{n:.0f} B"


def count_text(n: int) -> str:
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n >= 1000 and n % 1000 == 0:
        return f"{n // 1000}k"
    return str(n)


def cpu_model() -> str:
    try:
        m = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:
        m = None
    return m.group(1).strip() if m else platform.processor() or "unknown CPU"
