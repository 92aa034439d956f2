"""The engine with an SSD tier, in-process (the tier on kvseal.testing.MemoryDevice): sealed blocks are written
through, a query whose prefix continues on SSD answers `loading` until the records are read, verified and sealed
in the pool, a restarted engine serves its predecessor's blocks byte-exact, a bad record ends the prefix, and
nothing is written twice or left pinned."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvseal.engine.engine import Caller, Engine, QueryResult, Session
from kvseal.memfd import SharedArray
from kvseal.ssd.tier import DiskTier
from kvseal.testing import MemoryDevice, register_one_rank

SLOT = 8192
BLOCKS = 64
SESSION = Session(Caller(uid=os.getuid(), pid=os.getpid(), privileged=True))
POLL_S = 10.0


def register_instance(engine: Engine, instance: str, dtype: str, shared: SharedArray) -> None:
    """Registers a one-layer instance of BLOCKS blocks of SLOT bytes in `shared` (one worker, SESSION's)."""
    register_one_rank(engine, instance, shared, namespace="llama", layout_tag="test", dtype=dtype, session=SESSION)


class Node:
    """An engine with a tier over `device`, and one registered worker whose KV is a sealed memfd."""

    def __init__(
        self, device: MemoryDevice, instance: str = "w", dtype: str = "bfloat16", seed: int = 7, eviction: str = ""
    ) -> None:
        self.tier = DiskTier([device], batch_bytes=64 << 10)
        self.tier.open()
        policy = {"eviction": eviction} if eviction else {}
        self.engine = Engine(4 << 20, slab_bytes=1 << 20, ssd=self.tier, **policy)  # 8 KiB pages: 512 blocks
        self.shared = SharedArray((BLOCKS, SLOT))
        self.kv = self.shared.array
        self.kv[:] = np.random.default_rng(seed).integers(0, 256, self.kv.shape, dtype=np.uint8)
        self.worker = (instance, 0, 0)
        register_instance(self.engine, instance, dtype, self.shared)

    def save(self, block_hashes: list[bytes]) -> None:
        r = self.engine.save(self.worker, block_hashes, list(range(len(block_hashes))), SESSION)
        assert r.not_stored == 0
        self.tier.flush()

    def query(self, block_hashes: list[bytes]) -> tuple[QueryResult, int]:
        """Asks until the answer is not `loading`; returns it and how many times it was loading."""
        deadline = time.monotonic() + POLL_S
        loading = 0
        while True:
            q = self.engine.query(self.worker[0], block_hashes, SESSION.caller, request_id="r1")
            if not q.loading:
                return q, loading
            assert q.hits == 0 and q.lease_id == 0
            loading += 1
            assert time.monotonic() < deadline, "the refill did not finish"
            time.sleep(0.001)  # poll interval of a bounded wait on a real condition (the refill thread)

    def load(self, block_hashes: list[bytes], lease_id: int) -> np.ndarray:
        self.kv[:] = 0
        r = self.engine.load(self.worker, block_hashes, list(range(len(block_hashes))), SESSION, lease_id)
        assert r.outcome == "loaded", r
        return self.kv[: len(block_hashes)].copy()

    def close(self) -> None:
        self.engine.close()
        self.shared.close()


@pytest.fixture
def device() -> MemoryDevice:
    return MemoryDevice(16 << 20, 512 << 10)


@pytest.fixture
def nodes(device: MemoryDevice) -> Iterator[list[Node]]:
    made: list[Node] = []
    yield made
    for node in made:
        node.close()


def hashes(tag: str, n: int) -> list[bytes]:
    return [f"{tag}{i}".encode().ljust(32, b"-") for i in range(n)]


def test_a_restarted_engine_loads_its_predecessors_blocks_from_ssd(device: MemoryDevice, nodes: list[Node]) -> None:
    first = Node(device)
    nodes.append(first)
    hs = hashes("a", 40)
    saved = first.kv[:40].copy()
    first.save(hs)
    assert first.tier.statistics().records == 40
    s = first.engine.store.statistics()
    assert s.pinned_blocks == 0  # the writer's pins are gone
    first.close()
    nodes.remove(first)

    second = Node(device, seed=99)  # another process after a restart: same layout, other memory contents
    nodes.append(second)
    q, loading = second.query(hs)
    assert loading >= 1 and q.hits == 40
    assert np.array_equal(second.load(hs, q.lease_id), saved)
    assert second.tier.statistics().records == 40  # refilled blocks are not written again
    view = {n["namespace"]: n for n in second.engine.namespaces()}
    (ns,) = view.values()
    assert (ns["resident_blocks"], ns["ssd_blocks"], ns["ssd_bytes"]) == (40, 40, 40 * SLOT)
    second.engine.store.check_invariants()


def test_a_prefix_that_continues_on_ssd_loads_as_one_hit(device: MemoryDevice, nodes: list[Node]) -> None:
    node = Node(device)
    nodes.append(node)
    hs = hashes("b", 30)
    saved = node.kv[:30].copy()
    node.save(hs)
    # fill the pool with other blocks, touching the first 10 in between: the other 20 are evicted
    for i in range(10):
        touch = node.engine.query("w", hs[:10], SESSION.caller)
        node.engine.release("w", touch.lease_id, SESSION.caller)
        node.save(hashes(f"filler{i}-", BLOCKS))
    inst = node.engine.registry.instances["w"]
    resident = node.engine.store.query(inst.ns_id, inst.sealed.layout, hs, owner="t", shares=1)
    node.engine.store.release(resident.lease_id, "t")
    assert resident.hits == 10
    assert node.engine.query("w", hs, SESSION.caller).loading
    q, _ = node.query(hs)
    assert q.hits == 30
    assert np.array_equal(node.load(hs, q.lease_id), saved)


def test_a_block_hit_on_ssd_outlives_its_segment_and_a_restart(nodes: list[Node]) -> None:
    """Second chance: blocks read from SSD while their segment is in the oldest three quarters of the log (the
    newest 16 of 64 segments are young) are written again,
    so the log's FIFO reclaim keeps them (and a restart finds their newest records); blocks written beside them and
    never hit go with their segment. The device holds 64 segments of about 60 blocks, the pool 8 of them."""
    device = MemoryDevice(32 << 20, 512 << 10)
    node = Node(device, eviction="prefix-lru")  # under prefix-slru the pool would keep the blocks hit once
    nodes.append(node)
    hit, cold = hashes("hit", 8), hashes("cold", 8)
    saved = node.kv[:8].copy()
    node.save(hit)
    node.save(cold)

    def fill(tag: str, segments: int) -> None:  # about `segments` segments of other blocks, which the pool evicts
        for i in range(segments):
            node.save(hashes(f"{tag}{i}-", BLOCKS))

    fill("young", 10)
    q, loading = node.query(hit)
    assert loading and q.hits == 8  # from SSD, but the segment is young: nothing to write again
    node.engine.release("w", q.lease_id, SESSION.caller)
    node.tier.flush()
    assert node.tier.statistics().reinserted == 0
    fill("old", 10)  # the pool no longer holds `hit`; its segment is now in the older three quarters
    q, loading = node.query(hit)
    assert loading and q.hits == 8
    node.engine.release("w", q.lease_id, SESSION.caller)
    node.tier.flush()
    assert node.tier.statistics().reinserted == 8
    fill("late", 45)  # the first segments are reclaimed
    s = node.tier.statistics()
    assert s.segments < 64 and s.skipped == 0
    q, loading = node.query(hit)
    assert loading and q.hits == 8 and np.array_equal(node.load(hit, q.lease_id), saved)
    assert node.query(cold)[0].hits == 0  # never hit: gone with its segment
    node.close()
    nodes.remove(node)

    again = Node(device, seed=99)
    nodes.append(again)
    q, loading = again.query(hit)
    assert loading and q.hits == 8 and np.array_equal(again.load(hit, q.lease_id), saved)
    assert again.query(cold)[0].hits == 0
    again.engine.store.check_invariants()


def test_a_bad_record_ends_the_prefix_before_it(device: MemoryDevice, nodes: list[Node]) -> None:
    first = Node(device)
    nodes.append(first)
    hs = hashes("c", 12)
    saved = first.kv[:12].copy()
    first.save(hs)
    first.close()
    nodes.remove(first)
    seq = device.segments()[0]
    data = device.files[seq]
    at = data.find(hs[5])  # the sixth block's record: flip a byte of its payload
    data[at + 200] ^= 0x40
    second = Node(device, seed=3)
    nodes.append(second)
    q, _ = second.query(hs)
    assert q.hits == 5
    assert np.array_equal(second.load(hs[:5], q.lease_id), saved[:5])
    assert second.tier.statistics().verify_failures == {"checksum": 1}
    second.engine.store.check_invariants()


def test_two_instances_saving_one_prefix_write_it_once(device: MemoryDevice, nodes: list[Node]) -> None:
    node = Node(device)
    nodes.append(node)
    other_kv = SharedArray((BLOCKS, SLOT))
    try:
        register_instance(node.engine, "v", "bfloat16", other_kv)
        hs = hashes("d", 16)
        node.save(hs)
        node.engine.save(("v", 0, 0), hs, list(range(16)), SESSION)
        node.tier.flush()
        assert node.tier.statistics().records == 16
        writes = device.writes
        node.save(hs)  # sealed: skipped, nothing to write
        assert device.writes == writes
    finally:
        other_kv.close()


def test_another_layout_never_refills_from_these_records(device: MemoryDevice, nodes: list[Node]) -> None:
    node = Node(device, dtype="bfloat16")
    nodes.append(node)
    hs = hashes("e", 8)
    node.save(hs)
    fp16 = SharedArray((BLOCKS, SLOT))  # same bytes per block, another dtype: another final namespace
    try:
        register_instance(node.engine, "x", "float16", fp16)
        q = node.engine.query("x", hs, SESSION.caller)
        assert (q.hits, q.loading) == (0, False)
        assert len(node.tier.namespaces()) == 1
    finally:
        fp16.close()
