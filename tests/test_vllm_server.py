"""vLLM's OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`, its default process layout:
API server, EngineCore and Worker processes) with KVSealConnector against a real `kvseal serve`: a repeated
completion is served from kvseal. vLLM's own prefix cache is off, so every cached token comes from the engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest
from conftest import EngineProcess, free_port, http_get
from prometheus_client.parser import text_string_to_metric_families
from vllm_support import prompts, shared_model, vllm_env

pytestmark = pytest.mark.process

BLOCK = 128
START_TIMEOUT_S = 240.0  # the server imports vLLM in three processes; ~40-90 s on 2 busy CPUs
STOP_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_model(tmp_path_factory, layers=4)


class VllmServer:
    """One `python -m vllm.entrypoints.openai.api_server` subprocess (in its own process group, so that its
    EngineCore and Worker children go with it), logging to a file."""

    def __init__(self, model: Path, engine_target: str, log_path: Path) -> None:
        self.model = str(model)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        transfer = {
            "kv_connector": "KVSealConnector",
            "kv_connector_module_path": "kvseal.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"kvseal.engine": engine_target},
        }
        args = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--port",
            str(self.port),
            "--host",
            "127.0.0.1",
            "--dtype",
            "float32",
            "--block-size",
            str(BLOCK),
            "--max-model-len",
            "2048",
            "--enforce-eager",
            "--enable-prompt-tokens-details",
            "--no-enable-prefix-caching",
            "--kv-transfer-config",
            json.dumps(transfer),
        ]
        env = vllm_env()
        # the server's real layout: EngineCore (scheduler-side connector) and Worker (worker-side connector) in their
        # own processes, so the connector metadata crosses a process boundary as in a deployment
        del env["VLLM_ENABLE_V1_MULTIPROCESSING"]
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.stopped = False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def fail(self, what: str) -> NoReturn:
        pytest.fail(f"{what}\n--- vLLM server log (tail) ---\n{self.log()[-12000:]}", pytrace=False)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                self.fail(f"vLLM server exited with {self.proc.returncode} while starting")
            try:
                if http_get(f"{self.base}/health", timeout=2.0)[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.fail(f"vLLM server not healthy after {START_TIMEOUT_S}s")
            time.sleep(0.5)  # poll interval of a bounded wait on a real condition

    def complete(self, prompt: list[int]) -> dict[str, Any]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
        request = urllib.request.Request(
            f"{self.base}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                return json.loads(response.read())
        except (urllib.error.URLError, OSError) as e:
            self.fail(f"completion failed: {e!r} (server exit code {self.proc.poll()})")

    def metric_total(self, name: str) -> float:
        status, body = http_get(f"{self.base}/metrics")
        assert status == 200, status
        values = [
            sample.value
            for family in text_string_to_metric_families(body.decode())
            for sample in family.samples
            if sample.name == name
        ]
        if not values:
            self.fail(f"{name} not in vLLM's /metrics")
        return sum(values)

    def stop(self) -> int:
        """SIGTERM to the server, then SIGKILL to its process group if it does not exit; returns its exit code."""
        self.stopped = True
        if self.proc.poll() is not None:
            return self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.fail(f"vLLM server ignored SIGTERM for {STOP_TIMEOUT_S}s and was killed")
        finally:
            self._reap_group()

    def _reap_group(self) -> None:
        """The EngineCore/Worker children (and multiprocessing's resource tracker, which cleans up shared memory)
        exit after the server: wait for the process group to empty, then SIGKILL what is left of it."""
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)  # poll interval of a bounded wait on a real condition
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def vllm_server(tmp_path: Path) -> Iterator[Callable[[Path, str], VllmServer]]:
    started: list[VllmServer] = []

    def start(model: Path, engine_target: str) -> VllmServer:
        server = VllmServer(model, engine_target, tmp_path / f"vllm-server{len(started)}.log")
        started.append(server)
        server.wait_ready()
        return server

    yield start
    for server in started:
        if not server.stopped:
            server.stop()


@pytest.mark.timeout(480)
def test_repeated_completion_is_served_from_kvseal(
    engine_factory: Callable[..., EngineProcess], vllm_server: Callable[[Path, str], VllmServer], model: Path
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
