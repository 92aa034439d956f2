"""Engine benchmark: a real `kvseal serve` subprocess driven through EngineClient (the local lane for Register, Save,
Load, Query and Release, the lane connection being the worker's session; gRPC for Info), the way a vLLM worker and
scheduler drive it. Every speed is printed next to a ceiling measured in the same run; nothing is asserted. It needs
only the base install (numpy, no torch): the worker's KV memory is sealed memfds (kvseal.memfd.SharedArray) holding
bf16 data as 8-byte words, registered with dtype "bfloat16".

    memcpy     np.copyto of one batch's bytes between two pre-faulted buffers (from DRAM, not cache), 1 thread,
               re-measured before every repetition, best kept: cached stores below glibc's non-temporal
               threshold (a few hundred MiB), streaming ones above it
    stream     the same bytes copied with non-temporal stores (the kvseal kernel's streaming copy of one row);
               the ceiling is the better of the two, measured in the same run
    case 1     256 blocks of 128 KiB pages (4 layers x 32 KiB slots): one Save RPC, then one Load RPC of the same
               hashes into other block ids, through the lane + store bookkeeping + copy; best and median GB/s,
               and where the time goes (copy / rest of the handler / outside it, from the engine's /metrics)
    case 2     Llama-8B-like pages: 32 layers x 8 KV heads x 128 head dim, bf16, block_size 16, K and V in one
               slot ([num_blocks, kv_heads, block_size, 2*head_dim] per layer, all layers views of one
               allocation): 2 MiB per page, batches of 64 and 256 blocks per RPC
    query      p50/p99 of Query calls of 64 resident hashes saved together (each lease released afterwards,
               untimed) at 1k and 1M resident blocks, with the engine's gRPC on TCP loopback, and at 1k with it on
               a unix socket (the queries take the local lane either way); at 1M also 64 hashes saved apart (every
               lookup goes through the index); a grpc.health Check on the gRPC target gives the floor of any gRPC
               call
    metadata   engine VmRSS growth per resident block while 1M tiny (64-byte) pages fill a pre-faulted pool

The worker side (this process) and the engine run single-threaded (numpy copies; OMP_NUM_THREADS=1 for both).
The last line is machine-readable:

    RESULT save_gbps=... load_gbps=... memcpy_gbps=... stream_gbps=... save_ratio=... load_ratio=...
           query_p50_us=... query_1m_vs_1k=... bytes_per_block=... max_lock_ms=...

save/load/memcpy/stream in the RESULT line are the best repetitions of case 2's first batch size (64 blocks per
RPC); ratios divide by the ceiling (the better of memcpy and stream) of the same bytes; query_p50_us is the TCP
engine's at 1k resident blocks; max_lock_ms is the engine's longest hold of its lock over the whole run. The
header names the copy path the engine runs (the kernel, or numpy when the kernel is not built). `--plot FILE.png`
draws the copy figures against both ceilings (needs matplotlib: pip install 'kvseal[plot]').
--quick measures less (16 blocks per RPC, 50k resident blocks) and names its figures after what it measured
(query_50k_vs_1k, bytes_per_block_50k): they are smoke figures, not comparable with the targets.
"""

from __future__ import annotations

import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvseal.client import EngineClient
from kvseal.copy.kernel import COPY_PATH, kernel
from kvseal.errors import KvsealError
from kvseal.memfd import SharedArray
from kvseal.testing.process import EngineProcess
from kvseal.testing.worker import register_one_rank

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
HASH_BYTES = 32  # vLLM's sha256 block hashes
QUERY_HASHES = 64
TINY_BLOCKS = 1024  # worker blocks behind the tiny instance; fills reuse them (ids wrap around)
LAYOUT_TAG = "bench.cpu"


@dataclass(frozen=True, slots=True)
class Plan:
    name: str
    pool_bytes: int
    case1_blocks: int
    case1_reps: int
    case2_batches: tuple[int, ...]
    case2_reps: int
    memcpy_reps: int
    queries: int
    resident_small: int
    resident_large: int
    fill_batch: int


FULL = Plan(
    name="full",
    pool_bytes=2 * GiB,
    case1_blocks=256,
    case1_reps=16,
    case2_batches=(64, 256),
    case2_reps=12,
    memcpy_reps=8,
    queries=2000,
    resident_small=1000,
    resident_large=1_000_000,
    fill_batch=8192,
)
QUICK = Plan(
    name="quick",
    pool_bytes=256 * MiB,
    case1_blocks=64,
    case1_reps=3,
    case2_batches=(16,),
    case2_reps=3,
    memcpy_reps=3,
    queries=300,
    resident_small=1000,
    resident_large=50_000,
    fill_batch=8192,
)


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
) -> EngineProcess:
    """`python -m kvseal serve` as the benchmarks run it: free loopback ports unless `listen` says, the engine's
    own slab size, --log-level WARNING (extra may say otherwise), one thread for numpy, stdout and stderr in
    workdir/NAME.log. Returns at once; wait_ready(START_TIMEOUT_S) waits for it."""
    return EngineProcess(
        workdir,
        extra,
        listen,
        wrapper,
        name=name,
        pool_size=pool_bytes,
        slab_size=None,
        log_level="WARNING",
        env=BENCH_ENV,
        merge_output=True,
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
                best = min(best, _timed(kernel.copy_rows, *rows, True))
            else:
                best = min(best, _timed(np.copyto, b, a))
        return best


def _timed(fn: Any, *args: Any) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _rpc_sum(m: dict[str, float], method: str, what: str = "sum") -> float:
    """Seconds spent in (what="count": the number of) successful `method` handlers, over gRPC or the local lane
    (labelled lane.<method>), from kvseal_rpc_seconds (label order is the exporter's)."""
    wants = [(f'method="{name}"', 'code="OK"') for name in (method, f"lane.{method}")]
    prefix = f"kvseal_rpc_seconds_{what}{{"
    return sum(v for k, v in m.items() if k.startswith(prefix) and any(all(w in k for w in want) for want in wants))


@dataclass
class CopyFigures:
    """Seconds per repetition of the client's whole RPC, and the engine's own view of the same RPCs from
    /metrics read before and after all repetitions (a scrape between them would compete with the timed RPC):
    the handler (decode, checks, store bookkeeping, copy, encode: kvseal_rpc_seconds) and the copy alone
    (kvseal_save_seconds / kvseal_load_seconds), as means per RPC."""

    label: str
    batch: int
    page_bytes: int
    memcpy_s: list[float] = field(default_factory=list)  # a best-of-2 right before each save, plus a best-of-N
    stream_s: list[float] = field(default_factory=list)  # the same with streaming stores
    save_s: list[float] = field(default_factory=list)
    load_s: list[float] = field(default_factory=list)
    save_handler_s: float = 0.0
    load_handler_s: float = 0.0
    save_copy_s: float = 0.0
    load_copy_s: float = 0.0
    evictions: float = 0.0
    check: str = ""
    problems: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.batch * self.page_bytes

    def gbps(self, seconds: Sequence[float] | float, best: bool = True) -> float:
        if isinstance(seconds, float):
            return self.nbytes / seconds / 1e9 if seconds > 0 else 0.0
        if not seconds:
            return 0.0
        return self.nbytes / (min(seconds) if best else statistics.median(seconds)) / 1e9

    @property
    def memcpy_gbps(self) -> float:
        return self.gbps(self.memcpy_s)

    @property
    def stream_gbps(self) -> float:
        return self.gbps(self.stream_s)

    @property
    def ceiling_gbps(self) -> float:
        return max(self.memcpy_gbps, self.stream_gbps)

    def ceilings(self) -> list[float]:
        """Seconds of the better ceiling, per repetition."""
        return [min(m, t) for m, t in zip(self.memcpy_s, self.stream_s, strict=True)]


def copy_case(
    engine: EngineProcess,
    client: EngineClient,
    worker: Worker,
    kv: SharedKV,
    hashes: Hashes,
    batch: int,
    reps: int,
    memcpy: Memcpy,
    memcpy_reps: int,
    label: str,
) -> CopyFigures:
    """Save `batch` fresh blocks from ids 0..batch-1 in one RPC, then Load them into ids batch..2*batch-1. The
    memcpy ceiling is re-measured before every repetition (a VM's memory bandwidth drifts) and the best kept."""
    fig = CopyFigures(label, batch, worker.page_bytes)
    fig.memcpy_s.append(memcpy.seconds(fig.nbytes, memcpy_reps))
    fig.stream_s.append(memcpy.seconds(fig.nbytes, memcpy_reps, streaming=True))
    src_ids, dst_ids = list(range(batch)), list(range(batch, 2 * batch))
    # warm-up: faults the engine's mapping of both block ranges in and checks a byte-exact round trip
    words = kv.words
    words[:, batch : 2 * batch] = 0
    h = hashes.take(batch)
    client.save(worker.key, h, src_ids)
    client.load(worker.key, h, dst_ids)
    fig.check = "ok" if np.array_equal(words[:, :batch], words[:, batch : 2 * batch]) else "MISMATCH"
    m0 = engine.metrics()
    for _ in range(reps):
        h = hashes.take(batch)
        fig.memcpy_s.append(memcpy.seconds(fig.nbytes, 2))
        fig.stream_s.append(memcpy.seconds(fig.nbytes, 2, streaming=True))
        t0 = time.perf_counter()
        saved = client.save(worker.key, h, src_ids)
        t1 = time.perf_counter()
        loaded = client.load(worker.key, h, dst_ids)
        t2 = time.perf_counter()
        fig.save_s.append(t1 - t0)
        fig.load_s.append(t2 - t1)
        if saved.written != batch or saved.completed != batch:
            fig.problems.append(
                f"save wrote {saved.written}/{batch}, sealed {saved.completed}, not stored {saved.not_stored}"
            )
        if loaded.loaded != batch:
            fig.problems.append(f"load copied {loaded.loaded}/{batch}: {loaded.message or loaded.reason}")
    m1 = engine.metrics()
    fig.save_handler_s = (_rpc_sum(m1, "Save") - _rpc_sum(m0, "Save")) / reps
    fig.load_handler_s = (_rpc_sum(m1, "Load") - _rpc_sum(m0, "Load")) / reps
    fig.save_copy_s = (m1["kvseal_save_seconds_total"] - m0["kvseal_save_seconds_total"]) / reps
    fig.load_copy_s = (m1["kvseal_load_seconds_total"] - m0["kvseal_load_seconds_total"]) / reps
    fig.evictions = m1["kvseal_evictions_total"] - m0["kvseal_evictions_total"]
    return fig


def print_copy(fig: CopyFigures, reps: int, shape: str) -> None:
    print(
        f"{fig.label} ({shape}): {fig.batch} blocks x {_size(fig.page_bytes)} pages = {_size(fig.nbytes)} per "
        f"RPC, {reps} reps; round-trip check {fig.check}; pool evictions during the reps {fig.evictions:.0f}"
    )
    print(
        f"  memcpy, same bytes          best {fig.memcpy_gbps:6.2f} GB/s  median {fig.gbps(fig.memcpy_s, False):6.2f}"
    )
    print(
        f"  streaming copy, same bytes  best {fig.stream_gbps:6.2f} GB/s  median {fig.gbps(fig.stream_s, False):6.2f}"
        f"  -> ceiling {fig.ceiling_gbps:.2f} GB/s"
    )
    for what, rpc, handler, copy in (
        ("save", fig.save_s, fig.save_handler_s, fig.save_copy_s),
        ("load", fig.load_s, fig.load_handler_s, fig.load_copy_s),
    ):
        best = fig.gbps(rpc)
        paired = statistics.median(m / r for m, r in zip(fig.ceilings()[1:], rpc, strict=True))
        print(
            f"  {what} RPC end to end        best {best:6.2f} GB/s  median {fig.gbps(rpc, False):6.2f}  = "
            f"{best / fig.ceiling_gbps:.3f} x ceiling (median of per-rep ratios {paired:.3f})"
        )
        mean = statistics.mean(rpc)
        print(
            f"    mean RPC {mean * 1e3:.2f} ms = copy {copy * 1e3:.2f} ({fig.gbps(copy):.2f} GB/s) + handler work "
            f"besides the copy {(handler - copy) * 1e3:.2f} ({(handler - copy) / fig.batch * 1e6:.2f} us/block) + "
            f"outside the handler {(mean - handler) * 1e3:.2f} (transport, client)"
        )
    for p in sorted(set(fig.problems)):
        print(f"  PROBLEM: {p}")


@dataclass
class Latency:
    samples: list[float]
    misses: int = 0
    handler_s: float = float("nan")  # mean seconds inside the engine's handler, from kvseal_rpc_seconds

    def pct(self, q: float) -> float:
        s = sorted(self.samples)
        return s[min(len(s) - 1, int(q / 100 * len(s)))] * 1e6

    def line(self) -> str:
        out = f"p50 {self.pct(50):6.1f} us  p99 {self.pct(99):7.1f} us  ({len(self.samples)} calls)"
        if self.handler_s == self.handler_s:
            out += f"; in the engine's handler {self.handler_s * 1e6:.1f} us mean"
        if self.misses:
            out += f"  (!) {self.misses} queries were not all hits"
        return out


def query_latency(
    engine: EngineProcess,
    client: EngineClient,
    instance_id: str,
    resident: Sequence[bytes],
    n: int,
    rng: np.random.Generator,
    scattered: bool = False,
) -> Latency:
    """Query RPCs of 64 resident hashes; each lease is released (untimed). The hashes are a window of `resident`
    at a random place (saved together, as a prompt's blocks are), or with `scattered` 64 drawn from anywhere
    (saved apart: no two on neighbouring pages)."""
    warmup = max(50, n // 20)
    starts = rng.integers(0, len(resident) - QUERY_HASHES, size=n + warmup).tolist()
    out = Latency([])
    m0: dict[str, float] = {}
    for i, s in enumerate(starts):
        if i == warmup:
            m0 = engine.metrics()
        if scattered:
            window = [resident[j] for j in rng.integers(0, len(resident), size=QUERY_HASHES).tolist()]
        else:
            window = resident[s : s + QUERY_HASHES]
        t0 = time.perf_counter()
        r = client.query(instance_id, window)
        dt = time.perf_counter() - t0
        if r.lease_id:
            client.release(instance_id, r.lease_id)
        if i >= warmup:
            out.samples.append(dt)
            out.misses += r.hits != QUERY_HASHES
    m1 = engine.metrics()
    if m0 and m1:
        calls = _rpc_sum(m1, "Query", "count") - _rpc_sum(m0, "Query", "count")
        out.handler_s = (_rpc_sum(m1, "Query") - _rpc_sum(m0, "Query")) / max(calls, 1)
    return out


def rpc_floor(target: str, n: int) -> Latency:
    """grpc.health.v1 Check on the same target: what any unary RPC from Python costs here."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="")
        out = Latency([])
        for i in range(n + max(50, n // 20)):
            t0 = time.perf_counter()
            stub.Check(request, timeout=10)
            if i >= max(50, n // 20):
                out.samples.append(time.perf_counter() - t0)
    return out


def fill(client: EngineClient, worker: Worker, hashes: Hashes, n: int, batch: int, into: list[bytes]) -> float:
    """Saves n fresh tiny blocks in RPCs of `batch` hashes. Returns seconds."""
    ids = [i % TINY_BLOCKS for i in range(batch)]
    start = time.perf_counter()
    left = n
    while left > 0:
        m = min(batch, left)
        h = hashes.take(m)
        r = client.save(worker.key, h, ids[:m])
        if r.not_stored:
            raise RuntimeError(f"the pool refused {r.not_stored} tiny blocks: it is too small for the fill")
        into.extend(h)
        left -= m
    return time.perf_counter() - start


# ------------------------------------------------------------------------------------------ main


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


def main(quick: bool = False, plot: str | None = None) -> int:
    os.environ["OMP_NUM_THREADS"] = "1"
    import grpc

    if plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("--plot needs matplotlib: pip install 'kvseal[plot]'", file=sys.stderr)
            return 2
    plan = QUICK if quick else FULL
    rng = np.random.default_rng(20261202)
    watch = CpuWatch()
    print(f"kvseal engine benchmark ({plan.name})")
    print(
        f"  python {platform.python_version()}, numpy {np.__version__}, "
        f"grpcio {grpc.__version__}; {_cpu_model()}, {os.cpu_count()} CPUs; load average "
        f"{' '.join(Path('/proc/loadavg').read_text().split()[:3])}"
    )
    print(
        f"  env: OMP_NUM_THREADS=1 (set here and for the engine), "
        f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '<unset>')} (left as is)"
    )
    print(f"  copies: {COPY_PATH} (the engine it starts runs the same install and environment)")
    with tempfile.TemporaryDirectory(prefix="kvseal-bench-") as tmp:
        try:
            result = _run(plan, Path(tmp), rng, Path(plot) if plot else None)
        except (KvsealError, RuntimeError, OSError) as e:
            print(f"benchmark failed: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    print(watch.report())
    query_ratio, per_block = figure_names(plan)
    print(
        "RESULT "
        f"save_gbps={result['save_gbps']:.2f} "
        f"load_gbps={result['load_gbps']:.2f} "
        f"memcpy_gbps={result['memcpy_gbps']:.2f} "
        f"stream_gbps={result['stream_gbps']:.2f} "
        f"save_ratio={result['save_ratio']:.3f} "
        f"load_ratio={result['load_ratio']:.3f} "
        f"query_p50_us={result['query_p50_us']:.1f} "
        f"{query_ratio}={result['query_ratio']:.3f} "
        f"{per_block}={result['bytes_per_block']:.1f} "
        f"max_lock_ms={result['max_lock_ms']:.2f}",
        flush=True,
    )
    return 0


def figure_names(plan: Plan) -> tuple[str, str]:
    """The RESULT names of the query ratio and of the engine memory per block. The full run's are the targets'
    (query_1m_vs_1k; bytes_per_block, at 1M resident); a smaller run's name the sizes it measured, so that its
    figures never pass for the targets'."""
    large, small = _count(plan.resident_large).lower(), _count(plan.resident_small).lower()
    return f"query_{large}_vs_{small}", "bytes_per_block" if plan is FULL else f"bytes_per_block_{large}"


def _run(plan: Plan, tmp: Path, rng: np.random.Generator, plot: Path | None) -> dict[str, float]:
    # worker KV memory, per layer [num_blocks, kv_heads, block_size, 2*head_dim] bf16, all layers views of one
    # allocation: case 1 = 4 layers x [., 4, 16, 256] (32 KiB slots, 128 KiB pages); case 2 = 32 layers x
    # [., 8, 16, 256] (64 KiB slots, 2 MiB pages); tiny = 1 layer x 64 bytes ([., 32] bf16)
    bf16 = 2
    kv1 = SharedKV(4, 2 * plan.case1_blocks, 4 * 16 * 256 * bf16, rng)
    kv2 = SharedKV(32, 2 * max(plan.case2_batches), 8 * 16 * 256 * bf16, rng)
    tiny = SharedKV(1, TINY_BLOCKS, 32 * bf16, rng)
    try:
        return _measure(plan, tmp, rng, kv1, kv2, tiny, plot)
    finally:
        for kv in (kv1, kv2, tiny):
            kv.close()


def _measure(
    plan: Plan, tmp: Path, rng: np.random.Generator, kv1: SharedKV, kv2: SharedKV, tiny: SharedKV, plot: Path | None
) -> dict[str, float]:
    result: dict[str, float] = {}
    hashes = Hashes()
    memcpy = Memcpy(max(plan.case1_blocks * 128 * KiB, max(plan.case2_batches) * 2 * MiB))

    engine = start_engine(tmp, "engine-tcp", plan.pool_bytes)
    try:
        ready = engine.wait_ready(START_TIMEOUT_S)
        client = EngineClient(engine.target, timeout=120)
        print(
            f"engine: pid {engine.pid}, gRPC {engine.target}, HTTP 127.0.0.1:{engine.http_port}, pool "
            f"{_size(plan.pool_bytes)} pre-faulted, ready in {ready:.2f} s (VmRSS {_size(engine.rss()['VmRSS'])})"
        )
        w1 = register(client, "case1", kv1, 16, layer_names(4))
        w2 = register(client, "case2", kv2, 16, layer_names(32))
        wt = register(client, "tiny", tiny, 16, layer_names(1))
        print(
            f"registered: {w1.namespace_final} ({_size(w1.page_bytes)} pages), {w2.namespace_final} "
            f"({_size(w2.page_bytes)} pages), {wt.namespace_final} ({wt.page_bytes} B pages)"
        )
        print()

        args = (engine, client)
        fig1 = copy_case(*args, w1, kv1, hashes, plan.case1_blocks, plan.case1_reps, memcpy, plan.memcpy_reps, "case 1")
        print_copy(fig1, plan.case1_reps, "4 layers x 32 KiB slots")
        figs2 = []
        for batch in plan.case2_batches:
            fig = copy_case(*args, w2, kv2, hashes, batch, plan.case2_reps, memcpy, plan.memcpy_reps, "case 2")
            print_copy(fig, plan.case2_reps, "Llama-8B-like: 32 layers x 8 KV heads x 128 dim, bf16, 16 tokens")
            figs2.append(fig)
        main_fig = figs2[0]
        result["save_gbps"] = main_fig.gbps(main_fig.save_s)
        result["load_gbps"] = main_fig.gbps(main_fig.load_s)
        result["memcpy_gbps"] = main_fig.memcpy_gbps
        result["stream_gbps"] = main_fig.stream_gbps
        result["save_ratio"] = result["save_gbps"] / main_fig.ceiling_gbps
        result["load_ratio"] = result["load_gbps"] / main_fig.ceiling_gbps
        print(
            f"RESULT save/load: case 2 at {main_fig.batch} blocks per RPC, best repetition end to end, over the "
            "better of memcpy and the streaming copy of the same bytes"
        )
        figures = [fig1, *figs2]
        print()

        # query latency and metadata, on the tiny instance
        resident: list[bytes] = []
        fill(client, wt, hashes, plan.resident_small, plan.fill_batch, resident)
        small, large = _count(plan.resident_small), _count(plan.resident_large)
        print(
            f"prefix query: EngineClient.query of {QUERY_HASHES} resident hashes (random windows; over the local "
            "lane, which the engine offers), each lease released afterwards, untimed"
        )
        print(f"  TCP, grpc.health Check (floor)   {rpc_floor(engine.target, plan.queries).line()}")
        q_small = query_latency(engine, client, "tiny", resident, plan.queries, rng)
        print(f"  TCP, Query at {small:>4} resident    {q_small.line()}")
        rss0 = engine.rss()
        fill_s = fill(client, wt, hashes, plan.resident_large - plan.resident_small, plan.fill_batch, resident)
        rss1 = engine.rss()
        q_large = query_latency(engine, client, "tiny", resident, plan.queries, rng)
        print(f"  TCP, Query at {large:>4} resident    {q_large.line()}")
        ratio = q_large.pct(50) / q_small.pct(50)
        print(f"  p50 at {large} / p50 at {small} = {ratio:.3f}")
        q_apart = query_latency(engine, client, "tiny", resident, plan.queries, rng, scattered=True)
        print(f"  TCP, Query at {large:>4} resident, 64 hashes saved apart  {q_apart.line()}")
        print(f"  (p50 of hashes saved apart at {large} / p50 at {small} = {q_apart.pct(50) / q_small.pct(50):.3f})")
        grown = plan.resident_large - plan.resident_small
        resident_now = engine.metrics().get("kvseal_resident_blocks", float("nan"))
        print(
            f"fill: {_count(grown)} tiny blocks in Save RPCs of {plan.fill_batch} hashes took {fill_s:.2f} s = "
            f"{fill_s / grown * 1e6:.2f} us/block (engine now holds {resident_now:.0f} blocks, all namespaces)"
        )
        bytes_per_block = (rss1["VmRSS"] - rss0["VmRSS"]) / grown
        print(
            f"metadata: engine VmRSS {_size(rss0['VmRSS'])} -> {_size(rss1['VmRSS'])} while {_count(grown)} blocks "
            f"became resident = {bytes_per_block:.1f} B/block (RssAnon: "
            f"{(rss1['RssAnon'] - rss0['RssAnon']) / grown:.1f} B/block)"
        )
        print(
            "  method: the pool is pre-faulted at engine start, so page bytes are already in VmRSS; the growth is\n"
            "  what the engine keeps per block (index entry, hash object, page table arrays) plus allocator slack\n"
            f"  and transient RPC buffers; 64-byte pages, {HASH_BYTES}-byte hashes, one namespace"
        )
        result["query_p50_us"] = q_small.pct(50)
        result["query_ratio"] = ratio
        result["bytes_per_block"] = bytes_per_block
        m = engine.metrics()
        result["max_lock_ms"] = m.get("kvseal_engine_lock_max_hold_seconds", float("nan")) * 1e3
        where = next((k for k in m if k.startswith("kvseal_engine_lock_max_hold_info{")), "")
        print(f"engine lock: longest hold over the run {result['max_lock_ms']:.2f} ms ({where.partition('{')[2][:-1]})")
        client.close()
    except BaseException:
        if engine.proc.poll() is not None:
            print(f"engine log:\n{engine.log_tail()}", file=sys.stderr)
        raise
    finally:
        engine.stop()

    # the same query over a unix socket, on a second small engine
    sock = f"unix:{tmp}/engine.sock"
    engine_u = start_engine(tmp, "engine-unix", 64 * MiB, listen=sock)
    try:
        engine_u.wait_ready(START_TIMEOUT_S)
        client_u = EngineClient(sock, timeout=60)
        wu = register(client_u, "tiny", tiny, 16, layer_names(1))
        resident_u: list[bytes] = []
        fill(client_u, wu, hashes, plan.resident_small, plan.fill_batch, resident_u)
        print(f"  unix, grpc.health Check (floor)  {rpc_floor(sock, plan.queries).line()}")
        q_unix = query_latency(engine_u, client_u, "tiny", resident_u, plan.queries, rng)
        print(f"  unix, Query at {_count(plan.resident_small):>4} resident   {q_unix.line()}")
        client_u.close()
    finally:
        engine_u.stop()
    print()
    if plan is not FULL:
        print(
            f"{plan.name} figures are smoke figures, not the targets': {_batches(plan)} blocks per RPC and "
            f"{_count(plan.resident_large)} resident blocks here; the targets' run (without --quick) has "
            f"{_batches(FULL)} blocks per RPC and {_count(FULL.resident_large)} resident"
        )
    print(
        "targets: save and load >= 0.85 x the ceiling, query p50 <= 150 us, 1M/1k <= 1.2, <= 256 B per block, "
        "longest engine-lock hold <= 10 ms"
    )
    if plot is not None:
        plot_copies(figures, plot)
        print(f"plot: {plot}")
    return result


def plot_copies(figures: Sequence[CopyFigures], path: Path) -> None:
    """Grouped bars: save, load and both ceilings (GB/s, best repetition) for each page size and batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{_size(f.page_bytes)} pages\nx {f.batch} per RPC" for f in figures]
    series = [
        ("save", [f.gbps(f.save_s) for f in figures]),
        ("load", [f.gbps(f.load_s) for f in figures]),
        ("memcpy (np.copyto)", [f.memcpy_gbps for f in figures]),
        ("streaming copy", [f.stream_gbps for f in figures]),
    ]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series):
        xs = [k + (i - (len(series) - 1) / 2) * width for k in range(len(figures))]
        ax.bar(xs, values, width, label=name)
    for k, f in enumerate(figures):
        ax.hlines(0.85 * f.ceiling_gbps, k - 0.4, k + 0.4, colors="black", linestyles="dashed")
    ax.set_xticks(range(len(figures)), labels)
    ax.set_ylabel("GB/s (best repetition)")
    ax.set_title(f"kvseal Save/Load, 1 thread, copies: {COPY_PATH}\ndashed: 0.85 x the better ceiling", fontsize=10)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _batches(plan: Plan) -> str:
    return " and ".join(str(b) for b in plan.case2_batches)


def _size(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.2f} {unit}"
    return f"{n:.0f} B"


def _count(n: int) -> str:
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n >= 1000 and n % 1000 == 0:
        return f"{n // 1000}k"
    return str(n)


def _cpu_model() -> str:
    try:
        m = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:
        m = None
    return m.group(1).strip() if m else platform.processor() or "unknown CPU"
