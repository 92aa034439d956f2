"""One vLLM process of `kvseal bench vllm_ttft`: offline LLM (CPU, eager, one process), token-id prompts each in
its own generate() call, one `RESULT {json}` line on stdout.

    python -m kvseal.bench.vllm_ttft_run '{"model": DIR, "prompts": [[ids...], ...],
        "connector": "none"|"kvseal"|"example", "engine": "127.0.0.1:PORT", "storage": DIR, "warmup": [[ids...], ...]}'

Optional: "hma": false (vLLM's hybrid KV cache manager off), "kvseal": {"kvseal.KEY": value, ...} (more connector
config), "block_size", "max_model_len", "max_tokens", "repeat". The RESULT also carries num_gpu_blocks (vLLM's KV
capacity in blocks).

Per measured request: ttft_s = RequestOutput.metrics.first_token_latency (vLLM's own TTFT: the time from the
request's arrival in LLM.generate() to the engine step that produced its first token, so queueing, the connector's
query and an asynchronous load are inside it), queued_s (SCHEDULED - QUEUED engine events), prefill_s
(first-token step - SCHEDULED), wall_s (the generate() call, all max_tokens), cpu_s (this process's CPU time
during the call), external (vLLM's vllm:external_prefix_cache_hits delta: prompt tokens the connector provided),
cached (RequestOutput.num_cached_tokens: local + external), outputs (greedy token ids), and the seconds spent
inside each connector hook (the connector classes are wrapped with timers before the LLM is built; both connector
roles run in this process with VLLM_ENABLE_V1_MULTIPROCESSING=0).

The warm-up prompts run first and are not measured. With "repeat": true the prompts run a second time in the same
process ("repeats"): vLLM's local prefix cache then serves their full blocks, the floor for any connector.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections import defaultdict
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
)
HOOK_SECONDS: dict[str, float] = defaultdict(float)
HOOK_CALLS: dict[str, int] = defaultdict(int)


def _timed(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            HOOK_SECONDS[name] += time.perf_counter() - start
            HOOK_CALLS[name] += 1

    return wrapper


def time_hooks(cls: type) -> None:
    for name in HOOKS:
        if name in cls.__dict__:
            setattr(cls, name, _timed(name, cls.__dict__[name]))


def external_hits(llm: Any) -> int:
    """vLLM's own count of prompt tokens the connector provided (a counter over the process's lifetime)."""
    for metric in llm.get_metrics():
        if metric.name == "vllm:external_prefix_cache_hits":
            return int(metric.value)
    return 0


def main() -> None:
    args = json.loads(sys.argv[1])
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    import_s = time.perf_counter() - t0
    kwargs: dict[str, Any] = dict(
        model=args["model"],
        dtype=args.get("dtype", "float32"),
        block_size=args.get("block_size", 128),
        enable_prefix_caching=True,
        max_model_len=args.get("max_model_len", 2048),
        seed=0,
        enforce_eager=True,
        disable_log_stats=False,
    )
    connector = args.get("connector", "none")
    if connector == "example":
        from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

        time_hooks(ExampleConnector)
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": args["storage"]},
        )
    elif connector == "kvseal":
        from kvseal.vllm.connector import KVSealConnector

        time_hooks(KVSealConnector)
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVSealConnector",
            kv_connector_module_path="kvseal.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"kvseal.engine": args["engine"], **args.get("kvseal", {})},
        )
    elif connector != "none":
        raise SystemExit(f"unknown connector {connector!r}")
    if args.get("hma") is False:
        kwargs["disable_hybrid_kv_cache_manager"] = True
    t1 = time.perf_counter()
    llm = LLM(**kwargs)
    startup_s = time.perf_counter() - t1
    params = SamplingParams(max_tokens=args.get("max_tokens", 8), temperature=0)

    def generate(ids: list[int]) -> dict[str, Any]:
        hits_before = external_hits(llm)
        HOOK_SECONDS.clear()
        HOOK_CALLS.clear()
        start, cpu = time.perf_counter(), time.process_time()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        wall = time.perf_counter() - start
        cpu = time.process_time() - cpu
        m = out.metrics
        return {
            "ttft_s": m.first_token_latency,
            "queued_s": m.scheduled_ts - m.queued_ts,
            "prefill_s": m.first_token_ts - m.scheduled_ts,
            "wall_s": wall,
            "cpu_s": cpu,
            "external": external_hits(llm) - hits_before,
            "cached": out.num_cached_tokens,
            "outputs": list(out.outputs[0].token_ids),
            "hooks": {k: [HOOK_CALLS[k], round(v, 6)] for k, v in sorted(HOOK_SECONDS.items())},
        }

    warmup = [generate(ids) for ids in args.get("warmup", [])]
    requests = [generate(ids) for ids in args["prompts"]]
    # the same prompts again in this process: vLLM's own prefix cache serves their full blocks, so this is what a
    # connector's load could at best achieve (no connector cost at all)
    repeats = [generate(ids) for ids in args["prompts"]] if args.get("repeat") else []
    result = {
        "pid": os.getpid(),
        "import_s": import_s,
        "startup_s": startup_s,
        "warmup": warmup,
        "requests": requests,
        "repeats": repeats,
        "num_gpu_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
