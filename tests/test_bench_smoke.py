"""`kvseal bench engine --quick` runs end to end and ends with a well-formed RESULT line (no speed assertions)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

RESULT_KEYS = (
    "save_gbps",
    "load_gbps",
    "memcpy_gbps",
    "save_ratio",
    "load_ratio",
    "query_p50_us",
    "query_1m_vs_1k",
    "bytes_per_block",
)


@pytest.mark.process
@pytest.mark.timeout(180)
def test_quick_engine_benchmark_prints_a_result_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvseal", "bench", "engine", "--quick"],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    last = proc.stdout.strip().splitlines()[-1]
    head, *pairs = last.split(" ")
    assert head == "RESULT", last
    values = dict(pair.split("=", 1) for pair in pairs)
    assert tuple(values) == RESULT_KEYS, last
    for key, text in values.items():
        number = float(text)
        assert math.isfinite(number) and number > 0, f"{key}={text} in {last}"
