"""Runs offline vLLM (CPU, one process, eager) on token-id prompts and prints one JSON line with the outputs.

    python vllm_run.py '{"model": DIR, "prompts": [[ids...], ...], "engine": "127.0.0.1:50055" | null, ...}'

Keys: model, prompts, engine (null = no connector), namespace, mode, timeout_s, pd_timeout_s and sync_load_bytes
(kvseal.*), block_size (128), dtype (float32), max_tokens (8), connector ("KVSealConnector" or
"ExampleConnector"), storage (ExampleConnector's path), speculative (a dict), load_format, no_prefix_caching,
hash_algo (prefix_caching_hash_algo), logprobs (RESULT gets each output token's logprob), kv_role (kv_both),
kv_transfer_params (one dict or null per prompt: the request's P/D parameters), max_num_batched_tokens, interactive
(read prompts from stdin instead, answer with "STEP {...}" lines), record_block_ids (RESULT gets
"engine_block_ids": {"load": [...], "save": [...]}, every vLLM block id the connector's worker handed the engine:
EngineClient's calls are wrapped, not replaced).
Each prompt runs in its own generate() call, in order. Output: {"outputs": [[ids]...], "external_hits": N,
"seconds": [...], "kv_transfer_params": [...], "num_gpu_blocks": N} where external_hits is vLLM's own count of
tokens served by the connector, kv_transfer_params what each request finished with (a prefill's hand-over) and
num_gpu_blocks the KV blocks vLLM allocated (its KV capacity).
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    args = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs: dict = dict(
        model=args["model"],
        dtype=args.get("dtype", "float32"),
        block_size=args.get("block_size", 128),
        enable_prefix_caching=True,
        max_model_len=args.get("max_model_len", 2048),
        seed=0,
        enforce_eager=True,
        disable_log_stats=False,
    )
    if args.get("speculative"):
        kwargs["speculative_config"] = args["speculative"]
    if args.get("load_format"):
        kwargs["load_format"] = args["load_format"]
    connector = args.get("connector", "KVSealConnector")
    if connector == "ExampleConnector":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": args["storage"]},
        )
    elif args.get("engine"):
        extra = {"kvseal.engine": args["engine"]}
        for key in ("namespace", "mode", "timeout_s", "pd_timeout_s", "sync_load_bytes", "window_retention_tokens"):
            if args.get(key) is not None:
                extra[f"kvseal.{key}"] = args[key]
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVSealConnector",
            kv_connector_module_path="kvseal.vllm",
            kv_role=args.get("kv_role", "kv_both"),
            kv_connector_extra_config=extra,
        )
    if args.get("num_gpu_blocks"):  # a KV cache this small: vLLM's own prefix cache forgets soon
        kwargs["num_gpu_blocks_override"] = args["num_gpu_blocks"]
    if args.get("disable_hma"):  # vLLM's hybrid KV cache manager off: every window layer promoted to full attention
        kwargs["disable_hybrid_kv_cache_manager"] = True
    if args.get("no_prefix_caching"):
        kwargs["enable_prefix_caching"] = False
    if args.get("hash_algo"):
        kwargs["prefix_caching_hash_algo"] = args["hash_algo"]
    if args.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = args["max_num_batched_tokens"]
    handed_ids = record_block_ids() if args.get("record_block_ids") else None
    llm = LLM(**kwargs)
    params = SamplingParams(
        max_tokens=args.get("max_tokens", 8), temperature=0, logprobs=1 if args.get("logprobs") else None
    )
    if args.get("interactive"):
        serve_stdin(llm, params, TokensPrompt)
        return
    outputs, seconds, ttft, handed, logprobs, cached = [], [], [], [], [], []
    transfer = args.get("kv_transfer_params") or [None] * len(args["prompts"])
    for ids, kv_params in zip(args["prompts"], transfer, strict=True):
        start = time.perf_counter()
        request_params = params
        if kv_params is not None:
            request_params = params.clone()
            request_params.extra_args = {"kv_transfer_params": kv_params}
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], request_params, use_tqdm=False)[0]
        seconds.append(time.perf_counter() - start)
        outputs.append(list(out.outputs[0].token_ids))
        cached.append(out.num_cached_tokens or 0)  # vLLM's own prefix cache's and the connector's
        if out.outputs[0].logprobs is not None:  # the chosen token's, per step
            chosen = zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True)
            logprobs.append([step[token].logprob for token, step in chosen])
        handed.append(out.kv_transfer_params)
        if out.metrics is not None and getattr(out.metrics, "first_token_latency", None) is not None:
            ttft.append(out.metrics.first_token_latency)
    result = {
        "outputs": outputs,
        "external_hits": external_hits(llm),
        "seconds": seconds,
        "ttft": ttft,
        "kv_transfer_params": handed,
        "logprobs": logprobs,
        "cached_tokens": cached,
        "num_gpu_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
    }
    if handed_ids is not None:
        result["engine_block_ids"] = handed_ids
    print("RESULT " + json.dumps(result), flush=True)


def record_block_ids() -> dict[str, list[int]]:
    """Records the block ids every EngineClient.load / save (load_groups / save_groups: every table's) of this
    process hands the engine (the worker-side connector runs in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0),
    then makes the real call."""
    from kvseal.client import EngineClient

    seen: dict[str, list[int]] = {"load": [], "save": []}
    for name in seen:
        real = getattr(EngineClient, name)

        def wrapped(self, worker, hashes, block_ids, *rest, _real=real, _ids=seen[name], **kw):  # type: ignore[no-untyped-def]
            _ids.extend(block_ids)
            return _real(self, worker, hashes, block_ids, *rest, **kw)

        setattr(EngineClient, name, wrapped)
    for name, kind in (("save_groups", "save"), ("load_groups", "load")):  # a hybrid instance's: every table's ids
        real = getattr(EngineClient, name)

        def wrapped_runs(self, worker, runs, *rest, _real=real, _ids=seen[kind], **kw):  # type: ignore[no-untyped-def]
            _ids.extend(i for run in runs for ids in run.block_ids for i in ids)
            return _real(self, worker, runs, *rest, **kw)

        setattr(EngineClient, name, wrapped_runs)
    return seen


def external_hits(llm) -> int:  # type: ignore[no-untyped-def]
    """vLLM's own count of prompt tokens the connector provided."""
    for metric in llm.get_metrics():
        if metric.name == "vllm:external_prefix_cache_hits":
            return int(metric.value)
    return 0


def serve_stdin(llm, params, prompt_cls) -> None:  # type: ignore[no-untyped-def]
    """Interactive mode: one JSON prompt (token ids) per stdin line, one "STEP {...}" line per answer."""
    print("READY", flush=True)
    for line in sys.stdin:
        ids = json.loads(line)
        out = llm.generate([prompt_cls(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        step = {"output": list(out.outputs[0].token_ids), "external_hits": external_hits(llm)}
        print("STEP " + json.dumps(step), flush=True)


if __name__ == "__main__":
    main()
