"""The engine's peer path in process, with a fake other node (kvseal.testing.FakePeerSource): a query that misses
asks the peer, answers `loading` while the fetch runs, then serves the fetched pages byte-exact; a peer that gives
less, or fails, is a miss of the rest that is not asked for again at once; a transfer that timed out leaves its
pages out of every answer but reserved until it has settled. Other users' instances never ask a peer."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvseal.engine.engine import Engine, QueryResult, Session
from kvseal.engine.registry import Caller
from kvseal.engine.tiers import PEER_RETRY_S
from kvseal.memfd import SharedArray
from kvseal.testing import FakePeerSource, register_one_rank

SLOT = 4096
BLOCKS = 32
WORKER = ("w", 0, 0)
SESSION = Session(Caller(uid=os.getuid(), pid=os.getpid(), privileged=True))


def hashes(start: int, n: int) -> list[bytes]:
    return [i.to_bytes(32, "big") for i in range(start, start + n)]


class Node:
    def __init__(self, session: Session = SESSION) -> None:
        self.shared = SharedArray((BLOCKS, SLOT))
        self.engine = Engine(8 << 20, slab_bytes=1 << 20)
        self.session = session
        status = register_one_rank(
            self.engine, "w", self.shared, namespace="ns", layout_tag="t", dtype="uint8", session=session
        )
        self.namespace_final = status.namespace_final
        assert status.page_bytes == SLOT
        self.peer = FakePeerSource()
        self.engine.use_peers(self.peer)
        self.rng = np.random.default_rng(3)

    def peer_holds(self, keys: list[bytes]) -> list[bytes]:
        pages = [self.rng.integers(0, 256, SLOT, dtype=np.uint8).tobytes() for _ in keys]
        self.peer.hold(self.namespace_final, keys, pages)
        return pages

    def query(self, keys: list[bytes]) -> QueryResult:
        return self.engine.query("w", keys, self.session.caller)

    def query_until_served(self, keys: list[bytes], timeout_s: float = 10.0) -> QueryResult:
        deadline = time.monotonic() + timeout_s
        while (q := self.query(keys)).loading:
            assert time.monotonic() < deadline, "the fetch never finished"
            time.sleep(0.001)  # poll interval of a bounded wait on a real condition (the fetch thread)
        return q

    def close(self) -> None:
        self.engine.close()
        self.shared.close()


@pytest.fixture
def node() -> Iterator[Node]:
    n = Node()
    yield n
    n.close()


def test_a_miss_is_fetched_from_the_peer_and_served_byte_exact(node: Node) -> None:
    keys = hashes(0, 8)
    pages = node.peer_holds(keys[:6])
    assert node.query(keys).loading  # the peer offers 6: they are being fetched
    assert node.peer.lookups == [(node.namespace_final, 8)]
    q = node.query_until_served(keys)
    assert q.hits == 6 and node.peer.fetches == [(node.namespace_final, 6)]
    loaded = node.engine.load(WORKER, keys[:6], list(range(6)), SESSION, q.lease_id)
    assert (loaded.outcome, loaded.loaded) == ("loaded", 6)
    assert [node.shared.array[i].tobytes() for i in range(6)] == pages
    node.engine.store.check_invariants()


def test_a_peer_that_gives_less_is_a_miss_of_the_rest_not_asked_again_at_once(node: Node) -> None:
    keys = hashes(0, 8)
    node.peer_holds(keys)
    node.peer.give = 3
    assert node.query(keys).loading
    assert node.query_until_served(keys).hits == 3
    asked = len(node.peer.lookups)
    assert node.query(keys).hits == 3 and len(node.peer.lookups) == asked  # within PEER_RETRY_S: no new lookup
    assert PEER_RETRY_S >= 1.0
    assert node.engine.statistics().store.inflight_blocks == 0
    node.engine.store.check_invariants()


def test_a_fetch_that_fails_stores_nothing(node: Node) -> None:
    keys = hashes(0, 4)
    node.peer_holds(keys)
    node.peer.fail = ConnectionResetError("the peer went away")
    assert node.query(keys).loading
    assert node.query_until_served(keys).hits == 0
    s = node.engine.statistics().store
    assert (s.resident_blocks, s.inflight_blocks) == (0, 0)
    node.engine.store.check_invariants()


def test_an_unsettled_transfer_keeps_its_pages_reserved_but_out_of_every_answer(node: Node) -> None:
    keys = hashes(0, 6)
    node.peer_holds(keys)
    node.peer.give, node.peer.unsettled = 2, True
    assert node.query(keys).loading
    deadline = time.monotonic() + 10
    while node.engine.statistics().store.resident_blocks < 2:  # the 2 that arrived are sealed
        assert time.monotonic() < deadline
        time.sleep(0.001)  # poll interval of a bounded wait on a real condition (the fetch thread)
    q = node.query(keys)
    assert (q.hits, q.loading) == (2, False)  # the other 4 are not "loading" any more: a miss now
    store = node.engine.store
    reserved = [store.page(node.engine.registry.instances["w"].ns_id, h) for h in keys[2:]]
    assert all(pid is not None and not store.refilling(pid) for pid in reserved)
    assert store.statistics().inflight_blocks == 4  # the transfer may still write them: not reused yet
    store.check_invariants()
    node.peer.settle()
    while node.engine.statistics().store.inflight_blocks:
        assert time.monotonic() < deadline
        time.sleep(0.001)  # poll interval of a bounded wait on a real condition (the fetch thread)
    assert node.query(keys).hits == 2
    store.check_invariants()


def test_another_users_instance_never_asks_a_peer() -> None:
    stranger = Session(Caller(uid=os.getuid() + 4242, pid=1))
    n = Node(stranger)
    try:
        keys = hashes(0, 4)
        n.peer_holds(keys)
        q = n.query(keys)
        assert (q.hits, q.loading) == (0, False) and n.peer.lookups == []
    finally:
        n.close()
