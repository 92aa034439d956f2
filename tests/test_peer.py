"""Peer fetch between real engine processes and a real MetaServer on loopback: a block saved on node A is loaded
byte-exact on node C; another layout under the same client namespace is never offered A's blocks; a forged digest
is refused and counted on both sides; a serving node killed mid-transfer turns into a miss; the same with the
MetaServer on a real redis-server; and both data planes (built-in TCP, Mooncake Transfer Engine) pass one
conformance test."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from conftest import REPO, Meta, wait_until

from kvseal.client import BlockRun, EngineClient
from kvseal.memfd import SharedArray
from kvseal.peer.client import PeerFetcher
from kvseal.peer.tcp import TcpDataPlane
from kvseal.testing import EngineProcess, free_port, register_one_rank
from kvseal.wire import peer as wire

pytestmark = pytest.mark.process


class Worker:
    """One worker of one instance on an engine: `layers` layers of `block_bytes` each per block."""

    def __init__(
        self,
        engine: EngineProcess,
        instance: str,
        *,
        namespace: str = "llama",
        num_blocks: int = 16,
        layers: int = 2,
        block_bytes: int = 16384,
        block_size: int = 16,
        dtype: str = "uint8",
    ) -> None:
        self.instance = instance
        self.shared = SharedArray((layers, num_blocks, block_bytes))
        self.client = EngineClient(engine.target, timeout=30, token=engine.token)
        views = {f"model.layers.{i}.attn": self.shared.array[i] for i in range(layers)}
        status = register_one_rank(
            self.client,
            instance,
            self.shared,
            views,
            namespace=namespace,
            layout_tag="t",
            dtype=dtype,
            block_size=block_size,
        )
        self.namespace_final = status.namespace_final

    def save(self, hashes: list[bytes], seed: int = 1) -> np.ndarray:
        """Fills blocks 0..n-1 with random bytes and saves them; returns what was saved, per block."""
        n = len(hashes)
        self.shared.array[:, :n] = np.random.default_rng(seed).integers(0, 256, self.shared.array[:, :n].shape)
        assert self.client.save((self.instance, 0, 0), hashes, list(range(n))).completed == n
        return self.shared.array[:, :n].copy()

    def query(self, hashes: list[bytes], timeout: float = 20.0) -> Any:
        """Queries until the answer is not `loading` (a refill or peer fetch under way)."""
        deadline = time.monotonic() + timeout
        while True:
            r = self.client.query(self.instance, hashes, request_id="r1")
            if not r.loading:
                return r
            assert time.monotonic() < deadline, "still loading"
            time.sleep(0.01)

    def load(self, hashes: list[bytes], lease_id: int) -> np.ndarray:
        """Loads into blocks 0..n-1 (zeroed first) and returns their bytes."""
        n = len(hashes)
        self.shared.array[:, :n] = 0
        r = self.client.load((self.instance, 0, 0), hashes, list(range(n)), lease_id)
        assert r.outcome == 1 and r.loaded == n, r  # loaded
        return self.shared.array[:, :n].copy()

    def close(self) -> None:
        self.client.close()
        self.shared.close()


@pytest.fixture
def workers() -> Iterator[Callable[..., Worker]]:
    made: list[Worker] = []

    def make(engine: EngineProcess, instance: str, **kwargs: Any) -> Worker:
        made.append(Worker(engine, instance, **kwargs))
        return made[-1]

    yield make
    for w in made:
        w.close()


def hashes(n: int, tag: str = "p") -> list[bytes]:
    return [f"{tag}{i}".encode().ljust(32, b".") for i in range(n)]


def node(engine_factory: Callable[..., EngineProcess], meta: Meta, name: str, *extra: str) -> EngineProcess:
    return engine_factory("--metaserver", f"127.0.0.1:{meta.port}", "--node-id", name, "--peer-timeout", "3", *extra)


def announced(meta: Meta, namespace_final: str, hs: list[bytes]) -> dict[str, int]:
    return meta.prefix(hs, ns=namespace_final)


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_a_block_saved_on_a_is_loaded_byte_exact_on_c_and_other_layouts_are_never_offered(
    store: str,
    meta: Callable[..., Meta],
    engine_factory: Callable[..., EngineProcess],
    workers: Callable[..., Worker],
    request: pytest.FixtureRequest,
) -> None:
    m = meta("--store", request.getfixturevalue("redis_url")) if store == "redis" else meta()
    a, b, c = (node(engine_factory, m, n) for n in "abc")
    hs = hashes(8)
    on_a = workers(a, "a1")
    saved = on_a.save(hs)
    wait_until(lambda: announced(m, on_a.namespace_final, hs) == {"a": 8}, 20, "A's blocks to be announced")

    on_c = workers(c, "c1")
    assert on_c.namespace_final == on_a.namespace_final
    r = on_c.query(hs)
    assert r.hits == 8
    assert np.array_equal(on_c.load(hs, r.lease_id), saved)
    assert c.metric("kvseal_peer_hits_total") == 8
    assert a.metric("kvseal_peer_served_blocks_total") == 8
    # fetched blocks are C's own now: announced by C too, and a second query is a local hit
    wait_until(lambda: announced(m, on_a.namespace_final, hs) == {"a": 8, "c": 8}, 20, "C to announce them")
    assert on_c.query(hs).hits == 8 and c.metric("kvseal_peer_hits_total") == 8

    # B runs other layouts under the same client namespace: other final namespaces, nothing offered, nothing fetched
    for i, variant in enumerate(
        [{"layers": 3}, {"dtype": "float16"}, {"block_size": 32}, {"block_bytes": 8192, "dtype": "bfloat16"}]
    ):
        other = workers(b, f"b{i}", **variant)
        assert other.namespace_final.split(".")[0] == "llama" and other.namespace_final != on_a.namespace_final
        assert other.query(hs).hits == 0
    assert b.metric("kvseal_peer_hits_total") == 0 and b.metric("kvseal_peer_lookups_total") == 4
    assert a.metric("kvseal_peer_served_blocks_total") == 8

    peers = b.get_json("/v1/peers")
    assert peers["node_id"] == "b" and {n["node_id"] for n in peers["nodes"]} == {"a", "b", "c"}


def test_a_forged_digest_is_refused_and_counted_on_both_sides(
    meta: Callable[..., Meta], engine_factory: Callable[..., EngineProcess], workers: Callable[..., Worker]
) -> None:
    m = meta()
    a = node(engine_factory, m, "a")
    hs = hashes(4)
    on_a = workers(a, "a1")
    on_a.save(hs)
    address = next(n["address"] for n in a.get_json("/v1/peers")["nodes"] if n["node_id"] == "a")
    page_bytes = a.get_json("/v1/namespaces")[0]["page_bytes"]
    forged = SimpleNamespace(digest=bytes(32), page_bytes=page_bytes)  # all of a layout that travels
    fetcher = PeerFetcher(f"127.0.0.1:{m.port}", "forger", TcpDataPlane(), timeout_s=3)
    try:
        destinations = [memoryview(bytearray(page_bytes)) for _ in hs]
        got, _ = fetcher.fetch(address, on_a.namespace_final, forged, hs, [0] * len(hs), destinations)  # type: ignore
    finally:
        fetcher.close()
    assert got == 0 and fetcher.counters.refusals == {"digest": 1}
    assert not any(any(d) for d in destinations)
    assert a.metric("kvseal_peer_refusals_total", side="serve", reason="digest") == 1
    assert a.metric("kvseal_peer_served_blocks_total") == 0


def test_a_serving_node_killed_mid_transfer_is_a_miss_and_disappears(
    meta: Callable[..., Meta], engine_factory: Callable[..., EngineProcess], workers: Callable[..., Worker]
) -> None:
    """C finds A's blocks at a relay in front of A's peer port, which forwards 3 MiB of A's answer and then stops
    (A is SIGKILLed, the relay hangs on to C's connection): C's fetch ends within its timeout, none of the blocks
    becomes visible on C, and A leaves QueryPrefix after its staleness."""
    m_a, m = meta("--stale-after", "2"), meta()
    a = node(engine_factory, m_a, "a")
    hs = hashes(8)
    on_a = workers(a, "a1", block_bytes=1 << 20)  # 2 MiB pages
    on_a.save(hs)
    wait_until(lambda: announced(m_a, on_a.namespace_final, hs) == {"a": 8}, 20, "A's blocks to be announced")
    address = next(n["address"] for n in a.get_json("/v1/peers")["nodes"] if n["node_id"] == "a")
    relay = _Relay(address, stop_after=3 << 20, then=a.kill)
    m.heartbeat("a", session="relayed", address=relay.address)
    m.announce("a", hs, session="relayed", ns=on_a.namespace_final)
    c = node(engine_factory, m, "c")
    on_c = workers(c, "c1", block_bytes=1 << 20)
    start = time.monotonic()
    r = on_c.query(hs, timeout=15)
    assert r.hits == 0 and time.monotonic() - start < 3 + 3  # --peer-timeout 3, and slack for a loaded machine
    assert not a.alive()
    assert c.metric("kvseal_peer_hits_total") == 0
    assert c.metric("kvseal_peer_fetch_failures_total", reason="timeout") == 1
    assert on_c.query(hs).hits == 0  # still nothing: no partial page ever became visible
    assert c.get_json("/v1/namespaces")[0]["resident_blocks"] == 0
    wait_until(lambda: announced(m_a, on_a.namespace_final, hs) == {}, 10, "the killed A to go stale")
    relay.close()


class _Relay:
    """Accepts one connection and forwards it to `target`, passing `stop_after` bytes of the answers; then calls
    `then()` and forwards nothing more while keeping the connection open (a peer that hangs)."""

    def __init__(self, target: str, stop_after: int, then: Callable[[], None]) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.stop_after = stop_after
        self.then = then
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self._listener.accept()
        server = socket.create_connection(self.target)
        self._sockets += [client, server]
        threading.Thread(target=self._upstream, args=(client, server), daemon=True).start()
        sent = 0
        while sent < self.stop_after and (data := server.recv(min(65536, self.stop_after - sent))):
            client.sendall(data)
            sent += len(data)
        self.then()

    @staticmethod
    def _upstream(client: socket.socket, server: socket.socket) -> None:
        try:
            while data := client.recv(65536):
                server.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        for s in self._sockets:
            s.close()


def test_the_handshake_needs_the_token_and_tokenless_needs_the_engine_user(
    meta: Callable[..., Meta], engine_factory: Callable[..., EngineProcess]
) -> None:
    m = meta("--token", "sesame")
    a = engine_factory(
        "--metaserver", f"127.0.0.1:{m.port}", "--node-id", "a", "--token", "sesame", "--peer-timeout", "3"
    )
    address = next(n["address"] for n in a.get_json("/v1/peers")["nodes"] if n["node_id"] == "a")
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(wire.encode_hello("tcp", bytes(16), "intruder"))
        code, nonce, proof, offer_len = wire.decode_welcome_fixed(_recv(s, wire.WELCOME_FIXED))
        assert code == wire.OK
        _recv(s, offer_len + 2)
        s.sendall(bytes(32))  # a wrong proof
        ready = _recv(s, 3)
        assert wire.refusal_reason(ready[0]) == "auth"
    wait_until(
        lambda: a.metric("kvseal_peer_refusals_total", side="serve", reason="auth") == 1, 10, "the refusal counted"
    )


def _recv(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        assert chunk, "closed"
        out += chunk
    return out


def test_v1_peers_says_when_there_is_no_metaserver_or_it_does_not_answer(
    engine_factory: Callable[..., EngineProcess], workers: Callable[..., Worker]
) -> None:
    alone = engine_factory()
    code, body = alone.get("/v1/peers")
    assert (code, json.loads(body)["error"]) == (
        404,
        "this engine has no MetaServer: start it with --metaserver HOST:PORT",
    )
    orphan = engine_factory("--metaserver", f"127.0.0.1:{free_port()}")
    code, body = orphan.get("/v1/peers")
    assert (code, json.loads(body)["error"]) == (503, "the MetaServer does not answer: UNAVAILABLE")
    # a MetaServer that does not answer costs one failed lookup, then misses without asking for a while
    worker = workers(orphan, "o1")
    assert worker.query(hashes(2)).hits == 0 and worker.query(hashes(2, "q")).hits == 0
    assert orphan.metric("kvseal_peer_lookups_total") == 1
    assert orphan.metric("kvseal_peer_fetch_failures_total", reason="metaserver") == 1


def _plane_flags(plane: str) -> tuple[str, ...]:
    # Mooncake listens on every interface without authentication: the engine wants that accepted explicitly
    return ("--peer-transport", "mooncake", "--allow-remote") if plane == "mooncake" else ()


def _local_plane(plane: str, arena: np.ndarray) -> Any:
    if plane == "mooncake":
        from kvseal.peer.mooncake import MooncakeDataPlane

        return MooncakeDataPlane(arena, "127.0.0.1")
    return TcpDataPlane()


class _KillsTheServerFirst:
    """A data plane that SIGKILLs the serving engine after the fetch's answer, just before the pages move."""

    def __init__(self, inner: Any, kill: Callable[[], None]) -> None:
        self.inner, self.kill = inner, kill
        self.name, self.pulls = inner.name, inner.pulls

    def offer(self) -> bytes:
        return self.inner.offer()

    def receive(self, *args: Any) -> None:
        self.kill()
        self.inner.receive(*args)

    def receive_inline(self, sock: socket.socket, views: Any) -> None:
        self.kill()
        self.inner.receive_inline(sock, views)

    def wait_settled(self, timeout_s: float) -> bool:
        return self.inner.wait_settled(timeout_s) if hasattr(self.inner, "wait_settled") else True


@pytest.mark.parametrize("plane", ["tcp", "mooncake"])
def test_both_transports_move_batches_byte_exact_refuse_and_survive_peer_death(
    plane: str, meta: Callable[..., Meta], engine_factory: Callable[..., EngineProcess], workers: Callable[..., Worker]
) -> None:
    """The conformance test of the data planes: the same engine-to-engine fetches, refusals and peer death."""
    m = meta()
    a, c = (node(engine_factory, m, n, *_plane_flags(plane)) for n in "ac")
    shapes = {"big": {"layers": 2, "block_bytes": 1 << 20}, "odd": {"layers": 3, "block_bytes": 20000}}
    saved, hs = {}, hashes(12)
    for name, shape in shapes.items():
        on_a = workers(a, f"a-{name}", **shape)
        saved[name] = (on_a.namespace_final, on_a.save(hs, seed=len(name)))
        wait_until(lambda ns=on_a.namespace_final: announced(m, ns, hs) == {"a": 12}, 20, "A's blocks announced")
    for name, shape in shapes.items():  # byte-exact batches, engine to engine
        on_c = workers(c, f"c-{name}", **shape)
        r = on_c.query(hs)
        assert r.hits == 12 and np.array_equal(on_c.load(hs, r.lease_id), saved[name][1]), name
    assert c.metric("kvseal_peer_hits_total") == 24 and a.metric("kvseal_peer_served_blocks_total") == 24

    address = next(n["address"] for n in c.get_json("/v1/peers")["nodes"] if n["node_id"] == "a")
    namespace, data = saved["big"]
    page_bytes = 2 << 20
    arena = np.zeros(12 * page_bytes, dtype=np.uint8)
    destinations = [memoryview(arena[i * page_bytes : (i + 1) * page_bytes]) for i in range(12)]
    offsets = [i * page_bytes for i in range(12)]
    digest = bytes.fromhex(next(ns["digest"] for ns in a.get_json("/v1/namespaces") if ns["namespace"] == namespace))
    local = _local_plane(plane, arena)
    try:
        # through a fetcher of our own: byte-exact, then a forged digest refused, then the server killed mid-fetch
        fetcher = PeerFetcher(f"127.0.0.1:{m.port}", "test", local, timeout_s=3)
        assert fetcher.fetch(
            address, namespace, SimpleNamespace(digest=digest, page_bytes=page_bytes), hs, offsets, destinations
        ) == (12, False)  # type: ignore[arg-type]
        assert np.array_equal(arena.reshape(12, 2, 1 << 20).transpose(1, 0, 2), data)
        forged = SimpleNamespace(digest=bytes(32), page_bytes=page_bytes)
        assert fetcher.fetch(address, namespace, forged, hs, offsets, destinations)[0] == 0  # type: ignore[arg-type]
        assert fetcher.counters.refusals == {"digest": 1}
        if plane == "mooncake":  # a fetcher of the other plane is refused in the handshake
            other = PeerFetcher(f"127.0.0.1:{m.port}", "test-tcp", TcpDataPlane(), timeout_s=3)
            assert other.fetch(address, namespace, forged, hs, offsets, destinations)[0] == 0  # type: ignore[arg-type]
            assert other.counters.refusals == {"plane": 1}
            other.close()
        fetcher.close()
        dying = PeerFetcher(f"127.0.0.1:{m.port}", "test", _KillsTheServerFirst(local, a.kill), timeout_s=3)
        start = time.monotonic()
        real = SimpleNamespace(digest=digest, page_bytes=page_bytes)
        assert dying.fetch(address, namespace, real, hs, offsets, destinations)[0] == 0  # type: ignore[arg-type]
        assert time.monotonic() - start < 3 + 2
        assert sum(dying.counters.failures.values()) == 1 and not a.alive()
        dying.close()
    finally:
        local.close()


def test_a_node_id_is_one_live_engines_and_default_ids_differ_per_engine(
    meta: Callable[..., Meta],
    engine_factory: Callable[..., EngineProcess],
    workers: Callable[..., Worker],
    tmp_path: Path,
) -> None:
    """Two engines with one --node-id: the second is refused at start (after waiting one staleness for the first to
    go, in case it was its own crashed predecessor), with one line; the first stays listed and fetchable. Engines
    without --node-id are HOSTNAME:PORT of their --listen. A killed engine's successor takes its id over once the
    killed one went stale."""
    m = meta("--stale-after", "1")
    a = node(engine_factory, m, "shared")
    hs = hashes(8)
    on_a = workers(a, "a1")
    saved = on_a.save(hs)
    wait_until(lambda: announced(m, on_a.namespace_final, hs) == {"shared": 8}, 20, "A's blocks to be announced")

    second = EngineProcess(
        tmp_path / "second", ["--metaserver", f"127.0.0.1:{m.port}", "--node-id", "shared"], cwd=REPO
    )
    second.expect_exit = True
    assert second.proc.wait(timeout=60) == 1
    last = second.stderr().strip().splitlines()[-1]
    assert last.startswith("kvseal serve: error: --node-id 'shared' is held by another live engine"), last
    assert f"at the MetaServer 127.0.0.1:{m.port}" in last and "give each engine its own --node-id" in last
    assert announced(m, on_a.namespace_final, hs) == {"shared": 8}

    c, d = (engine_factory("--metaserver", f"127.0.0.1:{m.port}", "--peer-timeout", "3") for _ in range(2))
    host = socket.gethostname()
    ids = {n["node_id"] for n in c.get_json("/v1/peers")["nodes"]}
    assert ids == {"shared", f"{host}:{c.target.rsplit(':', 1)[1]}", f"{host}:{d.target.rsplit(':', 1)[1]}"}
    on_c = workers(c, "c1")
    r = on_c.query(hs)
    assert r.hits == 8 and np.array_equal(on_c.load(hs, r.lease_id), saved)

    old_address = next(n["address"] for n in c.get_json("/v1/peers")["nodes"] if n["node_id"] == "shared")
    a.kill()  # no Unregister: its successor waits for it to go stale, then takes the id over
    again = node(engine_factory, m, "shared")
    (me,) = [n for n in again.get_json("/v1/peers")["nodes"] if n["self"]]
    assert me["node_id"] == "shared" and me["address"] != old_address
    assert "waiting up to" in again.stderr()


def test_a_holder_that_fails_is_skipped_for_the_next_within_the_fetch(
    meta: Callable[..., Meta], engine_factory: Callable[..., EngineProcess], workers: Callable[..., Worker]
) -> None:
    """Two holders sort before the real one (ties go to the lowest node id): one closes every connection at once,
    at the other's address nothing listens. C's fetch moves on from each to the next and gets every block."""
    m = meta()
    b = node(engine_factory, m, "b")
    hs = hashes(8)
    on_b = workers(b, "b1")
    saved = on_b.save(hs)
    wait_until(lambda: announced(m, on_b.namespace_final, hs) == {"b": 8}, 20, "B's blocks to be announced")
    closer = socket.create_server(("127.0.0.1", 0))

    def close_every_connection() -> None:
        while True:
            try:
                conn, _ = closer.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=close_every_connection, daemon=True).start()
    for forged, address in [("a0", f"127.0.0.1:{closer.getsockname()[1]}"), ("a1", f"127.0.0.1:{free_port()}")]:
        m.heartbeat(forged, session="x", address=address)
        m.announce(forged, hs, session="x", ns=on_b.namespace_final)
    assert list(announced(m, on_b.namespace_final, hs)) == ["a0", "a1", "b"]
    c = node(engine_factory, m, "c")
    on_c = workers(c, "c1")
    start = time.monotonic()
    r = on_c.query(hs)
    assert r.hits == 8 and time.monotonic() - start < 3  # within --peer-timeout
    assert np.array_equal(on_c.load(hs, r.lease_id), saved)
    assert c.metric("kvseal_peer_fetch_failures_total", reason="closed") == 1
    assert c.metric("kvseal_peer_fetch_failures_total", reason="unreachable") == 1
    assert b.metric("kvseal_peer_served_blocks_total") == 8
    closer.close()


class HybridWorker:
    """One rank of a hybrid model on an engine: a full-attention layer and a sliding-window layer (window 33,
    blocks of 16 tokens: a hit reads the last 2 sliding blocks), each group its own block table."""

    def __init__(self, engine: EngineProcess, instance: str) -> None:
        self.instance = instance
        self.shared = SharedArray((2, 16, 4096))
        self.client = EngineClient(engine.target, timeout=30, token=engine.token)
        layers = {"model.layers.0.attn": self.shared.array[0], "model.layers.1.attn": self.shared.array[1]}
        status = register_one_rank(
            self.client,
            instance,
            self.shared,
            layers,
            namespace="gemma",
            layout_tag="t",
            dtype="uint8",
            groups=[("full", 16, 0), ("sliding", 16, 33)],
            group_ids={"model.layers.0.attn": 0, "model.layers.1.attn": 1},
        )
        self.namespace_final = status.namespace_final

    def close(self) -> None:
        self.client.close()
        self.shared.close()


def test_a_hybrid_models_hit_is_fetched_from_a_peer_group_by_group(
    meta: Callable[..., Meta], engine_factory: Callable[..., EngineProcess]
) -> None:
    """Each group's blocks are announced under the group's store namespace; a node that misses fetches the full
    group's run and only the sliding blocks the window still reads, and loads them byte-exact."""
    m = meta()
    a, c = node(engine_factory, m, "a"), node(engine_factory, m, "c")
    on_a, on_c = HybridWorker(a, "a1"), HybridWorker(c, "c1")
    try:
        hs = hashes(8)
        on_a.shared.array[:] = np.random.default_rng(7).integers(0, 256, on_a.shared.array.shape)
        ids = list(range(8))
        runs = [BlockRun(0, hs, [ids]), BlockRun(1, hs, [ids])]
        assert on_a.client.save_groups((on_a.instance, 0, 0), runs).completed == 16
        full, sliding = (f"{on_a.namespace_final}/g{g}" for g in (0, 1))
        wait_until(lambda: announced(m, sliding, hs) == {"a": 8}, 20, "A's sliding blocks to be announced")
        assert announced(m, full, hs) == {"a": 8}

        assert on_c.namespace_final == on_a.namespace_final
        deadline = time.monotonic() + 20
        while (r := on_c.client.query(on_c.instance, hs, limit_tokens=8 * 16 - 1)).loading:
            assert time.monotonic() < deadline, "still loading"
            time.sleep(0.01)
        assert r.hits == 7  # the prompt's last token is never served: 7 blocks of 16
        assert c.metric("kvseal_peer_hits_total") == 7 + 2  # the full run and the window's two blocks
        on_c.shared.array[:] = 0
        back = [BlockRun(0, hs[:7], [ids[:7]]), BlockRun(1, hs[5:7], [ids[5:7]])]
        loaded = on_c.client.load_groups((on_c.instance, 0, 0), back, r.lease_id)
        assert loaded.outcome == 1 and loaded.loaded == 9, loaded
        assert np.array_equal(on_c.shared.array[0, :7], on_a.shared.array[0, :7])
        assert np.array_equal(on_c.shared.array[1, 5:7], on_a.shared.array[1, 5:7])
        assert not on_c.shared.array[1, :5].any()  # the sliding blocks the window no longer reads stay unfetched
    finally:
        on_a.close()
        on_c.close()
