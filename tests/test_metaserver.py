"""`kvseal metaserver` as a real process: heartbeats, announce/withdraw, QueryPrefix, staleness, a restart of the
memory store (new epoch: nodes are told to announce again), validation naming the field; with a real redis-server
two MetaServer replicas answer the same, and one killed leaves the other answering."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from conftest import NS, REPO, EngineProcess, Meta, free_port, http_get, save_blocks, wait_until

from kvseal.meta.server import STEP_BLOCKS
from kvseal.proto import kvseal_pb2 as pb
from kvseal.proto import kvseal_pb2_grpc as pb_grpc

pytestmark = pytest.mark.process


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_nodes_announce_and_the_longest_prefix_comes_first(meta: Callable[..., Meta]) -> None:
    m = meta()
    assert m.heartbeat("a").new_session and m.heartbeat("b").new_session
    assert not m.heartbeat("a").new_session  # the same session renewed
    assert m.announce("a", [h(0), h(1), h(2)]) == 3 and m.announce("a", [h(2)]) == 0
    assert m.announce("b", [h(0), h(1), h(3)]) == 3
    assert m.prefix([h(0), h(1), h(2), h(3)]) == {"a": 3, "b": 2}
    r = m.stub.QueryPrefix(pb.QueryPrefixRequest(namespace_final=NS, block_hashes=[h(0), h(1), h(2)]), timeout=10)
    assert [n.node_id for n in r.nodes] == ["a", "b"] and r.nodes[0].address == "127.0.0.1:7000"
    assert m.prefix([h(1)], ns="llama.ffffffff") == {}  # another layout's namespace: never offered
    assert m.withdraw("a", [h(1)]) == 1
    assert m.prefix([h(0), h(1), h(2)]) == {"a": 1, "b": 2}
    with pytest.raises(grpc.RpcError) as e:
        m.heartbeat("a", session="s2")  # another session while s1 is live: refused, s1 keeps the id and its blocks
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "node_id 'a' is held by another live session (at '127.0.0.1:7000'" in (e.value.details() or "")
    assert m.prefix([h(0), h(1), h(2)]) == {"a": 1, "b": 2}
    assert m.stub.Unregister(pb.UnregisterNodeRequest(node_id="a", session="s1"), timeout=10).removed  # a stopped
    assert m.heartbeat("a", session="s2").new_session  # and restarted: what its old session announced is gone
    assert m.prefix([h(0), h(1), h(2)]) == {"b": 2}
    with pytest.raises(grpc.RpcError) as e:
        m.announce("a", [h(5)], session="s1")
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "heartbeat" in (e.value.details() or "")
    unregister = m.stub.Unregister(pb.UnregisterNodeRequest(node_id="b", session="s1"), timeout=10)
    assert unregister.removed and m.prefix([h(0)]) == {}
    metrics = http_get(f"http://127.0.0.1:{m.http_port}/metrics")[1].decode()
    assert (
        "kvseal_meta_nodes 1.0" in metrics and 'kvseal_meta_rpc_seconds_count{code="OK",method="Announce"}' in metrics
    )


def test_a_silent_node_is_invisible_after_its_staleness_and_forgotten_later(meta: Callable[..., Meta]) -> None:
    m = meta("--stale-after", "0.5", "--forget-after", "0.5")
    assert m.heartbeat("quiet").stale_after_ms == 500
    m.heartbeat("alive")
    m.announce("quiet", [h(0)])
    m.announce("alive", [h(0)])
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:
        m.heartbeat("alive")  # keeps one of them live
        time.sleep(0.1)  # a heartbeat interval, as an engine would send them
    assert m.prefix([h(0)]) == {"alive": 1}
    metrics = http_get(f"http://127.0.0.1:{m.http_port}/metrics")[1].decode()
    assert "kvseal_meta_nodes 1.0" in metrics

    # forgotten (purged) once stale past forget-after: its session is unknown now
    def forgotten() -> bool:
        m.heartbeat("alive")
        try:
            m.announce("quiet", [h(1)])
            return False
        except grpc.RpcError as e:
            return e.code() == grpc.StatusCode.FAILED_PRECONDITION

    wait_until(forgotten, 10, "the silent node to be forgotten", interval=0.2)


def test_a_restarted_memory_metaserver_has_a_new_epoch_and_nodes_announce_again(meta: Callable[..., Meta]) -> None:
    m = meta()
    epoch = m.heartbeat("a").epoch
    m.announce("a", [h(0), h(1)])
    assert m.stop() == 0
    m2 = meta()
    with pytest.raises(grpc.RpcError) as e:
        m2.announce("a", [h(2)])
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    beat = m2.heartbeat("a")
    assert beat.epoch != epoch and beat.new_session  # the node's cue to announce all its resident blocks
    m2.announce("a", [h(0), h(1)])
    assert m2.prefix([h(0), h(1)]) == {"a": 2}


def test_bad_requests_are_refused_naming_the_field(meta: Callable[..., Meta]) -> None:
    m = meta()
    cases = [
        (lambda: m.heartbeat(""), "node_id"),
        (lambda: m.heartbeat("a", session="bad session"), "session"),
        (lambda: m.heartbeat("a", address="nowhere"), "address"),
        (lambda: m.announce("a", [b""]), "blocks[0].block_hashes[0]"),
        (lambda: m.announce("a", [h(0)], ns="bad ns"), "blocks[0].namespace_final"),
        (lambda: m.prefix([b"x" * 65]), "block_hashes[0]"),
    ]
    m.heartbeat("a")
    for call, field in cases:
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in (e.value.details() or ""), field
    assert m.proc.poll() is None


def test_two_replicas_on_one_redis_agree_and_one_killed_leaves_the_other(
    meta: Callable[..., Meta], redis_url: str
) -> None:
    first = meta("--store", redis_url)
    second = meta("--store", redis_url)
    assert first.heartbeat("a").epoch == second.heartbeat("b").epoch
    first.announce("a", [h(0), h(1)])
    second.announce("b", [h(0)])
    assert first.prefix([h(0), h(1)]) == second.prefix([h(0), h(1)]) == {"a": 2, "b": 1}
    first.stop(signal.SIGKILL)
    second.heartbeat("a")  # a's session is known to the other replica too
    assert second.announce("a", [h(2)]) == 1
    assert second.prefix([h(0), h(1), h(2)]) == {"a": 3, "b": 1}
    third = meta("--store", redis_url)  # a restart forgets nothing
    assert third.prefix([h(0), h(1), h(2)]) == {"a": 3, "b": 1}


@pytest.mark.parametrize(
    "first_bytes", [b"SSH-2.0-OpenSSH_9.2\r\n", b"-ERR unknown command\r\n", b"+OK\r\n", b""], ids=repr
)
def test_a_store_url_at_a_port_that_is_not_redis_is_one_line(first_bytes: bytes) -> None:
    """A redis:// URL at a server that answers something else (an SSH banner, an error, a bare OK, or closes at
    once): one line saying it answers but not as Redis does, exit 1, no traceback."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer() -> None:
        with listener:
            listener.settimeout(60)
            try:
                for _ in range(8):  # redis-py may connect again after a failed handshake
                    conn, _ = listener.accept()
                    with conn:
                        conn.sendall(first_bytes)
                        conn.settimeout(0.2)
                        with contextlib.suppress(OSError):
                            conn.recv(4096)
            except OSError:
                pass

    server = threading.Thread(target=answer, daemon=True)
    server.start()
    r = subprocess.run(
        [sys.executable, "-m", "kvseal", "metaserver", "--listen", f"127.0.0.1:{free_port()}", "--http-listen", ""]
        + ["--store", f"redis://127.0.0.1:{port}/0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"kvseal metaserver: error: redis://127.0.0.1:{port}/0 (--store) answers, but not as")
    assert "point --store at a redis-server's port" in r.stderr


def test_redis_unreachable_at_start_or_later(meta: Callable[..., Meta], redis_url: str, tmp_path: Path) -> None:
    """Unreachable at start: one line naming the URL and how to start redis-server, and exit 1. Gone later: RPCs
    answer UNAVAILABLE, /health 503 naming the store, one warning for the outage; back: /health 200, one line."""
    port = free_port()
    r = subprocess.run(
        [sys.executable, "-m", "kvseal", "metaserver", "--listen", f"127.0.0.1:{free_port()}"]
        + ["--store", f"redis://:secret@127.0.0.1:{port}/0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"kvseal metaserver: error: cannot reach Redis at redis://:***@127.0.0.1:{port}/0")
    assert f"`redis-server --port {port}`" in r.stderr and "secret" not in r.stderr
    m = meta("--store", redis_url)
    m.heartbeat("a")
    health = f"http://127.0.0.1:{m.http_port}/health"
    subprocess.run(["redis-cli", "-u", redis_url, "shutdown", "nosave"], capture_output=True, timeout=30)
    with pytest.raises(grpc.RpcError) as e:
        m.heartbeat("a")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "store is unreachable" in (e.value.details() or "")
    code, body = http_get(health)
    assert code == 503 and f"the store {redis_url} is unreachable" in json.loads(body)["error"]
    time.sleep(2.5)  # the maintenance thread meets the outage every second
    assert http_get(health)[0] == 503 and m.proc.poll() is None
    assert m.log.read_text().count("unreachable") == 1
    redis_port = redis_url.rsplit(":", 1)[1].split("/")[0]
    again = subprocess.Popen(
        ["redis-server", "--port", redis_port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        + ["--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: http_get(health)[0] == 200, 20, "/health to answer 200 with Redis back")
        assert m.heartbeat("a").new_session  # Redis came back empty: a new session, and a new epoch
        assert m.log.read_text().count("reachable again") == 1
    finally:
        again.kill()
        again.wait()


def test_an_engine_announces_its_blocks_withdraws_purged_ones_and_backfills_a_restarted_metaserver(
    meta: Callable[..., Meta], engine_factory: Callable[..., EngineProcess]
) -> None:
    m = meta()
    engine = engine_factory("--metaserver", f"127.0.0.1:{m.port}", "--node-id", "node-a")
    hashes = [f"m{i}".encode().ljust(32, b".") for i in range(8)]
    namespace = save_blocks(engine, "a", "llama", hashes)
    wait_until(lambda: m.prefix(hashes, ns=namespace) == {"node-a": 8}, 20, "node-a's blocks to be announced")
    assert engine.metric("kvseal_meta_announced_total") == 8 and engine.metric("kvseal_meta_announce_backlog") == 0

    request = urllib.request.Request(f"{engine.http}/v1/namespaces/{namespace}", method="DELETE")
    with urllib.request.urlopen(request, timeout=10) as r:
        assert r.status == 200
    wait_until(lambda: m.prefix(hashes, ns=namespace) == {}, 20, "the purged blocks to be withdrawn")

    save_blocks(engine, "b", "llama", hashes)
    wait_until(lambda: m.prefix(hashes, ns=namespace) == {"node-a": 8}, 20, "the blocks saved again")
    assert m.stop() == 0
    again = meta(port=m.port)  # a memory store starts empty, with a new epoch: the engine announces everything again
    wait_until(lambda: again.prefix(hashes, ns=namespace) == {"node-a": 8}, 30, "the engine to backfill")
    assert engine.stop() == []
    engine.expect_exit = True
    wait_until(lambda: again.prefix(hashes, ns=namespace) == {}, 20, "the stopped engine to unregister")


def test_with_a_token_every_call_and_metrics_need_it_and_remote_needs_both(meta: Callable[..., Meta]) -> None:
    m = meta("--token", "sesame")
    with pytest.raises(grpc.RpcError) as e:
        m.heartbeat("a")
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    beat = m.stub.Heartbeat(
        pb.HeartbeatRequest(node_id="a", session="s1", address="127.0.0.1:7000"),
        timeout=10,
        metadata=(("authorization", "Bearer sesame"),),
    )
    assert beat.new_session
    assert http_get(f"http://127.0.0.1:{m.http_port}/metrics")[0] == 401
    assert http_get(f"http://127.0.0.1:{m.http_port}/metrics", token="sesame")[0] == 200
    assert http_get(f"http://127.0.0.1:{m.http_port}/health")[0] == 200
    r = subprocess.run(
        [sys.executable, "-m", "kvseal", "metaserver", "--listen", f"0.0.0.0:{free_port()}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "not a loopback address" in r.stderr and r.stderr.count("\n") == 1


def test_an_oversized_field_of_any_rpc_is_refused_naming_it_in_a_short_message(meta: Callable[..., Meta]) -> None:
    """1 MB in each field in turn: INVALID_ARGUMENT naming the field, the value quoted a few dozen bytes at most
    (echoed whole, the message would pass gRPC's metadata limit and the client would see that error instead)."""
    m = meta()
    m.heartbeat("a")
    big, ok = "x" * (1 << 20), [h(0)]

    def blocks(node: str = "a", session: str = "s1", ns: str = NS, hashes: list[bytes] = ok) -> pb.BlocksRequest:
        return pb.BlocksRequest(
            node_id=node, session=session, blocks=[pb.NamespaceBlocks(namespace_final=ns, block_hashes=hashes)]
        )

    many = pb.BlocksRequest(node_id="a", session="s1", blocks=[pb.NamespaceBlocks(namespace_final=NS)] * 2000)
    cases = [
        ("Heartbeat", pb.HeartbeatRequest(node_id=big, session="s1", address="127.0.0.1:7000"), "node_id"),
        ("Heartbeat", pb.HeartbeatRequest(node_id="a", session=big, address="127.0.0.1:7000"), "session"),
        ("Heartbeat", pb.HeartbeatRequest(node_id="a", session="s1", address=big + ":7000"), "address"),
        ("Announce", blocks(node=big), "node_id"),
        ("Announce", blocks(session=big), "session"),
        ("Announce", blocks(ns=big), "blocks[0].namespace_final"),
        ("Announce", blocks(hashes=[big.encode()]), "blocks[0].block_hashes[0]"),
        ("Announce", many, "blocks: at most 1024 namespaces"),
        ("Withdraw", blocks(node=big), "node_id"),
        ("Withdraw", blocks(session=big), "session"),
        ("Withdraw", blocks(ns=big), "blocks[0].namespace_final"),
        ("Withdraw", blocks(hashes=[big.encode()]), "blocks[0].block_hashes[0]"),
        ("QueryPrefix", pb.QueryPrefixRequest(namespace_final=big, block_hashes=ok), "namespace_final"),
        ("QueryPrefix", pb.QueryPrefixRequest(namespace_final=NS, block_hashes=[big.encode()]), "block_hashes[0]"),
        ("Unregister", pb.UnregisterNodeRequest(node_id=big, session="s1"), "node_id"),
        ("Unregister", pb.UnregisterNodeRequest(node_id="a", session=big), "session"),
    ]  # ListNodes has no field
    for method, request, field in cases:
        with pytest.raises(grpc.RpcError) as e:
            getattr(m.stub, method)(request, timeout=10)
        details = e.value.details() or ""
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, field, e.value.code(), details[:200])
        assert details.startswith(field) and len(details) < 300, (method, field, details[:400])
    assert m.prefix([h(0)]) == {} and m.proc.poll() is None


def test_caps_on_nodes_and_blocks_answer_resource_exhausted_naming_the_flag(meta: Callable[..., Meta]) -> None:
    m = meta("--max-nodes", "2", "--max-blocks-per-node", "100", "--max-blocks", "150")
    m.heartbeat("a")
    m.heartbeat("b")

    def refused(call: Callable[[], object], flag: str) -> None:
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and flag in (e.value.details() or ""), flag

    refused(lambda: m.heartbeat("c"), "--max-nodes 2")
    assert m.heartbeat("a").new_session is False  # known nodes still renew
    assert m.announce("a", [h(i) for i in range(100)]) == 100
    refused(lambda: m.announce("a", [h(100)]), "--max-blocks-per-node 100")
    assert m.announce("a", [h(0), h(1)]) == 0  # held already: no more
    refused(lambda: m.announce("b", [h(i) for i in range(51)]), "--max-blocks 150")
    assert m.announce("b", [h(i) for i in range(50)]) == 50
    refused(lambda: m.announce("b", [h(i) for i in range(5000)]), "--max-blocks-per-node 100")  # in steps: the same
    assert m.withdraw("a", [h(i) for i in range(10)]) == 10
    assert m.announce("b", [h(i) for i in range(60)]) == 10  # room made by a
    assert m.prefix([h(0)]) == {"b": 1}


def test_an_announce_flood_does_not_stall_lookups(meta: Callable[..., Meta]) -> None:
    """The issue's flood: four clients announce 131072 hashes each at once while QueryPrefix is polled. Before, each
    held the one lock 0.6-3.7 s and lookups stalled up to 2.6 s. Now batches are validated outside the lock and
    applied in steps: the asserted bound is the longest hold of the lock the MetaServer reports (the engines' lookup
    deadline is 250 ms; a hold measures 20-30 ms here). Lookup latency itself also depends on this shared 2-vCPU
    machine (the GIL of both processes, other tests): its median must stay under the deadline and its p99 under
    twice it (measured: p99 40-160 ms)."""
    m = meta()
    options = [("grpc.max_send_message_length", 16 << 20)]
    floods = []
    for i in range(4):
        m.heartbeat(f"f{i}")
        hashes = [i.to_bytes(1, "big") + os.urandom(31) for _ in range(131072)]
        floods.append(
            pb.BlocksRequest(
                node_id=f"f{i}", session="s1", blocks=[pb.NamespaceBlocks(namespace_final=NS, block_hashes=hashes)]
            )
        )
    m.heartbeat("q")
    m.announce("q", [h(0), h(1)])
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            start = time.perf_counter()
            assert m.prefix([h(0), h(1)]) == {"q": 2}
            latencies.append(time.perf_counter() - start)

    def flood(request: pb.BlocksRequest) -> int:
        with grpc.insecure_channel(f"127.0.0.1:{m.port}", options=options) as channel:
            return pb_grpc.MetaServerStub(channel).Announce(request, timeout=60).changed

    poller = threading.Thread(target=poll)
    poller.start()
    with ThreadPoolExecutor(4) as pool:
        changed = list(pool.map(flood, floods))
    done.set()
    poller.join()
    assert changed == [131072] * 4
    metrics = http_get(f"http://127.0.0.1:{m.http_port}/metrics")[1].decode()
    assert "kvseal_meta_blocks 524290.0" in metrics
    longest = float(re.search(r"^kvseal_meta_lock_hold_max_seconds (\S+)$", metrics, re.M).group(1))  # type: ignore[union-attr]
    holds = float(re.search(r"^kvseal_meta_lock_hold_seconds_count (\S+)$", metrics, re.M).group(1))  # type: ignore[union-attr]
    assert longest < 0.25 and holds >= 4 * 131072 / STEP_BLOCKS, (longest, holds)
    latencies.sort()
    assert len(latencies) >= 5
    p50, p99 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99)]
    print(f"flood: longest hold {longest * 1e3:.1f} ms of {holds:.0f}; QueryPrefix p50 {p50 * 1e3:.1f} ms", end="")
    print(f", p99 {p99 * 1e3:.1f} ms")
    assert p50 < 0.25 and p99 < 0.5, latencies[-5:]
