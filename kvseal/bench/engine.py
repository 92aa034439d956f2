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
           query_p50_us=... query_1m_vs_1k=... bytes_per_block=... max_lock_ms=... save_128k_ratio=...
           load_128k_ratio=...

save/load/memcpy/stream in the RESULT line are the best repetitions of case 2's first batch size (64 blocks per
RPC); ratios divide by the ceiling (the better of memcpy and stream) of the same bytes; query_p50_us is the TCP
engine's at 1k resident blocks; max_lock_ms is the engine's longest hold of its lock over the whole run;
save_128k_ratio / load_128k_ratio are case 1's (128 KiB pages, 256 per RPC) best repetitions over their ceiling. The
header names the copy path the engine runs (the kernel, or numpy when the kernel is not built). `--plot FILE.png`
draws the copy figures against both ceilings (needs matplotlib: pip install 'kvseal[plot]').
--quick measures less (16 blocks per RPC, 50k resident blocks) and names its figures after what it measured
(query_50k_vs_1k, bytes_per_block_50k): they are smoke figures, not comparable with the targets.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvseal.bench.engine_cases import (
    QUERY_HASHES,
    TINY_BLOCKS,
    copy_case,
    fill,
    plot_copies,
    print_copy,
    query_latency,
    rpc_floor,
)
from kvseal.bench.harness import (
    START_TIMEOUT_S,
    CpuWatch,
    GiB,
    Hashes,
    KiB,
    Memcpy,
    MiB,
    SharedKV,
    count_text,
    cpu_model,
    layer_names,
    register,
    size_text,
    start_engine,
)
from kvseal.client import EngineClient
from kvseal.copy.kernel import COPY_PATH
from kvseal.errors import KvsealError

HASH_BYTES = 32  # vLLM's sha256 block hashes


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
        f"grpcio {grpc.__version__}; {cpu_model()}, {os.cpu_count()} CPUs; load average "
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
        f"max_lock_ms={result['max_lock_ms']:.2f} "
        f"save_128k_ratio={result['save_128k_ratio']:.3f} "
        f"load_128k_ratio={result['load_128k_ratio']:.3f}",
        flush=True,
    )
    return 0


def figure_names(plan: Plan) -> tuple[str, str]:
    """The RESULT names of the query ratio and of the engine memory per block. The full run's are the targets'
    (query_1m_vs_1k; bytes_per_block, at 1M resident); a smaller run's name the sizes it measured, so that its
    figures never pass for the targets'."""
    large, small = count_text(plan.resident_large).lower(), count_text(plan.resident_small).lower()
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
            f"{size_text(plan.pool_bytes)} pre-faulted, ready in {ready:.2f} s "
            f"(VmRSS {size_text(engine.rss()['VmRSS'])})"
        )
        w1 = register(client, "case1", kv1, 16, layer_names(4))
        w2 = register(client, "case2", kv2, 16, layer_names(32))
        wt = register(client, "tiny", tiny, 16, layer_names(1))
        print(
            f"registered: {w1.namespace_final} ({size_text(w1.page_bytes)} pages), {w2.namespace_final} "
            f"({size_text(w2.page_bytes)} pages), {wt.namespace_final} ({wt.page_bytes} B pages)"
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
        result["save_128k_ratio"] = fig1.gbps(fig1.save_s) / fig1.ceiling_gbps
        result["load_128k_ratio"] = fig1.gbps(fig1.load_s) / fig1.ceiling_gbps
        print(
            f"RESULT save/load: case 2 at {main_fig.batch} blocks per RPC, best repetition end to end, over the "
            "better of memcpy and the streaming copy of the same bytes"
        )
        figures = [fig1, *figs2]
        print()

        # query latency and metadata, on the tiny instance
        resident: list[bytes] = []
        fill(client, wt, hashes, plan.resident_small, plan.fill_batch, resident)
        small, large = count_text(plan.resident_small), count_text(plan.resident_large)
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
            f"fill: {count_text(grown)} tiny blocks in Save RPCs of {plan.fill_batch} hashes took {fill_s:.2f} s = "
            f"{fill_s / grown * 1e6:.2f} us/block (engine now holds {resident_now:.0f} blocks, all namespaces)"
        )
        bytes_per_block = (rss1["VmRSS"] - rss0["VmRSS"]) / grown
        print(
            f"metadata: engine VmRSS {size_text(rss0['VmRSS'])} -> {size_text(rss1['VmRSS'])} while "
            f"{count_text(grown)} blocks became resident = {bytes_per_block:.1f} B/block (RssAnon: "
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
        print(f"  unix, Query at {count_text(plan.resident_small):>4} resident   {q_unix.line()}")
        client_u.close()
    finally:
        engine_u.stop()
    print()
    if plan is not FULL:
        print(
            f"{plan.name} figures are smoke figures, not the targets': {_batches(plan)} blocks per RPC and "
            f"{count_text(plan.resident_large)} resident blocks here; the targets' run (without --quick) has "
            f"{_batches(FULL)} blocks per RPC and {count_text(FULL.resident_large)} resident"
        )
    print(
        "targets: save and load >= 0.85 x the ceiling, query p50 <= 150 us, 1M/1k <= 1.2, <= 256 B per block, "
        "longest engine-lock hold <= 10 ms"
    )
    if plot is not None:
        plot_copies(figures, plot)
        print(f"plot: {plot}")
    return result


def _batches(plan: Plan) -> str:
    return " and ".join(str(b) for b in plan.case2_batches)
