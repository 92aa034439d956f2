"""Process-level tests: a real `kvseal serve` subprocess and worker processes whose KV tensors live in shared
memory (docs/design.md §1-§4). Everything goes through the real gRPC and HTTP servers."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import REPO, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc
from workers import LayerDef, Worker, attn_layers

from kvseal import memfd
from kvseal.client import EngineClient
from kvseal.errors import FailedPrecondition, InvalidArgument, NotFound, Unauthenticated
from kvseal.proto import kvseal_pb2 as pb
from kvseal.testing import EngineProcess, free_port, serve_command

pytestmark = pytest.mark.process

NAMESPACE = "tiny-llama"
HASHES = [hashlib.sha256(f"block-{i}".encode()).digest() for i in range(8)]
A_BLOCKS = [3, 7, 0, 12, 31, 5, 9, 20]
B_BLOCKS = [1, 2, 4, 6, 8, 10, 11, 13]
UNTOUCHED = 30  # a block no test loads into
LOADED = pb.LoadResponse.LOADED
MISSING = pb.LoadResponse.MISSING
WAIT_S = 30.0


@pytest.fixture
def spawn(engine_factory: Callable[..., EngineProcess]) -> Iterator[Callable[..., list[Worker]]]:
    """spawn(target, n, token=None) -> n worker processes (booting in parallel); closed before the engine stops."""
    started: list[Worker] = []

    def start(target: str, n: int = 1, token: str | None = None) -> list[Worker]:
        new = [Worker.start(target, token, name=f"worker{len(started) + i}") for i in range(n)]
        started.extend(new)
        return new

    yield start
    for w in started:
        w.close()


def register_tp(
    workers: Sequence[Worker],
    instance_id: str,
    layers_per_rank: Sequence[Sequence[LayerDef]],
    *,
    namespace: str = NAMESPACE,
    seed: int = 0,
    one_allocation: bool = False,
) -> Any:
    """Registers workers[r] as tp_rank r (world_size = tp_size = len(workers)); returns the sealing status."""
    tp = len(workers)
    status = None
    for rank, (w, layers) in enumerate(zip(workers, layers_per_rank, strict=True)):
        status = w.register(
            instance_id=instance_id,
            namespace=namespace,
            tp_rank=rank,
            tp_size=tp,
            world_size=tp,
            layers=layers,
            seed=seed * 100 + rank,
            one_allocation=one_allocation,
        )
        assert status.registered == rank + 1 and status.world_size == tp
        assert status.sealed == (rank == tp - 1)
    return status


def save_all(workers: Sequence[Worker], hashes: Sequence[bytes], block_ids: Sequence[int]) -> str:
    """Every worker saves its slots of `hashes`; returns the namespace_final the saves were stored under."""
    completed = 0
    finals = set()
    for w in workers:
        r = w.save(hashes, block_ids)
        assert (r.written, r.skipped, r.not_stored) == (len(hashes), 0, 0), r
        completed += r.completed
        finals.add(r.namespace_final)
    assert completed == len(hashes)  # pages seal when the last rank's slots are in
    (final,) = finals
    return final


def load_all(workers: Sequence[Worker], hashes: Sequence[bytes], block_ids: Sequence[int], lease: int) -> None:
    for w in workers:
        r = w.load(hashes, block_ids, lease)
        assert (r.outcome, r.loaded) == (LOADED, len(hashes)), r


def instance_view(engine: EngineProcess, instance_id: str) -> dict[str, Any] | None:
    return next((i for i in engine.get_json("/v1/instances") if i["instance_id"] == instance_id), None)


def assert_sealed_status(status: Any, namespace: str = NAMESPACE) -> None:
    assert status.sealed
    assert re.fullmatch(r"[0-9a-f]{64}", status.digest)
    assert status.fingerprint == status.digest[:8]
    assert status.namespace_final == f"{namespace}.{status.fingerprint}"


# -------------------------------------------------------------------- sharing between instances


def test_tp2_instances_share_blocks_byte_exact(engine: EngineProcess, spawn: Callable[..., list[Worker]]) -> None:
    a0, a1, b0, b1 = spawn(engine.target, 4)
    layers = attn_layers(4)
    status_a = register_tp([a0, a1], "A", [layers, layers], seed=1)
    assert_sealed_status(status_a)
    slot = 2 * 16 * 32 * 2  # [heads, block_size, 2 * head_size] float16 per rank
    assert (status_a.num_layers, status_a.page_bytes) == (4, 4 * 2 * slot)
    assert save_all([a0, a1], HASHES, A_BLOCKS) == status_a.namespace_final
    saved = {0: a0.read(A_BLOCKS), 1: a1.read(A_BLOCKS)}

    # B: same layout, layers registered in other orders, all views into one allocation, other block ids
    shuffled = layers[:]
    random.Random(7).shuffle(shuffled)
    assert shuffled not in (layers, layers[::-1])
    status_b = register_tp([b0, b1], "B", [layers[::-1], shuffled], seed=2, one_allocation=True)
    assert status_b.namespace_final == status_a.namespace_final
    assert status_b.digest == status_a.digest
    before = {0: b0.read([*B_BLOCKS, UNTOUCHED]), 1: b1.read([*B_BLOCKS, UNTOUCHED])}
    for rank in (0, 1):
        for name, blocks in saved[rank].items():
            assert all(blocks[j] != before[rank][name][j] for j in range(8)), "B's KV must start out different"

    q = b0.query(HASHES)
    assert q.hits == 8 and q.lease_id > 0
    assert q.namespace_final == status_a.namespace_final
    load_all([b0, b1], HASHES, B_BLOCKS, q.lease_id)

    after = {0: b0.read([*B_BLOCKS, UNTOUCHED]), 1: b1.read([*B_BLOCKS, UNTOUCHED])}
    for rank in (0, 1):
        assert set(after[rank]) == {layer.name for layer in layers}
        for name in after[rank]:
            assert after[rank][name][:8] == saved[rank][name], f"tp_rank {rank} {name}: bytes differ"
            assert after[rank][name][8] == before[rank][name][8], f"tp_rank {rank} {name}: block {UNTOUCHED} changed"
    assert engine.metric("kvseal_resident_blocks") == 8


def test_save_and_query_before_registration_completes(
    engine: EngineProcess, spawn: Callable[..., list[Worker]]
) -> None:
    a0, a1 = spawn(engine.target, 2)
    layers = attn_layers(4)
    status = a0.register(
        instance_id="A", namespace=NAMESPACE, tp_rank=0, tp_size=2, world_size=2, layers=layers, seed=1
    )
    assert (status.sealed, status.registered, status.world_size, status.namespace_final) == (False, 1, 2, "")
    with pytest.raises(FailedPrecondition, match="registration incomplete: 1/2"):
        a0.save(HASHES, A_BLOCKS)
    with pytest.raises(FailedPrecondition, match="registration incomplete: 1/2"):
        a0.query(HASHES)
    with pytest.raises(FailedPrecondition, match="registration incomplete: 1/2"):
        a0.load(HASHES, A_BLOCKS)
    view = instance_view(engine, "A")
    assert view is not None and (view["sealed"], view["registered"], view["world_size"]) == (False, 1, 2)

    status = a1.register(
        instance_id="A", namespace=NAMESPACE, tp_rank=1, tp_size=2, world_size=2, layers=layers, seed=2
    )
    assert_sealed_status(status)
    save_all([a0, a1], HASHES, A_BLOCKS)
    assert a0.query(HASHES).hits == 8


def test_extra_mtp_layer_gets_its_own_namespace(engine: EngineProcess, spawn: Callable[..., list[Worker]]) -> None:
    a0, a1, c0, c1 = spawn(engine.target, 4)
    layers = attn_layers(4)
    status_a = register_tp([a0, a1], "A", [layers, layers], seed=1)
    save_all([a0, a1], HASHES, A_BLOCKS)

    with_mtp = attn_layers(5)  # model.layers.4.self_attn.attn: the drafter layer, named like a target layer
    assert with_mtp[4].name == "model.layers.4.self_attn.attn"
    status_c = register_tp([c0, c1], "C", [with_mtp, with_mtp], seed=3)
    assert_sealed_status(status_c)
    assert status_c.num_layers == 5
    assert status_c.namespace_final != status_a.namespace_final
    assert status_c.namespace_final.rsplit(".", 1)[0] == NAMESPACE

    q = c0.query(HASHES)
    assert (q.hits, q.lease_id, q.namespace_final) == (0, 0, status_c.namespace_final)
    r = c0.load(HASHES, B_BLOCKS)
    assert (r.outcome, r.loaded) == (MISSING, 0)
    assert a0.query(HASHES).hits == 8  # A's blocks are still there, for A


def test_fp16_and_bf16_pages_never_meet(engine: EngineProcess, spawn: Callable[..., list[Worker]]) -> None:
    x, y = spawn(engine.target, 2)
    fp16 = attn_layers(4, dtype="float16")
    bf16 = attn_layers(4, dtype="bfloat16")  # same bytes per block, same layout tag, other meaning
    status_x = register_tp([x], "X", [fp16], seed=1)
    status_y = register_tp([y], "Y", [bf16], seed=2)
    assert_sealed_status(status_x)
    assert_sealed_status(status_y)
    assert status_x.page_bytes == status_y.page_bytes
    assert status_x.namespace_final != status_y.namespace_final

    save_all([x], HASHES, A_BLOCKS)
    assert y.query(HASHES).hits == 0
    # Y saving the same hashes stores its own pages: no dedup across layouts
    save_all([y], HASHES, B_BLOCKS)
    assert x.query(HASHES).hits == 8 and y.query(HASHES).hits == 8
    r = y.load(HASHES, A_BLOCKS)
    assert (r.outcome, r.loaded) == (LOADED, 8)
    assert y.read(A_BLOCKS) == y.read(B_BLOCKS)  # Y got its own bytes back, not X's
    assert x.read(A_BLOCKS) != y.read(A_BLOCKS)

    by_name = {ns["namespace"]: ns for ns in engine.get_json("/v1/namespaces")}
    assert set(by_name) == {status_x.namespace_final, status_y.namespace_final}
    nx, ny = by_name[status_x.namespace_final], by_name[status_y.namespace_final]
    assert nx["fingerprint"] != ny["fingerprint"]
    assert (nx["digest"], ny["digest"]) == (status_x.digest, status_y.digest)
    assert nx["client_namespace"] == ny["client_namespace"] == NAMESPACE
    assert nx["resident_blocks"] == ny["resident_blocks"] == 8


# -------------------------------------------------------------------- liveness and leases


def test_sigkill_of_a_worker_drops_its_instance_and_leases(
    engine: EngineProcess, spawn: Callable[..., list[Worker]]
) -> None:
    a0, a1, b0, b1 = spawn(engine.target, 4)
    layers = attn_layers(4)
    status_a = register_tp([a0, a1], "A", [layers, layers], seed=1)
    assert status_a.sealed and a0.session_alive() and a1.session_alive()
    save_all([a0, a1], HASHES, A_BLOCKS)
    saved = {0: a0.read(A_BLOCKS), 1: a1.read(A_BLOCKS)}
    register_tp([b0, b1], "B", [layers, layers[::-1]], seed=2)

    q = a0.query(HASHES)  # a lease A never consumes
    assert q.hits == 8 and q.lease_id > 0
    assert engine.metric("kvseal_leases") == 1
    assert engine.metric("kvseal_workers") == 4

    a0.kill()

    def a_dropped() -> bool:
        view = instance_view(engine, "A")
        return (
            view is not None
            and (view["sealed"], view["registered"]) == (False, 1)
            and engine.metric("kvseal_leases") == 0
        )

    wait_until(a_dropped, WAIT_S, "the engine to drop A's killed worker and its lease")
    assert engine.alive()
    assert engine.metric("kvseal_workers") == 3
    with pytest.raises(FailedPrecondition, match="registration incomplete: 1/2"):
        a1.query(HASHES)

    q = b0.query(HASHES)
    assert q.hits == 8
    load_all([b0, b1], HASHES, B_BLOCKS, q.lease_id)
    assert b0.read(B_BLOCKS) == saved[0]
    assert b1.read(B_BLOCKS) == saved[1]
    assert engine.metric("kvseal_leases") == 0


def test_lease_released_once_every_worker_loaded(engine: EngineProcess, spawn: Callable[..., list[Worker]]) -> None:
    a0, a1, b0, b1 = spawn(engine.target, 4)
    layers = attn_layers(4)
    register_tp([a0, a1], "A", [layers, layers], seed=1)
    save_all([a0, a1], HASHES, A_BLOCKS)
    register_tp([b0, b1], "B", [layers, layers], seed=2)

    q = b1.query(HASHES)
    assert q.hits == 8 and q.lease_id > 0 and q.lease_ttl_ms > 0
    assert engine.metric("kvseal_leases") == 1
    assert engine.metric("kvseal_pool_used_bytes", state="pinned") == 8 * 16384
    r = b0.load(HASHES, B_BLOCKS, q.lease_id)
    assert (r.outcome, r.loaded) == (LOADED, 8)
    assert engine.metric("kvseal_leases") == 1  # tp_rank 1 has not loaded yet
    r = b1.load(HASHES, B_BLOCKS, q.lease_id)
    assert (r.outcome, r.loaded) == (LOADED, 8)
    assert engine.metric("kvseal_leases") == 0
    assert engine.metric("kvseal_pool_used_bytes", state="pinned") == 0

    with engine.client() as client:
        with pytest.raises(NotFound, match=f"lease_id {q.lease_id} "):
            client.release("B", q.lease_id)  # consumed: already gone
        with pytest.raises(NotFound, match="lease_id 987654321 "):
            client.release("B", 987654321)
        q2 = client.query("B", HASHES[:3])
        assert q2.hits == 3 and engine.metric("kvseal_leases") == 1
        with pytest.raises(NotFound):
            client.release("A", q2.lease_id)  # another instance's lease
        client.release("B", q2.lease_id)
        assert engine.metric("kvseal_leases") == 0


# -------------------------------------------------------------------- HTTP and health


def test_http_views_and_metrics(engine: EngineProcess, spawn: Callable[..., list[Worker]]) -> None:
    (w,) = spawn(engine.target, 1)
    status = register_tp([w], "solo", [attn_layers(2)], namespace="ns-http", seed=1)
    save_all([w], HASHES[:4], A_BLOCKS[:4])
    assert w.query(HASHES[:6]).hits == 4  # 4 hits, 2 misses (the lease expires or is dropped with the worker)

    (ns,) = engine.get_json("/v1/namespaces")
    expected_types = {
        "namespace": str,
        "client_namespace": str,
        "fingerprint": str,
        "digest": str,
        "block_size": int,
        "tp_size": int,
        "num_layers": int,
        "resident_blocks": int,
        "resident_bytes": int,
        "hits": int,
        "misses": int,
        "refused": dict,
        "last_used": (int, float),
        "what_if": dict,
    }
    for key, kind in expected_types.items():
        assert isinstance(ns[key], kind), (key, ns)
    assert ns["namespace"] == status.namespace_final
    assert ns["client_namespace"] == "ns-http"
    assert ns["fingerprint"] == status.fingerprint and re.fullmatch(r"[0-9a-f]{64}", ns["digest"])
    assert (ns["block_size"], ns["tp_size"], ns["num_layers"]) == (16, 1, 2)
    assert (ns["resident_blocks"], ns["resident_bytes"]) == (4, 4 * status.page_bytes)
    assert (ns["hits"], ns["misses"], ns["refused"]) == (4, 2, {})
    assert ns["last_used"] > 0
    # nothing evicted: a larger pool would hit the same 4 of 6; the 2 misses are 2 distinct blocks
    what_if = ns["what_if"]
    assert what_if.pop("distinct_blocks") == 2 and what_if.pop("ghost_blocks") == 0
    assert what_if == pytest.approx(
        {"hit_ratio": 4 / 6, "hit_ratio_2x": 4 / 6, "hit_ratio_4x": 4 / 6, "hit_ratio_unbounded": 4 / 6}
    )

    text = engine.metrics_text()
    for name in ("kvseal_resident_blocks", "kvseal_pool_free_bytes", "kvseal_hits_total", "kvseal_rpc_seconds"):
        assert re.search(rf"^{name}[ {{_]", text, re.M), name
    assert engine.metric("kvseal_resident_blocks") == 4
    assert engine.metric("kvseal_hits_total", namespace=status.namespace_final) == 4
    assert engine.metric("kvseal_misses_total", namespace=status.namespace_final) == 2
    for pool in ("1x", "2x", "4x", "unbounded"):
        assert engine.metric("kvseal_what_if_hit_ratio", namespace=status.namespace_final, pool=pool) == pytest.approx(
            4 / 6
        )
    assert engine.metric("kvseal_distinct_blocks", namespace=status.namespace_final) == 2
    assert engine.metric("kvseal_pool_free_bytes") == engine.metric("kvseal_pool_bytes") - 4 * status.page_bytes
    # the worker's client saves over the local lane
    assert engine.metric("kvseal_rpc_seconds_count", method="lane.Save", code="OK") == 1

    (inst,) = engine.get_json("/v1/instances")
    assert inst["instance_id"] == "solo"
    assert (inst["sealed"], inst["registered"], inst["world_size"]) == (True, 1, 1)
    assert inst["namespace_final"] == status.namespace_final and inst["digest"] == status.digest

    code, body = engine.get("/nope")
    assert code == 404 and json.loads(body)["error"]


def test_grpc_health_serving(engine: EngineProcess) -> None:
    with grpc.insecure_channel(engine.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvseal.v1.Engine"):
            r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert r.status == health_pb2.HealthCheckResponse.SERVING


# -------------------------------------------------------------------- listening and auth


@pytest.fixture
def short_tmp() -> Iterator[str]:
    """A short directory under /tmp (unix socket paths are limited to 107 bytes); request it before the engine so
    it outlives it."""
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="kvseal-") as tmp:
        yield tmp


def test_unix_socket_listen(
    short_tmp: str, engine_factory: Callable[..., EngineProcess], spawn: Callable[..., list[Worker]]
) -> None:
    sock = os.path.join(short_tmp, "kvseal.sock")
    engine = engine_factory(listen=f"unix:{sock}")
    st = os.stat(sock)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    with EngineClient(f"unix:{sock}") as client:
        with pytest.raises(NotFound):
            client.query("nobody", HASHES)
    (w,) = spawn(f"unix:{sock}", 1)
    register_tp([w], "U", [attn_layers(2)], seed=1)
    save_all([w], HASHES, A_BLOCKS)
    assert w.query(HASHES).hits == 8
    assert engine.get_json("/v1/instances")[0]["instance_id"] == "U"


def _run_serve(*extra: str, listen: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KVSEAL_TOKEN"}
    cmd = serve_command(listen, f"127.0.0.1:{free_port()}", extra)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def test_non_loopback_listen_needs_allow_remote_and_token() -> None:
    listen = f"0.0.0.0:{free_port()}"
    r = _run_serve(listen=listen)
    assert r.returncode != 0
    assert "--allow-remote" in r.stderr and "Traceback" not in r.stderr
    r = _run_serve("--allow-remote", listen=listen)
    assert r.returncode != 0
    assert "token" in r.stderr and "Traceback" not in r.stderr


def test_token_required_on_grpc_and_http(
    engine_factory: Callable[..., EngineProcess], spawn: Callable[..., list[Worker]]
) -> None:
    engine = engine_factory("--token", "s3cret")
    with EngineClient(engine.target) as anonymous, EngineClient(engine.target, token="wrong") as wrong:
        for client in (anonymous, wrong):
            with pytest.raises(Unauthenticated):
                client.query("nobody", HASHES)
            with pytest.raises(Unauthenticated):
                client.release("nobody", 1)
            with pytest.raises(Unauthenticated):
                client.unregister(("nobody", 0, 0))
    with EngineClient(engine.target, token="s3cret") as client:
        with pytest.raises(NotFound):  # past the token check: the engine answers
            client.query("nobody", HASHES)

    (anon_worker,) = spawn(engine.target, 1)
    with pytest.raises(Unauthenticated):
        register_tp([anon_worker], "T", [attn_layers(2)], seed=1)
    (w,) = spawn(engine.target, 1, token="s3cret")
    register_tp([w], "T", [attn_layers(2)], seed=1)
    save_all([w], HASHES, A_BLOCKS)
    assert w.query(HASHES).hits == 8

    for path in ("/v1/namespaces", "/v1/instances", "/metrics"):
        assert engine.get(path, token="")[0] == 401
        assert engine.get(path, token="wrong")[0] == 401
        assert engine.get(path, token="s3cret")[0] == 200
    assert engine.get("/health", token="")[0] == 200


# -------------------------------------------------------------------- registration errors


def _layer(name: str, fd: int, offset: int = 0, size: int = 4096, num_blocks: int = 2) -> pb.LayerSpec:
    return pb.LayerSpec(
        name=name,
        dtype="float16",
        segment_bytes=2048,
        segments=1,
        layout_tag="cpu-LBHNC",
        num_blocks=num_blocks,
        strides=[2048],
        memory=pb.MemoryHandle(shm=pb.ShmHandle(fd=fd, offset=offset, size=size)),
    )


def _register(client: EngineClient, layers: list[pb.LayerSpec], instance_id: str = "R") -> Any:
    return client.register(
        instance_id=instance_id,
        namespace=NAMESPACE,
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        world_size=1,
        block_size=16,
        layers=layers,
    )


def test_register_rejects_memory_it_cannot_trust(engine: EngineProcess, tmp_path: Path) -> None:
    """Memory arrives as descriptors, and only a read-write memfd sealed against shrinking is mapped."""
    regular = tmp_path / "kv.bin"
    regular.write_bytes(bytes(4096))
    unsealed = memfd.new_memfd(4096)
    sealed = memfd.SharedArray((4096,))
    read_only = os.open(f"/proc/self/fd/{sealed.fd}", os.O_RDONLY)
    try:
        with engine.client() as client, open(regular, "r+b") as disk_file:
            with pytest.raises(InvalidArgument, match=r"layers\[0\]\.memory\.shm: the descriptor is not shared memory"):
                _register(client, [_layer("l0", disk_file.fileno())])
            with pytest.raises(InvalidArgument, match=r"layers\[0\]\.memory\.shm: .*sealed with F_SEAL_SHRINK"):
                _register(client, [_layer("l0", unsealed)])
            with pytest.raises(InvalidArgument, match=r"layers\[0\]\.memory\.shm: .*must be open read-write"):
                _register(client, [_layer("l0", read_only)])
            with pytest.raises(InvalidArgument, match=r"layers\[0\]\.memory\.shm\.size 8192 must be in 1\.\.4096"):
                _register(client, [_layer("l0", sealed.fd, size=8192)])
            with pytest.raises(InvalidArgument, match=r"layers\[0\]\.memory\.shm\.offset 0 \+ layer extent 65536 exc"):
                _register(client, [_layer("l0", sealed.fd, num_blocks=32)])
            with pytest.raises(InvalidArgument, match=r"layers\[1\]\.memory\.shm\.offset 3072 \+ layer extent 2048 "):
                _register(client, [_layer("l0", sealed.fd), _layer("l1", sealed.fd, offset=3072, num_blocks=1)])
            # nothing was registered by the failures; a layer that fits registers and seals
            assert engine.get_json("/v1/instances") == []
            assert_sealed_status(_register(client, [_layer("l0", sealed.fd)]))
    finally:
        for fd in (unsealed, read_only):
            os.close(fd)
        sealed.close()


def test_register_missing_owner_then_retry(engine: EngineProcess, spawn: Callable[..., list[Worker]]) -> None:
    w0, w1 = spawn(engine.target, 2)
    layers = attn_layers(4)
    s0 = w0.register(instance_id="A", namespace=NAMESPACE, tp_rank=0, tp_size=2, world_size=2, layers=layers, seed=1)
    assert not s0.sealed
    with pytest.raises(FailedPrecondition, match=r"'model\.layers\.3\.self_attn\.attn' .*tp_rank 1"):
        w1.register(instance_id="A", namespace=NAMESPACE, tp_rank=1, tp_size=2, world_size=2, layers=layers[:3], seed=2)
    view = instance_view(engine, "A")
    assert view is not None and (view["sealed"], view["registered"]) == (False, 1)  # the bad one was not kept
    s1 = w1.register(instance_id="A", namespace=NAMESPACE, tp_rank=1, tp_size=2, world_size=2, layers=layers, seed=2)
    assert_sealed_status(s1)
    assert s1.num_layers == 4
    save_all([w0, w1], HASHES, A_BLOCKS)
    assert w1.query(HASHES).hits == 8


def test_the_example_worker_runs(engine: EngineProcess) -> None:
    """examples/worker.py, which the README points to, runs as written against a real engine."""
    r = subprocess.run(
        [sys.executable, str(REPO / "examples" / "worker.py"), engine.target],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stderr
    assert "hits: 8 loaded: 8" in r.stdout and "ok:" in r.stdout, r.stdout
