"""`kvseal namespaces` (list, --json, purge) against a real engine with an SSD tier, and `kvseal ssd inspect` on
the stopped engine's directory: the CLI as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from conftest import REPO, save_blocks, wait_until

from kvseal.client import EngineClient
from kvseal.memfd import SharedArray
from kvseal.proto import kvseal_pb2 as pb
from kvseal.proto import kvseal_pb2_grpc as pb_grpc
from kvseal.testing import EngineProcess, free_port, register_one_rank

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


def _register(
    client: EngineClient, instance: str, layers: list[str], dtype: str = "uint8", block_size: int = 16
) -> str:
    """Seals an instance of one worker whose layers are `layers` (4 KiB blocks); returns its namespace_final."""
    shared = SharedArray((len(layers), 4, 4096))
    views = {name: shared.array[i] for i, name in enumerate(layers)}
    status = register_one_rank(
        client, instance, shared, views, namespace="llama", layout_tag="t", dtype=dtype, block_size=block_size
    )
    return status.namespace_final


def test_compare_names_the_drafter_layer_and_the_fields_that_differ(engine: EngineProcess) -> None:
    """Operators ask why two final namespaces cannot share blocks: over HTTP, gRPC (also with another engine's
    descriptor) and `kvseal namespaces compare`; the drafter layer of an MTP deployment is named."""
    base = ["model.layers.0.attn", "model.layers.1.attn"]
    http = engine.http.removeprefix("http://")
    with EngineClient(engine.target, timeout=30) as client:
        plain = _register(client, "plain", base)
        mtp = _register(client, "mtp", [*base, "model.layers.2.mtp.attn"])
        other = _register(client, "other", base, dtype="float16", block_size=32)
        twin = _register(client, "twin", base)
        assert twin == plain and len({plain, mtp, other}) == 3

        r = kvseal("namespaces", "compare", plain, mtp, "--http", http)
        assert (r.returncode, r.stdout.strip()) == (
            1,
            f"{plain} and {mtp}: incompatible: layer 'model.layers.2.mtp.attn' only in {mtp}",
        )
        r = kvseal("namespaces", "compare", plain, twin, "--http", http)
        assert (r.returncode, r.stdout.strip()) == (0, f"{plain} and {plain}: compatible")

        code, body = engine.get(f"/v1/compatibility?a={plain}&b={other}")
        answer = json.loads(body)
        assert code == 200 and not answer["compatible"]
        assert answer["differences"] == [
            {"field": "block_size", "layer": "", "a": 16, "b": 32},
            {"field": "dtype", "layer": "model.layers.0.attn", "a": "uint8", "b": "float16"},
            {"field": "dtype", "layer": "model.layers.1.attn", "a": "uint8", "b": "float16"},
        ]
        assert answer["message"] == (
            f"block_size: {plain} 16, {other} 32; layer 'model.layers.0.attn' dtype: {plain} 'uint8', {other} "
            f"'float16'; layer 'model.layers.1.attn' dtype: {plain} 'uint8', {other} 'float16'"
        )

        # another engine's descriptor (what P/D parameters carry), over gRPC
        descriptor = next(ns["descriptor"] for ns in engine.get_json("/v1/namespaces") if ns["namespace"] == mtp)
        assert {i["instance_id"]: i["descriptor"] for i in engine.get_json("/v1/instances")}["mtp"] == descriptor
        stub = pb_grpc.EngineStub(grpc.insecure_channel(engine.target))
        answer = stub.Compare(pb.CompareRequest(namespace_final=plain, other_descriptor=descriptor.encode()))
        assert not answer.compatible and answer.message == "layer 'model.layers.2.mtp.attn' only in the other"
        assert [(d.field, d.layer, d.left, d.right) for d in answer.differences] == [
            ("layer", "model.layers.2.mtp.attn", "", "model.layers.2.mtp.attn")
        ]
        for request, code, text in [
            (pb.CompareRequest(namespace_final="nope.12345678", other_namespace_final=plain), "NOT_FOUND", "nope"),
            (pb.CompareRequest(namespace_final=plain, other_descriptor=b"{}"), "INVALID_ARGUMENT", "other_descriptor"),
            (pb.CompareRequest(namespace_final=plain), "INVALID_ARGUMENT", "other_namespace_final"),
        ]:
            with pytest.raises(grpc.RpcError) as e:
                stub.Compare(request)
            assert e.value.code().name == code and text in e.value.details()
    assert engine.get("/v1/compatibility?a=x")[0] == 400
    assert engine.get(f"/v1/compatibility?a={plain}&b=nope.12345678")[0] == 404
