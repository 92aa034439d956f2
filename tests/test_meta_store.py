"""The MetaStore contract (kvseal/meta/store.py's docstring), run against MemoryStore and RedisStore on a real
redis-server (one per module, on a free port, nothing saved; FLUSHDB before every test), a differential test that
drives both with the same random operations (they must answer alike), and what only RedisStore promises:
replicas on one database share state and epoch, a MetaServer restart forgets nothing, every change is atomic,
batches are one round trip, and a lost connection raises ConnectionError.
"""

from __future__ import annotations

import builtins
import contextlib
import random
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvseal.meta.redis_store import PREFIX, RedisStore
from kvseal.meta.store import MemoryStore, MetaStore, NodeHeld, NodeHit, NodeInfo, StoreFull

REDIS_SERVER = "/usr/bin/redis-server"
START_TIMEOUT_S = 10.0
NS = "model-a:tp1:final"  # a colon in it on purpose: block keys must stay unambiguous
H = [bytes([i]) * 16 for i in range(32)]


# --- a real redis-server -----------------------------------------------------------------------------------------


class RedisServer:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        for _ in range(5):  # a free port can be taken between probing and binding: try another
            self.port = _free_port()
            self.proc = subprocess.Popen(
                [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
                + ["--dir", str(directory)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if self._answers():
                return
            self.stop()
        raise RuntimeError(f"{REDIS_SERVER} did not answer PING on a free port (5 tries)")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _answers(self) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with redis.Redis(port=self.port, socket_timeout=1) as r:
                    if r.ping():
                        return True
            except redis.ConnectionError:
                time.sleep(0.02)  # poll interval of a bounded wait for the server to listen
        return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(10)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    directory = Path(tempfile.mkdtemp(prefix="kvseal-redis-"))
    server = RedisServer(directory)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    with redis.Redis.from_url(redis_server.url) as r:
        r.flushdb()
    yield redis_server.url


@pytest.fixture
def raw(redis_url: str) -> Iterator[redis.Redis]:
    with redis.Redis.from_url(redis_url) as r:
        yield r


@pytest.fixture
def open_redis(redis_url: str) -> Iterator[Callable[[], RedisStore]]:
    opened: list[RedisStore] = []

    def open_one() -> RedisStore:
        opened.append(RedisStore(redis_url))
        return opened[-1]

    yield open_one
    for s in opened:
        s.close()


@pytest.fixture(params=["memory", "redis"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def store(kind: str, request: pytest.FixtureRequest) -> Iterator[MetaStore]:
    if kind == "memory":
        yield MemoryStore()
    else:
        s = RedisStore(request.getfixturevalue("redis_url"))
        yield s
        s.close()


def hit(node: str, prefix: int, address: str | None = None) -> NodeHit:
    return NodeHit(node, address or f"{node}.addr:1", prefix)


def join(store: MetaStore, node: str, session: str = "s1", now: float = 10.0, stale: float = 5.0) -> bool:
    return store.heartbeat(node, session, f"{node}.addr:1", now, stale)


def blocks(*indices: int, ns: str = NS) -> list[tuple[str, bytes]]:
    return [(ns, H[i]) for i in indices]


# --- heartbeat ---------------------------------------------------------------------------------------------------


def test_heartbeat_first_is_a_new_session(store: MetaStore) -> None:
    assert join(store, "n1") is True
    assert store.nodes(10.0) == [NodeInfo("n1", "s1", "n1.addr:1", 15.0, 0)]


def test_heartbeat_renewal_is_not_new_extends_expiry_keeps_blocks_and_takes_the_address(store: MetaStore) -> None:
    join(store, "n1", now=10.0, stale=5.0)
    assert store.announce("n1", "s1", blocks(0, 1)) == 2
    assert store.heartbeat("n1", "s1", "elsewhere:2", 14.0, 5.0) is False
    assert store.nodes(18.5) == [NodeInfo("n1", "s1", "elsewhere:2", 19.0, 2)]
    assert store.query_prefix(NS, H[:2], 18.5) == [hit("n1", 2, "elsewhere:2")]


def test_heartbeat_with_another_session_once_the_old_is_stale_is_a_restart_old_blocks_gone(store: MetaStore) -> None:
    join(store, "n1", "old", now=10.0, stale=1.0)  # stale from 11.0
    join(store, "n2", "x", now=10.0, stale=5.0)
    assert store.announce("n1", "old", blocks(0, 1, 2)) == 3
    assert store.announce("n2", "x", blocks(0)) == 1
    assert join(store, "n1", "new", now=11.0) is True
    assert store.query_prefix(NS, H[:3], 11.0) == [hit("n2", 1)]
    assert store.nodes(11.0) == [NodeInfo("n1", "new", "n1.addr:1", 16.0, 0), NodeInfo("n2", "x", "n2.addr:1", 15.0, 1)]
    # the old session is gone for good: it changes nothing
    assert store.announce("n1", "old", blocks(5)) == -1
    assert store.withdraw("n1", "old", blocks(0)) == -1
    assert store.unregister("n1", "old") is False
    assert join(store, "n1", "new", now=12.0) is False
    # the new session's blocks are its own
    assert store.announce("n1", "new", blocks(0, 1)) == 2
    assert store.query_prefix(NS, H[:3], 12.0) == [hit("n1", 2), hit("n2", 1)]


def test_a_node_id_held_live_by_one_session_is_refused_to_another(store: MetaStore) -> None:
    join(store, "n1", "first", now=10.0, stale=5.0)  # live until 15.0
    store.announce("n1", "first", blocks(0, 1))
    for now in (10.0, 12.0, 14.9):
        with pytest.raises(NodeHeld) as e:
            store.heartbeat("n1", "second", "elsewhere:2", now, 5.0)
        assert (e.value.node_id, e.value.address, e.value.expires) == ("n1", "n1.addr:1", 15.0)
    # nothing of the first session changed: it renews, keeps its blocks and its address
    assert store.query_prefix(NS, H[:2], 14.9) == [hit("n1", 2)]
    assert join(store, "n1", "first", now=14.0) is False
    with pytest.raises(NodeHeld):
        join(store, "n1", "second", now=18.0)
    # once it unregisters (or goes stale), the id is free
    assert store.unregister("n1", "first") is True
    assert join(store, "n1", "second", now=18.0) is True
    assert store.query_prefix(NS, H[:2], 18.0) == []


def test_caps_on_nodes_blocks_per_node_and_blocks(store: MetaStore) -> None:
    assert store.heartbeat("n1", "s1", "h:1", 10.0, 1.0, max_nodes=2) is True
    assert store.heartbeat("n2", "s1", "h:2", 10.0, 5.0, max_nodes=2) is True
    with pytest.raises(StoreFull) as e:
        store.heartbeat("n3", "s1", "h:3", 10.0, 5.0, max_nodes=2)
    assert (e.value.cap, e.value.limit) == ("nodes", 2)
    assert store.heartbeat("n1", "s1", "h:1", 10.0, 1.0, max_nodes=2) is False  # known nodes renew
    assert store.heartbeat("n1", "s2", "h:1", 11.0, 5.0, max_nodes=2) is True  # and take over a stale id
    # blocks per node: a batch that would pass the cap changes nothing; blocks held already do not count again
    assert store.announce("n1", "s2", blocks(0, 1, 2), max_node=3) == 3
    with pytest.raises(StoreFull) as e:
        store.announce("n1", "s2", blocks(2, 3), max_node=3)
    assert (e.value.cap, e.value.limit) == ("blocks_per_node", 3)
    assert store.announce("n1", "s2", blocks(0, 1, 1), max_node=3) == 0
    assert store.nodes(11.0)[0].blocks == 3
    # blocks in all (every known node's)
    with pytest.raises(StoreFull) as e:
        store.announce("n2", "s1", blocks(0, 1, 2), max_total=5)
    assert (e.value.cap, e.value.limit) == ("blocks", 5)
    assert store.announce("n2", "s1", blocks(0, 1), max_total=5) == 2
    assert store.withdraw("n1", "s2", blocks(0)) == 1
    assert store.announce("n2", "s1", blocks(2), max_total=5) == 1
    assert store.query_prefix(NS, H[:3], 11.0) == [hit("n2", 3, "h:2")]
    store.unregister("n1", "s2")  # its blocks stop counting at once
    assert store.announce("n2", "s1", blocks(3, 4), max_total=5) == 2


# --- announce / withdraw -----------------------------------------------------------------------------------------


def test_announce_returns_how_many_blocks_are_newly_held(store: MetaStore) -> None:
    join(store, "n1")
    assert store.announce("n1", "s1", blocks(0, 1)) == 2
    assert store.announce("n1", "s1", blocks(0, 1)) == 0
    assert store.announce("n1", "s1", blocks(1, 2, 3)) == 2
    assert store.announce("n1", "s1", []) == 0
    assert store.nodes(10.0)[0].blocks == 4


def test_withdraw_returns_how_many_were_held(store: MetaStore) -> None:
    join(store, "n1")
    store.announce("n1", "s1", blocks(0, 1, 2))
    assert store.withdraw("n1", "s1", blocks(1, 7)) == 1
    assert store.withdraw("n1", "s1", blocks(1)) == 0
    assert store.withdraw("n1", "s1", []) == 0
    assert store.nodes(10.0)[0].blocks == 2
    assert store.query_prefix(NS, H[:3], 10.0) == [hit("n1", 1)]
    assert store.query_prefix(NS, [H[2]], 10.0) == [hit("n1", 1)]


def test_unknown_session_announce_and_withdraw_return_minus_one_and_change_nothing(store: MetaStore) -> None:
    assert store.announce("ghost", "s1", blocks(0)) == -1  # never heartbeat (e.g. a MetaServer restart)
    assert store.withdraw("ghost", "s1", blocks(0)) == -1
    join(store, "n1", "s1")
    store.announce("n1", "s1", blocks(0))
    assert store.announce("n1", "s2", blocks(1)) == -1
    assert store.withdraw("n1", "s2", blocks(0)) == -1
    assert store.query_prefix(NS, H[:2], 10.0) == [hit("n1", 1)]
    assert store.query_prefix(NS, [H[1]], 10.0) == []
    assert [n.node_id for n in store.nodes(10.0)] == ["n1"]


def test_a_block_twice_in_one_batch_counts_once(store: MetaStore) -> None:
    """The count a batch returns is the change of the node's block count (nodes().blocks)."""
    join(store, "n1")
    assert store.announce("n1", "s1", blocks(0, 0, 1)) == 2
    assert store.nodes(10.0)[0].blocks == 2
    assert store.withdraw("n1", "s1", blocks(1, 1)) == 1
    assert store.nodes(10.0)[0].blocks == 1


# --- query_prefix ------------------------------------------------------------------------------------------------


def test_query_prefix_counts_only_the_contiguous_leading_hashes(store: MetaStore) -> None:
    join(store, "n1")
    store.announce("n1", "s1", blocks(0, 1, 3))
    assert store.query_prefix(NS, H[:4], 10.0) == [hit("n1", 2)]
    assert store.query_prefix(NS, H[:2], 10.0) == [hit("n1", 2)]
    assert store.query_prefix(NS, [H[0]], 10.0) == [hit("n1", 1)]
    assert store.query_prefix(NS, [H[0], H[0], H[1]], 10.0) == [hit("n1", 3)]  # a hash may repeat


def test_query_prefix_leaves_out_a_node_without_the_first_hash(store: MetaStore) -> None:
    join(store, "n1")
    join(store, "n2")
    store.announce("n1", "s1", blocks(1, 2, 3))
    store.announce("n2", "s1", blocks(0))
    assert store.query_prefix(NS, H[:4], 10.0) == [hit("n2", 1)]
    assert store.query_prefix(NS, H[1:4], 10.0) == [hit("n1", 3)]


def test_query_prefix_orders_longest_first_ties_by_node_id(store: MetaStore) -> None:
    for node, held in [("c", (0, 1)), ("a", (0,)), ("b", (0, 1)), ("d", (0, 1, 2, 3)), ("e", (1, 2))]:
        join(store, node)
        store.announce(node, "s1", blocks(*held))
    assert store.query_prefix(NS, H[:4], 10.0) == [hit("d", 4), hit("b", 2), hit("c", 2), hit("a", 1)]


def test_query_prefix_keeps_namespaces_apart(store: MetaStore) -> None:
    join(store, "n1")
    join(store, "n2")
    store.announce("n1", "s1", blocks(0, 1, ns="ns"))
    store.announce("n2", "s1", blocks(0, ns="ns:" + H[1].hex()) + blocks(1, ns="ns"))
    assert store.query_prefix("ns", H[:2], 10.0) == [hit("n1", 2)]
    assert store.query_prefix("ns:" + H[1].hex(), H[:2], 10.0) == [hit("n2", 1)]
    assert store.query_prefix("other", H[:2], 10.0) == []


def test_query_prefix_of_nothing_or_unknown_hashes_is_empty(store: MetaStore) -> None:
    join(store, "n1")
    store.announce("n1", "s1", blocks(0))
    assert store.query_prefix(NS, [], 10.0) == []
    assert store.query_prefix(NS, [b"\xff" * 16, H[0]], 10.0) == []


def test_large_batches(store: MetaStore) -> None:
    many = [(NS, i.to_bytes(4, "big") * 4) for i in range(2048)]
    join(store, "n1")
    join(store, "n2")
    assert store.announce("n1", "s1", many) == 2048
    assert store.announce("n2", "s1", many[:700] + many[701:1024]) == 1023
    hashes = [h for _, h in many[:1024]]
    assert store.query_prefix(NS, hashes, 10.0) == [hit("n1", 1024), hit("n2", 700)]
    assert store.withdraw("n1", "s1", many[512:]) == 1536
    assert store.query_prefix(NS, hashes, 10.0) == [hit("n2", 700), hit("n1", 512)]


# --- staleness, purge, unregister, nodes -------------------------------------------------------------------------


def test_a_stale_node_is_invisible_at_once_and_back_on_its_next_heartbeat(store: MetaStore) -> None:
    join(store, "n1", now=10.0, stale=1.5)  # live until 11.5
    join(store, "n2", now=10.0, stale=5.0)
    store.announce("n1", "s1", blocks(0, 1))
    store.announce("n2", "s1", blocks(0))
    assert store.query_prefix(NS, H[:2], 11.4) == [hit("n1", 2), hit("n2", 1)]
    assert [n.node_id for n in store.nodes(11.4)] == ["n1", "n2"]
    assert store.query_prefix(NS, H[:2], 11.5) == [hit("n2", 1)]
    assert [n.node_id for n in store.nodes(11.5)] == ["n2"]
    # stale, not forgotten: the same session comes back with its blocks
    assert join(store, "n1", now=12.0, stale=1.5) is False
    assert store.query_prefix(NS, H[:2], 12.0) == [hit("n1", 2), hit("n2", 1)]


def test_purge_keeps_a_stale_node_until_forget_after_s(store: MetaStore) -> None:
    join(store, "n1", now=10.0, stale=1.0)  # stale from 11.0
    store.announce("n1", "s1", blocks(0))
    assert store.purge(15.9, 5.0) == 0
    assert store.announce("n1", "s1", blocks(1)) == 1  # still its session
    assert join(store, "n1", now=15.9) is False
    assert store.query_prefix(NS, H[:2], 15.9) == [hit("n1", 2)]


def test_purge_forgets_a_node_stale_for_forget_after_s_and_its_blocks(store: MetaStore) -> None:
    join(store, "n1", now=10.0, stale=1.0)  # stale from 11.0
    join(store, "n2", now=14.0, stale=1.0)  # stale from 15.0
    store.announce("n1", "s1", blocks(0, 1))
    store.announce("n2", "s1", blocks(0))
    assert store.purge(16.0, 5.0) == 1
    assert store.purge(16.0, 5.0) == 0
    assert store.query_prefix(NS, H[:2], 10.5) == [hit("n2", 1)]  # gone even for a caller whose clock lags
    assert store.announce("n1", "s1", blocks(2)) == -1
    assert store.unregister("n1", "s1") is False
    assert join(store, "n1", now=16.0) is True  # a new session: its old blocks are not back
    assert store.query_prefix(NS, H[:2], 16.0) == []
    assert store.nodes(16.0) == [NodeInfo("n1", "s1", "n1.addr:1", 21.0, 0)]
    assert store.purge(100.0, 0.0) == 2


def test_unregister_drops_the_node_and_its_blocks_at_once(store: MetaStore) -> None:
    join(store, "n1")
    join(store, "n2")
    store.announce("n1", "s1", blocks(0, 1))
    store.announce("n2", "s1", blocks(0))
    assert store.unregister("n1", "other") is False
    assert store.unregister("ghost", "s1") is False
    assert store.query_prefix(NS, H[:2], 10.0) == [hit("n1", 2), hit("n2", 1)]
    assert store.unregister("n1", "s1") is True
    assert store.unregister("n1", "s1") is False
    assert store.query_prefix(NS, H[:2], 10.0) == [hit("n2", 1)]
    assert [n.node_id for n in store.nodes(10.0)] == ["n2"]
    assert store.announce("n1", "s1", blocks(0)) == -1
    assert join(store, "n1") is True


def test_memory_a_dropped_nodes_blocks_are_collected_in_steps_and_never_count_for_its_next_session() -> None:
    store = MemoryStore()
    join(store, "n1", "old", stale=1.0)
    store.announce("n1", "old", blocks(*range(10)))
    assert store.collect(4) is False  # nothing to collect
    assert store.unregister("n1", "old") is True
    assert store.query_prefix(NS, H[:10], 10.0) == []  # invisible at once
    join(store, "n1", "new")
    assert store.announce("n1", "new", blocks(0, 1)) == 2
    assert store.query_prefix(NS, H[:10], 10.0) == [hit("n1", 2)]  # the old session's leftovers do not count
    assert store.collect(4) is True and store.collect(4) is True and store.collect(4) is False
    assert len(store._holders) == 2  # only the new session's blocks are left
    assert store.query_prefix(NS, H[:10], 10.0) == [hit("n1", 2)]


def test_nodes_lists_live_nodes_by_id_with_session_address_expiry_and_block_count(store: MetaStore) -> None:
    assert store.nodes(0.0) == []
    store.heartbeat("zz", "sz", "10.0.0.3:7", 10.0, 2.0)
    store.heartbeat("a:b", "sa", "10.0.0.1:7", 10.0, 0.1)
    store.heartbeat("m", "sm", "10.0.0.2:7", 10.0, 30.0)
    store.announce("m", "sm", blocks(0, 1, 2))
    store.announce("zz", "sz", blocks(0, ns="x"))
    assert store.nodes(10.05) == [
        NodeInfo("a:b", "sa", "10.0.0.1:7", 10.1, 0),
        NodeInfo("m", "sm", "10.0.0.2:7", 40.0, 3),
        NodeInfo("zz", "sz", "10.0.0.3:7", 12.0, 1),
    ]
    assert [n.node_id for n in store.nodes(10.1)] == ["m", "zz"]
    assert [n.node_id for n in store.nodes(40.0)] == []


def test_epoch_is_fixed_for_the_life_of_the_store(store: MetaStore) -> None:
    epoch = store.epoch
    assert isinstance(epoch, str) and len(epoch) >= 8
    join(store, "n1")
    store.announce("n1", "s1", blocks(0))
    join(store, "n1", "s2", now=20.0)
    store.unregister("n1", "s2")
    store.purge(1e9, 0.0)
    join(store, "n2")
    assert store.epoch == epoch


# --- MemoryStore and RedisStore agree ----------------------------------------------------------------------------

NODES = ["n0", "n1", "a:b", "n/3"]
SESSIONS = ["s0", "s1", "s2"]
NAMESPACES = ["ns", "ns:" + H[0].hex()]
POOL = H[:6]
STEPS = [0.0, 0.1, 0.3, 0.7, 1.0, 2.9]


def outcome(call: Callable[..., object], *args: object, **kwargs: object) -> tuple[str, object]:
    """("ok", what call(*args, **kwargs) returned), or the store's refusal and what it says."""
    try:
        return "ok", call(*args, **kwargs)
    except NodeHeld as e:
        return "held", (e.node_id, e.address, e.expires)
    except StoreFull as e:
        return "full", (e.cap, e.limit)


def _assert_agree(mem: MemoryStore, reds: list[RedisStore], now: float) -> None:
    expected = mem.nodes(now)
    for r in reds:
        assert r.nodes(now) == expected
        for ns in NAMESPACES:
            for start in range(3):
                assert r.query_prefix(ns, POOL[start:], now) == mem.query_prefix(ns, POOL[start:], now)
    assert len({r.epoch for r in reds}) == 1


class AgreeMachine(RuleBasedStateMachine):
    """One MemoryStore and two RedisStore replicas on one database get the same operations (each Redis one on
    either replica): every answer must be the same."""

    url = ""

    def __init__(self) -> None:
        super().__init__()
        with redis.Redis.from_url(self.url) as r:
            r.flushdb()
        self.mem = MemoryStore()
        self.reds = [RedisStore(self.url), RedisStore(self.url)]
        self.now = 100.0
        self.sessions: dict[str, str] = {}

    def teardown(self) -> None:
        for r in self.reds:
            r.close()

    @rule(
        node=st.sampled_from(NODES),
        session=st.sampled_from(SESSIONS),
        address=st.sampled_from(["h1:1", "h2:2"]),
        stale=st.sampled_from([0.3, 1.0, 2.5]),
        replica=st.integers(0, 1),
    )
    def heartbeat(self, node: str, session: str, address: str, stale: float, replica: int) -> None:
        expected = outcome(self.mem.heartbeat, node, session, address, self.now, stale, max_nodes=3)
        assert outcome(self.reds[replica].heartbeat, node, session, address, self.now, stale, max_nodes=3) == expected
        if expected[0] == "ok":
            self.sessions[node] = session

    @rule(
        node=st.sampled_from(NODES),
        current=st.booleans(),
        session=st.sampled_from(SESSIONS),
        batch=st.lists(st.tuples(st.sampled_from(NAMESPACES), st.sampled_from(POOL)), unique=True, max_size=6),
        withdraw=st.booleans(),
        replica=st.integers(0, 1),
    )
    def change(self, node: str, current: bool, session: str, batch: list, withdraw: bool, replica: int) -> None:
        if current:
            session = self.sessions.get(node, session)
        if withdraw:
            assert self.reds[replica].withdraw(node, session, batch) == self.mem.withdraw(node, session, batch)
        else:
            caps = {"max_node": 5, "max_total": 9}
            expected = outcome(self.mem.announce, node, session, batch, **caps)
            assert outcome(self.reds[replica].announce, node, session, batch, **caps) == expected

    @rule(
        node=st.sampled_from(NODES), current=st.booleans(), session=st.sampled_from(SESSIONS), replica=st.integers(0, 1)
    )
    def unregister(self, node: str, current: bool, session: str, replica: int) -> None:
        if current:
            session = self.sessions.get(node, session)
        assert self.reds[replica].unregister(node, session) == self.mem.unregister(node, session)

    @rule(forget=st.sampled_from([0.0, 0.5, 2.0]), replica=st.integers(0, 1))
    def purge(self, forget: float, replica: int) -> None:
        assert self.reds[replica].purge(self.now, forget) == self.mem.purge(self.now, forget)

    @rule(dt=st.sampled_from(STEPS))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(
        ns=st.sampled_from(NAMESPACES),
        hashes=st.lists(st.sampled_from(POOL), max_size=6),
        back=st.sampled_from([0.0, 0.7, 3.0]),
        replica=st.integers(0, 1),
    )
    def query(self, ns: str, hashes: list[bytes], back: float, replica: int) -> None:
        now = self.now - back  # another replica's clock may lag
        assert self.reds[replica].query_prefix(ns, hashes, now) == self.mem.query_prefix(ns, hashes, now)

    @invariant()
    def agree(self) -> None:
        _assert_agree(self.mem, self.reds, self.now)


def test_memory_and_redis_agree_stateful(redis_url: str) -> None:
    AgreeMachine.url = redis_url
    run_state_machine_as_test(
        AgreeMachine,
        settings=settings(max_examples=40, stateful_step_count=30, derandomize=True, database=None, deadline=None),
    )


def test_memory_and_redis_agree_seeded_random(redis_url: str) -> None:
    rng = random.Random(20240611)
    mem = MemoryStore()
    reds = [RedisStore(redis_url), RedisStore(redis_url)]
    nodes = [f"n{i}" for i in range(6)] + ["x:y"]
    pool = [bytes([i]) * 8 for i in range(12)]
    sessions: dict[str, str] = {}
    now = 1000.0
    try:
        for step in range(1500):
            r = rng.choice(reds)
            op = rng.random()
            node = rng.choice(nodes)
            session = sessions.get(node, "s0") if rng.random() < 0.85 else rng.choice(["s0", "s1", "s2"])
            if op < 0.15:
                stale = rng.choice([0.5, 2.0, 6.0])
                session = rng.choice(["s0", "s0", "s0", "s1", "s2"])
                expected = outcome(mem.heartbeat, node, session, f"{node}:{step % 3}", now, stale)
                assert outcome(r.heartbeat, node, session, f"{node}:{step % 3}", now, stale) == expected
                if expected[0] == "ok":
                    sessions[node] = session
            elif op < 0.55:
                batch = [(rng.choice(NAMESPACES), h) for h in rng.sample(pool, rng.randint(0, 8))]
                batch = list(dict.fromkeys(batch))
                expected = outcome(mem.announce, node, session, batch, max_node=10, max_total=40)
                assert outcome(r.announce, node, session, batch, max_node=10, max_total=40) == expected
            elif op < 0.70:
                batch = list(dict.fromkeys((rng.choice(NAMESPACES), h) for h in rng.sample(pool, rng.randint(0, 4))))
                assert r.withdraw(node, session, batch) == mem.withdraw(node, session, batch)
            elif op < 0.74:
                assert r.unregister(node, session) == mem.unregister(node, session)
            elif op < 0.80:
                forget = rng.choice([0.0, 1.0, 3.0])
                assert r.purge(now, forget) == mem.purge(now, forget)
            elif op < 0.90:
                now += rng.choice([0.0, 0.1, 0.25, 0.5, 1.3])
            else:
                ns = rng.choice(NAMESPACES)
                hashes = rng.sample(pool, rng.randint(1, 12))
                assert r.query_prefix(ns, hashes, now) == mem.query_prefix(ns, hashes, now), step
            if step % 50 == 0:
                assert r.nodes(now) == mem.nodes(now), step
        assert sum(n.blocks for n in mem.nodes(0.0)) > 0  # the run did build up state
        for r in reds:
            assert r.nodes(0.0) == mem.nodes(0.0)
            for ns in NAMESPACES:
                assert r.query_prefix(ns, pool, 0.0) == mem.query_prefix(ns, pool, 0.0)
    finally:
        for r in reds:
            r.close()


# --- RedisStore only ---------------------------------------------------------------------------------------------


def test_redis_replicas_share_state_and_epoch(open_redis: Callable[[], RedisStore]) -> None:
    a, b = open_redis(), open_redis()
    assert a.epoch == b.epoch
    assert a.heartbeat("n1", "s1", "h:1", 10.0, 5.0) is True
    assert b.heartbeat("n1", "s1", "h:1", 11.0, 5.0) is False  # the other replica knows this session
    assert b.announce("n1", "s1", blocks(0, 1)) == 2
    assert a.announce("n1", "s1", blocks(1, 2)) == 1
    assert a.query_prefix(NS, H[:3], 12.0) == b.query_prefix(NS, H[:3], 12.0) == [hit("n1", 3, "h:1")]
    assert a.nodes(12.0) == b.nodes(12.0) == [NodeInfo("n1", "s1", "h:1", 16.0, 3)]
    assert a.withdraw("n1", "s1", blocks(0)) == 1
    assert b.query_prefix(NS, H[:3], 12.0) == []
    with pytest.raises(NodeHeld):
        a.heartbeat("n1", "s2", "h:1", 12.0, 5.0)  # s1 is live until 16.0, whichever replica is asked
    assert b.heartbeat("n1", "s2", "h:1", 16.0, 5.0) is True  # restart seen through b: a sees it too
    assert a.announce("n1", "s1", blocks(5)) == -1
    assert a.nodes(16.0)[0].blocks == 0
    assert b.unregister("n1", "s2") is True
    assert a.unregister("n1", "s2") is False
    assert a.epoch == b.epoch


def test_redis_metaserver_restart_keeps_everything_memory_restart_forgets(redis_url: str) -> None:
    first = RedisStore(redis_url)
    first.heartbeat("n1", "s1", "h:1", 10.0, 5.0)
    first.announce("n1", "s1", blocks(0, 1))
    epoch = first.epoch
    first.close()
    again = RedisStore(redis_url)
    try:
        assert again.epoch == epoch
        assert again.announce("n1", "s1", blocks(2)) == 1  # the session is known: no heartbeat needed first
        assert again.query_prefix(NS, H[:3], 12.0) == [hit("n1", 3, "h:1")]
        assert again.nodes(12.0) == [NodeInfo("n1", "s1", "h:1", 15.0, 3)]
        assert again.heartbeat("n1", "s1", "h:1", 13.0, 5.0) is False
    finally:
        again.close()

    mem = MemoryStore()
    mem.heartbeat("n1", "s1", "h:1", 10.0, 5.0)
    mem.announce("n1", "s1", blocks(0, 1))
    fresh = MemoryStore()
    assert fresh.epoch != mem.epoch
    assert fresh.nodes(12.0) == [] and fresh.query_prefix(NS, H[:2], 12.0) == []
    assert fresh.announce("n1", "s1", blocks(2)) == -1


def test_redis_losing_its_data_changes_the_epoch(open_redis: Callable[[], RedisStore], raw: redis.Redis) -> None:
    a, b = open_redis(), open_redis()
    old = a.epoch
    a.heartbeat("n1", "s1", "h:1", 10.0, 5.0)
    a.announce("n1", "s1", blocks(0))
    raw.flushdb()  # Redis restarted without persistence
    assert a.announce("n1", "s1", blocks(1)) == -1
    assert a.heartbeat("n1", "s1", "h:1", 11.0, 5.0) is True
    assert a.epoch != old
    assert b.heartbeat("n2", "s1", "h:2", 11.0, 5.0) is True
    assert b.epoch == a.epoch
    assert open_redis().epoch == a.epoch


def test_redis_key_layout_and_nothing_left_behind(open_redis: Callable[[], RedisStore], raw: redis.Redis) -> None:
    s = open_redis()
    s.heartbeat("a:b", "s1", "h:1", 10.0, 2.5)
    s.announce("a:b", "s1", [("ns:x", b"\x01\xab"), ("ns", b"")])
    s.heartbeat("n2", "s1", "h:2", 10.0, 2.5)
    s.announce("n2", "s1", [("ns:x", b"\x01\xab")])
    p = PREFIX
    assert sorted(k.decode() for k in raw.keys("*")) == sorted(
        [p + "epoch", p + "nodes", p + "node:a:b", p + "node:n2", p + "held:a:b", p + "held:n2"]
        + [p + "blk:ns:x:01ab", p + "blk:ns:"]
    )
    assert raw.get(p + "epoch").decode() == s.epoch
    assert raw.zrange(p + "nodes", 0, -1, withscores=True) == [(b"a:b", 12.5), (b"n2", 12.5)]
    assert raw.hgetall(p + "node:a:b") == {b"session": b"s1", b"address": b"h:1", b"expires": b"12.5"}
    assert raw.smembers(p + "held:a:b") == {(p + "blk:ns:x:01ab").encode(), (p + "blk:ns:").encode()}
    assert raw.smembers(p + "blk:ns:x:01ab") == {b"a:b", b"n2"}
    s.heartbeat("a:b", "s2", "h:1", 12.5, 2.5)  # restart, once s1 went stale
    s.unregister("n2", "s1")
    assert sorted(k.decode() for k in raw.keys("*")) == [p + "epoch", p + "node:a:b", p + "nodes"]
    s.announce("a:b", "s2", blocks(0))
    assert s.purge(100.0, 1.0) == 1
    assert [k.decode() for k in raw.keys("*")] == [p + "epoch"]


def _check_consistent(raw: redis.Redis) -> tuple[int, int]:
    """Every holder of a block exists and has the block in its held: set, and the other way round; every block a
    node holds was announced by its current session (the workers tag a block's hash with the session)."""
    p = PREFIX.encode()
    nodes = set(raw.zrange(PREFIX + "nodes", 0, -1))
    holders: dict[bytes, set[bytes]] = {}
    held: dict[bytes, set[bytes]] = {}
    for key in raw.scan_iter(match=PREFIX + "*", count=1000):
        if key.startswith(p + b"blk:"):
            holders[key] = raw.smembers(key)
        elif key.startswith(p + b"held:"):
            held[key[len(p + b"held:") :]] = raw.smembers(key)
        elif key.startswith(p + b"node:"):
            assert key[len(p + b"node:") :] in nodes
    assert set(held) <= nodes, "blocks held by a node that is gone"
    for block, ids in holders.items():
        for node in ids:
            assert block in held.get(node, set()), (block, node)
    for node, keys in held.items():
        session = raw.hget(p + b"node:" + node, "session")
        for block in keys:
            assert node in holders.get(block, set()), (block, node)
            tag = bytes.fromhex(block.rsplit(b":", 1)[1].decode()).split(b"-")[0]
            assert tag == session, f"{node!r} holds {block!r} of an old session (now {session!r})"
    return len(nodes), sum(map(len, held.values()))


def test_redis_interleaved_replicas_never_leave_a_block_with_a_node_that_lost_it(
    open_redis: Callable[[], RedisStore], raw: redis.Redis
) -> None:
    """Four replicas in threads restart, announce, withdraw, unregister and purge the same nodes at once; between
    rounds (nothing running) the database must be consistent."""
    replicas = [open_redis() for _ in range(4)]
    errors: list[BaseException] = []

    def worker(s: RedisStore, seed: int) -> None:
        rng = random.Random(seed)
        try:
            for i in range(40):
                node, session = rng.choice(["n1", "n2"]), rng.choice(["s1", "s2", "s3"])
                batch = [(NS, f"{session}-{j}".encode()) for j in rng.sample(range(30), 10)]
                op = rng.random()
                if op < 0.3:
                    with contextlib.suppress(NodeHeld):  # another live session holds the node: refused whole
                        s.heartbeat(node, session, "h:1", 10.0 + i, 3.0)
                elif op < 0.75:
                    s.announce(node, session, batch)
                elif op < 0.88:
                    s.withdraw(node, session, batch)
                elif op < 0.97:
                    s.unregister(node, session)
                else:
                    s.purge(10.0 + i, 0.5)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    total = 0
    for round_ in range(20):
        threads = [threading.Thread(target=worker, args=(s, round_ * 10 + k)) for k, s in enumerate(replicas)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        nodes, held = _check_consistent(raw)
        assert sum(n.blocks for n in replicas[0].nodes(0.0)) == held
        assert len(replicas[0].nodes(0.0)) == nodes
        total += held
    assert total > 0  # the rounds did build up state


def test_redis_batches_are_one_round_trip(
    open_redis: Callable[[], RedisStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    s = open_redis()
    s.heartbeat("n1", "s1", "h:1", 10.0, 5.0)
    many = [(NS, i.to_bytes(4, "big")) for i in range(1024)]
    for call in (  # load every script once (a first EVALSHA of a script may need a SCRIPT LOAD)
        lambda: s.announce("n1", "s1", many[:1]),
        lambda: s.withdraw("n1", "s1", many[:1]),
        lambda: s.query_prefix(NS, [many[0][1]], 10.0),
        lambda: s.nodes(10.0),
        lambda: s.purge(10.0, 1.0),
        lambda: s.unregister("x", "s1"),
    ):
        call()
    sent: list[int] = []
    original = redis.connection.AbstractConnection.send_packed_command

    def counting(self, command, check_health=True):  # type: ignore[no-untyped-def]
        sent.append(1)
        return original(self, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)
    for what, call, expected in [
        ("heartbeat", lambda: s.heartbeat("n1", "s1", "h:1", 10.0, 5.0), False),
        ("announce", lambda: s.announce("n1", "s1", many), 1024),
        ("query_prefix", lambda: s.query_prefix(NS, [h for _, h in many], 10.0), [NodeHit("n1", "h:1", 1024)]),
        ("withdraw", lambda: s.withdraw("n1", "s1", many[512:]), 512),
        ("nodes", lambda: len(s.nodes(10.0)), 1),
        ("purge", lambda: s.purge(10.0, 1.0), 0),
        ("unregister", lambda: s.unregister("n1", "s1"), True),
    ]:
        sent.clear()
        assert call() == expected, what
        assert len(sent) == 1, what


def test_redis_connection_failure_raises_connection_error(tmp_path: Path) -> None:
    dead = f"redis://127.0.0.1:{_free_port()}/0"
    with pytest.raises(redis.ConnectionError) as info:
        RedisStore(dead)
    assert isinstance(info.value, builtins.ConnectionError)  # what the MetaServer catches for UNAVAILABLE

    server = RedisServer(tmp_path)
    try:
        s = RedisStore(server.url)
        s.heartbeat("n1", "s1", "h:1", 10.0, 5.0)
    finally:
        server.stop()
    try:
        for call in (
            lambda: s.heartbeat("n1", "s1", "h:1", 10.0, 5.0),
            lambda: s.announce("n1", "s1", blocks(0)),
            lambda: s.withdraw("n1", "s1", blocks(0)),
            lambda: s.query_prefix(NS, H[:2], 10.0),
            lambda: s.nodes(10.0),
            lambda: s.unregister("n1", "s1"),
            lambda: s.purge(10.0, 1.0),
        ):
            with pytest.raises(redis.ConnectionError) as info:
                call()
            assert isinstance(info.value, builtins.ConnectionError)
    finally:
        s.close()
