"""vLLM's OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`, its default process layout:
API server, EngineCore and Worker processes) with KVSealConnector against a real `kvseal serve`: a repeated
completion is served from kvseal. vLLM's own prefix cache is off, so every cached token comes from the engine."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import EngineProcess
from vllm_support import BLOCK, VllmServer, prompts, shared_model

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_model(tmp_path_factory, layers=4)


@pytest.mark.timeout(480)
def test_repeated_completion_is_served_from_kvseal(
    engine_factory: Callable[..., EngineProcess], vllm_server: Callable[..., VllmServer], model: Path
) -> None:
    engine = engine_factory()
    server = vllm_server(model, engine.target)
    [prompt] = prompts(seed=11, n=1, length=300)  # 2 full blocks + 44 tokens

    first = server.complete(prompt)
    second = server.complete(prompt)

    assert first["usage"]["prompt_tokens"] == 300
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # cold: nothing in the engine yet
    # vLLM's prefix cache is off: the two full blocks can only have come from kvseal
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 2 * BLOCK
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert len(first["choices"][0]["text"]) > 0

    [ns] = engine.get_json("/v1/namespaces")
    assert ns["resident_blocks"] >= 2
    assert ns["hits"] >= 2
    assert ns["num_layers"] == 4 and ns["block_size"] == BLOCK
    assert ns["refused"] == {}
    assert server.metric_total("vllm:external_prefix_cache_hits_total") >= 2 * BLOCK

    if server.proc.poll() is not None:
        server.fail(f"vLLM server died during the test (exit {server.proc.returncode})")
    rc = server.stop()
    if rc not in (0, -signal.SIGTERM):
        server.fail(f"vLLM server exited with {rc} after SIGTERM")
    # vLLM's own shutdown kills its EngineCore and logs an EngineDeadError traceback: judge the log before it
    serving = server.log().split("[shutdown]", 1)[0]
    for bad in ("Traceback", " ERROR ", "kvseal engine at"):  # the last: the connector lost the engine
        if bad in serving:
            server.fail(f"{bad!r} in the vLLM server log before shutdown")
