"""`kvseal metaserver` as a real process: heartbeats, announce/withdraw, QueryPrefix, staleness, a restart of the
memory store (new epoch: nodes are told to announce again), validation naming the field; with a real redis-server
two MetaServer replicas answer the same, and one killed leaves the other answering."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable

import grpc
import pytest
from conftest import NS, REPO, EngineProcess, Meta, free_port, http_get, save_blocks, wait_until

from kvseal.proto import kvseal_pb2 as pb

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
    m.heartbeat("a", session="s2")  # node a restarted: what its old session announced is gone
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


def test_redis_unreachable_at_start_or_later(meta: Callable[..., Meta], redis_url: str) -> None:
    """Unreachable at start: one line and exit 1. Gone later: UNAVAILABLE naming the store, and the MetaServer
    keeps running."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    r = subprocess.run(
        [sys.executable, "-m", "kvseal", "metaserver", "--listen", f"127.0.0.1:{free_port()}", "--store", url],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and r.stderr.startswith("kvseal metaserver: error:") and r.stderr.count("\n") == 1
    m = meta("--store", redis_url)
    m.heartbeat("a")
    subprocess.run(["redis-cli", "-u", redis_url, "shutdown", "nosave"], capture_output=True, timeout=30)
    with pytest.raises(grpc.RpcError) as e:
        m.heartbeat("a")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "store is unreachable" in (e.value.details() or "")
    assert m.proc.poll() is None


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
