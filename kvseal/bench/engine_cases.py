"""The engine benchmark's cases (kvseal.bench.engine): Save and Load of a batch against the memcpy ceiling, Query
latency at a number of resident blocks and the gRPC floor under it, the fill that makes blocks resident, and the
copy figures drawn."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvseal.bench.harness import Hashes, Memcpy, SharedKV, Worker, size_text
from kvseal.client import EngineClient
from kvseal.copy.kernel import COPY_PATH
from kvseal.testing.process import EngineProcess

QUERY_HASHES = 64
TINY_BLOCKS = 1024  # worker blocks behind the tiny instance; fills reuse them (ids wrap around)


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
        f"{fig.label} ({shape}): {fig.batch} blocks x {size_text(fig.page_bytes)} pages = {size_text(fig.nbytes)} per "
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


def plot_copies(figures: Sequence[CopyFigures], path: Path) -> None:
    """Grouped bars: save, load and both ceilings (GB/s, best repetition) for each page size and batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{size_text(f.page_bytes)} pages\nx {f.batch} per RPC" for f in figures]
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
