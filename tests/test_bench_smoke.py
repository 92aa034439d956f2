"""The benchmarks run end to end in their quick form (no speed assertions): `kvseal bench engine --quick` ends
with a well-formed RESULT line whose figures are named after what it measured, not after the full run's targets,
on the base install (torch cannot be imported, neither by the benchmark nor by the engine it starts), names the
copy path and draws its plot, and
`kvseal bench store_ops --quick` prints its table with the cross-class stall, `kvseal bench cuda` on a machine without
a GPU says what it needs, and `kvseal bench ssd --quick` ends with its RESULT line and
leaves nothing in its directory."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvseal
from kvseal.peer.mooncake import INSTALL_PACKAGE

RESULT_KEYS = (
    "save_gbps",
    "load_gbps",
    "memcpy_gbps",
    "stream_gbps",
    "save_ratio",
    "load_ratio",
    "query_p50_us",
    "query_50k_vs_1k",  # the full run's query_1m_vs_1k: --quick fills 50k blocks, not 1M
    "bytes_per_block_50k",  # the full run's bytes_per_block, at 1M
    "max_lock_ms",
    "save_128k_ratio",
    "load_128k_ratio",
)
SMOKE_LINE = (
    "quick figures are smoke figures, not the targets': 16 blocks per RPC and 50k resident blocks here; the targets' "
    "run (without --quick) has 64 and 256 blocks per RPC and 1M resident"
)


@pytest.mark.process
@pytest.mark.timeout(180)
def test_quick_engine_benchmark_prints_a_result_line(tmp_path: Path) -> None:
    blocked = tmp_path / "no-torch" / "torch"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text('raise ImportError("torch is not part of the base install")\n')
    path = os.pathsep.join(p for p in (str(blocked.parent), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "kvseal", "bench", "engine", "--quick", "--plot", str(tmp_path / "copies.png")],
        capture_output=True,
        text=True,
        timeout=170,
        env=dict(os.environ, PYTHONPATH=path),
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = proc.stdout.strip().splitlines()
    assert lines.count(SMOKE_LINE) == 1, proc.stdout
    last = lines[-1]
    head, *pairs = last.split(" ")
    assert head == "RESULT", last
    values = dict(pair.split("=", 1) for pair in pairs)
    assert tuple(values) == RESULT_KEYS, last
    for key, text in values.items():
        number = float(text)
        assert math.isfinite(number) and number > 0, f"{key}={text} in {last}"
    # the kernel is built by the install, and chosen unless the environment says numpy
    assert (
        f"copies: {'numpy' if os.environ.get('KVSEAL_COPY') == 'numpy' else 'kernel (streaming stores)'}" in proc.stdout
    )
    assert (tmp_path / "copies.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.timeout(120)
def test_quick_store_ops_benchmark_prints_its_table() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvseal", "bench", "store_ops", "--quick"],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    for op in ("begin_save (evict)", "finish_save", "query", "release", "begin_load", "finish_load", "engine save"):
        assert any(line.startswith(op) for line in proc.stdout.splitlines()), proc.stdout
    stall = next(line for line in proc.stdout.splitlines() if line.startswith("cross-class stall"))
    assert " steps " in stall and "the longest" in stall, stall


@pytest.mark.timeout(60)
def test_cuda_benchmark_without_a_gpu_says_what_it_needs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvseal", "bench", "cuda", "--quick"], capture_output=True, text=True, timeout=50
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "kvseal bench cuda needs a CUDA device; torch 2.13.0+cpu sees none" in proc.stderr
    assert "RESULT" not in proc.stdout


def test_plot_usage_errors_say_what_to_do(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvseal", "bench", "ssd", "--plot", str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 2 and "--plot is for `kvseal bench engine`" in proc.stderr
    blocked = tmp_path / "no-matplotlib" / "matplotlib"  # the base install has no matplotlib
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text('raise ImportError("matplotlib is an extra")\n')
    proc = subprocess.run(
        [sys.executable, "-m", "kvseal", "bench", "engine", "--quick", "--plot", str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
        timeout=50,
        env=dict(os.environ, PYTHONPATH=str(blocked.parent)),
    )
    assert proc.returncode == 2 and "--plot needs matplotlib: pip install 'kvseal[plot]'" in proc.stderr
    assert not (tmp_path / "x.png").exists()


def _quick_result(proc: subprocess.CompletedProcess[str]) -> dict[str, float]:
    """The figures of a --quick benchmark's last line, which must be a RESULT line; the run said it was quick."""
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "quick: smoke figures on small sizes, not the targets' measurement" in proc.stdout
    head, *pairs = proc.stdout.strip().splitlines()[-1].split(" ")
    assert head == "RESULT"
    return {k: float(v) for k, v in (pair.split("=", 1) for pair in pairs)}


@pytest.mark.process
@pytest.mark.timeout(240)
def test_quick_ssd_benchmark_prints_a_result_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvseal", "bench", "ssd", "--quick", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=230,
    )
    values = _quick_result(proc)
    assert list(values) == [
        "ssd_write_gbps",
        "ssd_read_gbps",
        "dd_write_gbps",
        "dd_read_gbps",
        "write_ratio",
        "read_ratio",
        "recovery_s_per_m",
        "scan_s_per_m",
        "save_with_ssd_ratio",
    ]
    assert all(math.isfinite(v) and v > 0 for v in values.values()), values
    assert list(tmp_path.iterdir()) == []  # its files are gone


@pytest.mark.process
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mooncake", [True, False], ids=["with Mooncake", "without Mooncake"])
def test_quick_peer_benchmark_prints_a_result_line(mooncake: bool, tmp_path: Path) -> None:
    """Without Mooncake Transfer Engine (an import of `mooncake` that fails, as where it is not installed), one
    line says its column is not measured and why, and the rest is measured: no traceback."""
    env = dict(os.environ)
    if not mooncake:
        (tmp_path / "mooncake").mkdir()
        (tmp_path / "mooncake" / "__init__.py").write_text("raise ImportError(\"No module named 'mooncake'\")\n")
        env["PYTHONPATH"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "kvseal", "bench", "peer", "--quick"],
        capture_output=True,
        text=True,
        timeout=230,
        env=env,
    )
    if not mooncake:
        assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
        (line,) = [line for line in proc.stdout.splitlines() if "not measured (" in line]
        assert line == f"  Mooncake TCP: not measured (Mooncake Transfer Engine is not installed: {INSTALL_PACKAGE})"
        values = dict(kv.split("=") for kv in proc.stdout.splitlines()[-1].split()[1:])
        assert values.pop("mooncake_tcp_gbps") == values.pop("peer_vs_mooncake") == "nan"
        assert all(math.isfinite(float(v)) and float(v) > 0 for v in values.values()), values
        return
    values = _quick_result(proc)
    assert list(values) == [
        "peer_gbps",
        "memcpy_gbps",
        "mooncake_tcp_gbps",
        "peer_vs_memcpy",
        "peer_vs_mooncake",
        "metaquery_p50_us",
        "metaquery_floor_us",
        "peer_vs_tcp",
    ]
    assert all(math.isfinite(v) and v > 0 for v in values.values()), values


def test_every_benchmark_is_a_kvseal_bench_subcommand() -> None:
    """Every module of kvseal/bench is a `kvseal bench NAME` subcommand with a main(), except the processes the
    benchmarks start themselves and the modules they import (the shared harness, the engine benchmark's cases, the
    replayed workload, the hit-ratio simulator, the baseline install);
    there is no other place for benchmarks."""
    import importlib

    from kvseal.cli import build_parser

    bench = next(a for a in build_parser()._subparsers._group_actions if "bench" in a.choices).choices["bench"]
    names = set(next(a for a in bench._subparsers._group_actions).choices)
    package = Path(importlib.import_module("kvseal.bench").__file__).parent
    helpers = {
        "__init__",
        "harness",
        "engine_cases",
        "vllm_ttft_run",
        "vllm_ttft_model",
        "workload",
        "hitsim",
        "baseline",
    }
    modules = {p.stem for p in package.glob("*.py")} - helpers
    assert names == modules
    for name in sorted(names):
        assert callable(importlib.import_module(f"kvseal.bench.{name}").main), name
    assert not (package.parent.parent / "bench").exists()


OPS_KEYS = (
    "query_1024_vs_ping",
    "save_1024_vs_ping",
    "load_1024_vs_ping",
    "two_clients_ratio",
    "replay16_rps",
    "replay512_rps",
    "loop_vs_baseline",
    "replay16_vs_baseline",
    "replay512_vs_baseline",
)


@pytest.mark.process
@pytest.mark.timeout(300)
def test_quick_ops_benchmark_measures_a_baseline_too(tmp_path: Path) -> None:
    """`kvseal bench ops --quick --baseline HEAD`: the baseline engine installed from git into a temporary venv
    answers like this one, the RESULT line names every figure, and this environment's kvseal is still installed
    (pip installing into another prefix once uninstalled it)."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvseal", "bench", "ops", "--quick", "--baseline", "HEAD"],
        capture_output=True,
        text=True,
        timeout=290,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    last = proc.stdout.strip().splitlines()[-1]
    head, *pairs = last.split(" ")
    values = dict(pair.split("=", 1) for pair in pairs)
    assert head == "RESULT" and tuple(values) == OPS_KEYS, last
    assert all(math.isfinite(float(v)) and float(v) > 0 for v in values.values()), last
    assert "HEAD:" in proc.stdout and "now:" in proc.stdout, proc.stdout
    found = subprocess.run(
        [sys.executable, "-c", "import kvseal; print(kvseal.__file__)"],
        cwd=tmp_path,
        text=True,
        capture_output=True,
        timeout=60,
    )
    assert found.returncode == 0 and found.stdout.strip() == str(Path(kvseal.__file__)), found.stderr


def test_the_replayed_workload_is_the_same_every_time_and_shares_prefixes() -> None:
    from kvseal.bench.workload import Workload

    small = Workload(conversations=20, system_prompts=3)
    first = small.requests(16)
    assert first == small.requests(16) and len(first) >= 20
    assert all(len(h) == 32 for request in first for h in request)
    starts = [request[0] for request in first if request]
    assert len(set(starts)) <= 3  # every prompt starts with one of the system prompts' first block
    coarse = small.requests(512)
    assert sum(map(len, coarse)) * 32 <= sum(map(len, first)) <= sum(map(len, coarse)) * 32 + 31 * len(first)


@pytest.mark.timeout(120)
def test_quick_hitrate_benchmark_prints_a_result_line() -> None:
    """`kvseal bench hitrate --quick` prints its tables and a RESULT line of finite figures, and the real engine's
    replay hit exactly what the simulation of its policy says."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvseal", "bench", "hitrate", "--quick"],
        capture_output=True,
        text=True,
        timeout=110,
    )
    values = _quick_result(proc)
    for key in (
        "default_vs_prefixlru_min",
        "default_vs_prefixlru_5pct",
        "best_vs_prefixlru_5pct",
        "belady_vs_prefixlru_5pct",
    ):
        assert key in values, values
    assert all(math.isfinite(v) and v > 0 for v in values.values()), values
    assert values["engine_matches_sim"] == 1.0, proc.stdout
