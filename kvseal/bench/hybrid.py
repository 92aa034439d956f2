"""A hybrid model's KV cache with kvseal attached: `kvseal bench hybrid`.

Models: the two of `kvseal bench vllm_ttft` (kvseal.bench.vllm_ttft_model, random weights, built once and cached):
Llama (8 layers of full attention) and Gemma 3 of the same shape (six of the eight layers with a 512-token sliding
window); for the capacity only, also a tiny gpt-oss built in the work directory (GPT_OSS: 4 layers alternating a
128-token window and full attention, attention sinks, 4 experts). Each vLLM run is a fresh process
(kvseal.bench.vllm_ttft_run: offline LLM, fp32, block 128, prefix caching on, VLLM_CPU_KVCACHE_SPACE=2, one thread).

1. KV capacity: vLLM's block count (num_gpu_blocks) in the same KV memory, for each model with no connector, with
   kvseal, and with no connector and vLLM's hybrid manager off (what vLLM did with kvseal before kvseal declared
   SupportsHMA, and still does for any connector that does not: every window layer is promoted to full attention).
   Target: kvseal / none = 1.0 for every model.
2. Bytes kvseal stores per 1k prompt tokens: --prompts prompts of --prompt-len tokens through each model on one
   engine, the sum of page bytes of every namespace (each group's pages) over the prompt tokens; for Gemma 3 also
   with kvseal.window_retention_tokens = window + block (a window's blocks kept only near a prompt's end).

Last line: RESULT capacity_ratio_MODEL=... (each model) hma_off_ratio_MODEL=... kib_per_1k_llama=...
kib_per_1k_gemma3=... kib_per_1k_gemma3_retained=... (capacity ratios = kvseal / none and no connector with HMA
off / none).
"""

from __future__ import annotations

import argparse
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvseal.bench import vllm_ttft_model
from kvseal.bench.harness import START_TIMEOUT_S
from kvseal.bench.vllm_ttft import engine_process, ensure_model, run_vllm
from kvseal.units import format_size

BLOCK = 128
GPT_OSS = {
    "model_type": "gpt_oss",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "max_position_embeddings": 4096,
}


def _model_dir(base: Path, arch: str) -> Path:
    return base if arch == "llama" else base.with_name(f"{base.name}-{arch}")


def main(a: argparse.Namespace) -> int:
    """Runs the benchmark with `kvseal bench hybrid`'s options (kvseal.cli): prompts, prompt_len, model_dir,
    pool_size, vllm_cpu, workdir."""
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix="kvseal-bench-hybrid-"))
    workdir.mkdir(parents=True, exist_ok=True)
    models = {arch: _model_dir(a.model_dir, arch) for arch in vllm_ttft_model.ARCHS}
    print(f"hybrid benchmark: {a.prompts} prompts x {a.prompt_len} tokens, fp32, block {BLOCK}; logs: {workdir}")
    for arch, path in models.items():
        print(f"model {arch}: {ensure_model(path, arch)}", flush=True)
    build = f"from kvseal.testing import llama; llama.build_any({str(workdir / 'gpt_oss')!r}, {GPT_OSS!r})"
    subprocess.run([sys.executable, "-c", build], check=True, stdout=subprocess.DEVNULL, timeout=600)
    capacity_only = {**models, "gpt_oss": workdir / "gpt_oss"}
    rng = random.Random(20261205)
    prompts = [[rng.randint(3, 31999) for _ in range(a.prompt_len)] for _ in range(a.prompts)]
    retained = vllm_ttft_model.WINDOW + BLOCK

    capacity: dict[tuple[str, str], int] = {}
    stored: dict[str, int] = {}
    engine = engine_process(workdir, a.pool_size, None)
    try:
        engine.wait_ready(START_TIMEOUT_S)
        for arch, path in capacity_only.items():
            for case in ("none", "none, HMA off", "kvseal"):
                args: dict[str, Any] = {"model": str(path), "prompts": [], "connector": case.split(",")[0]}
                args |= {"engine": engine.target, "hma": case != "none, HMA off"}
                if case == "kvseal" and arch in models:
                    args |= {"prompts": prompts, "kvseal": {"kvseal.namespace": arch}}
                r = run_vllm(f"{arch} {case}", args, workdir, a.vllm_cpu)
                capacity[arch, case] = r["num_gpu_blocks"]
                print(f"  {arch:<7} {case:<14} num_gpu_blocks {r['num_gpu_blocks']}", flush=True)
        extra = {"kvseal.namespace": "gemma3-retained", "kvseal.window_retention_tokens": retained}
        args = {"model": str(models["gemma3"]), "prompts": prompts, "connector": "kvseal", "engine": engine.target}
        run_vllm("gemma3 kvseal retained", args | {"kvseal": extra}, workdir, a.vllm_cpu)
        for ns in engine.get_json("/v1/namespaces"):
            client_namespace = ns["namespace"].split(".")[0]
            stored[client_namespace] = stored.get(client_namespace, 0) + ns["resident_blocks"] * ns["page_bytes"]
    finally:
        engine.stop()
    if not a.workdir:
        shutil.rmtree(workdir, ignore_errors=True)

    print()
    print(f"{'model':<8} {'no connector':>13} {'kvseal':>8} {'kvseal/none':>12} {'HMA off':>8} {'off/none':>9}")
    for arch in capacity_only:
        none, ours, off = (capacity[arch, case] for case in ("none", "kvseal", "none, HMA off"))
        print(f"{arch:<8} {none:>13} {ours:>8} {ours / none:>12.3f} {off:>8} {off / none:>9.3f}")
    print("  num_gpu_blocks: vLLM's KV capacity in blocks of 128 tokens (per group) in the same KV memory")
    tokens_k = a.prompts * a.prompt_len / 1000
    per_1k = {name: stored.get(name, 0) / tokens_k for name in ("llama", "gemma3", "gemma3-retained")}
    print()
    for name, value in per_1k.items():
        print(f"stored per 1k prompt tokens, {name:<16} {format_size(int(value)):>10}")
    print(
        f"  full blocks only (the partial last block is never stored); retained: kvseal.window_retention_tokens "
        f"{retained}"
    )
    ratios = " ".join(
        f"{name}_{arch}={capacity[arch, case] / capacity[arch, 'none']:.3f}"
        for name, case in (("capacity_ratio", "kvseal"), ("hma_off_ratio", "none, HMA off"))
        for arch in sorted(capacity_only)
    )
    print(
        f"RESULT {ratios} "
        f"kib_per_1k_llama={per_1k['llama'] / 1024:.0f} kib_per_1k_gemma3={per_1k['gemma3'] / 1024:.0f} "
        f"kib_per_1k_gemma3_retained={per_1k['gemma3-retained'] / 1024:.0f}"
    )
    return 0
