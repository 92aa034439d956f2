"""`kvseal namespaces` (list, --json, purge) against a real engine with an SSD tier, and `kvseal ssd inspect` on
the stopped engine's directory: the CLI as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import REPO, EngineProcess, free_port, save_blocks, wait_until

pytestmark = pytest.mark.process

BLOCKS = 16


def tagged(tag: str) -> list[bytes]:
    return [f"{tag}{i}".encode().ljust(32, b".") for i in range(BLOCKS)]


def kvseal(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvseal", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_namespaces_lists_purges_and_inspect_reads_the_directory(
    engine_factory: Callable[..., EngineProcess], tmp_path: Path
) -> None:
    ssd = tmp_path / "ssd"
    args = ("--ssd-path", str(ssd), "--ssd-capacity", "64MiB", "--ssd-segment-size", "8MiB", "--slab-size", "4MiB")
    engine = engine_factory(*args)
    http = engine.http.removeprefix("http://")
    keep = save_blocks(engine, "a", "keep", tagged("k"))
    drop = save_blocks(engine, "b", "drop", tagged("d"))
    wait_until(lambda: engine.metric("kvseal_ssd_records") == 2 * BLOCKS, 30, "the blocks to reach the SSD")

    listed = kvseal("namespaces", "--http", http)
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split()[:3] == ["NAMESPACE", "UID", "MEM"]
    assert sorted(r.split()[0] for r in rows) == sorted([keep, drop])
    as_json = json.loads(kvseal("namespaces", "--http", http, "--json").stdout)
    assert {(n["namespace"], n["resident_blocks"], n["ssd_blocks"]) for n in as_json} == {
        (keep, BLOCKS, BLOCKS),
        (drop, BLOCKS, BLOCKS),
    }

    purged = kvseal("namespaces", "purge", drop, "--http", http)
    assert purged.returncode == 0, purged.stderr
    assert purged.stdout.strip() == f"purged {drop} (uid 0): {BLOCKS} blocks from memory, {BLOCKS} from SSD"
    missing = kvseal("namespaces", "purge", "no.such", "--http", http)
    assert missing.returncode == 1 and "404" in missing.stderr and "no.such" in missing.stderr
    assert engine.stop() == []
    engine.expect_exit = True

    inspected = json.loads(kvseal("ssd", "inspect", str(ssd), "--verify", "--json").stdout)
    assert {n["namespace"]: n["records"] for n in inspected["namespaces"]} == {keep: BLOCKS, drop: 0}
    assert inspected["bad"] == {} and all(n["records"] == 0 or "checksum" not in n for n in inspected["namespaces"])
    table = kvseal("ssd", "inspect", str(ssd))
    assert table.returncode == 0 and f"{keep}  0    {BLOCKS}" in table.stdout

    restarted = engine_factory(*args)
    by_name = {n["namespace"]: n for n in restarted.get_json("/v1/namespaces")}
    assert by_name[keep]["ssd_blocks"] == BLOCKS and by_name.get(drop, {"ssd_blocks": 0})["ssd_blocks"] == 0


def test_namespaces_without_an_engine_and_purge_without_a_name_say_so() -> None:
    r = kvseal("namespaces", "--http", f"127.0.0.1:{free_port()}")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "no engine answers at" in r.stderr
    r = kvseal("namespaces", "purge")
    assert r.returncode == 2 and "name one final namespace" in r.stderr
    r = kvseal("ssd", "inspect", "/nonexistent/kvseal")
    assert r.returncode == 1 and "is not a directory" in r.stderr
