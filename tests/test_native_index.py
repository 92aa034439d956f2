"""The native index (kvseal.core._table.Index) against its reference, kvseal.core.index.BlockIndex: the same
operations on both give the same answers, the same errors and the same order of items() and values(), through
growth, deletions (the slots they leave) and rebuilds. Keys are drawn from a small alphabet so that they repeat,
and include keys of other lengths and keys equal in content but distinct objects."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvseal.core import _table
from kvseal.core.index import BlockIndex
from kvseal.wire.lane import HashArray

KEYS = [bytes([i]) * 32 for i in range(40)] + [b"", b"x", b"\0" * 31, b"\0" * 33]
keys = st.sampled_from(KEYS).map(bytes)  # a fresh object with the same content, sometimes
pids = st.integers(0, 2**31 - 1)


class IndexMachine(RuleBasedStateMachine):
    """Both indexes, the same operations; lookups also by a HashArray over a frame (native) vs bytes (reference)."""

    def __init__(self) -> None:
        super().__init__()
        self.native = _table.Index()
        self.reference = BlockIndex()

    def same(self, call: Any) -> None:
        a, b = (self._run(call, index) for index in (self.native, self.reference))
        assert a == b

    @staticmethod
    def _run(call: Any, index: Any) -> tuple[str, Any]:
        try:
            return "ok", call(index)
        except KeyError as e:
            return "KeyError", e.args
        except Exception as e:  # noqa: BLE001 - the two must fail alike
            return type(e).__name__, ""

    @rule(key=keys, pid=pids)
    def set_one(self, key: bytes, pid: int) -> None:
        self.same(lambda index: index.update([key], [pid]))

    @rule(ks=st.lists(keys, max_size=60), base=pids)
    def update(self, ks: list[bytes], base: int) -> None:
        values = [(base + i) % 2**31 for i in range(len(ks))]
        self.same(lambda index: index.update(ks, values))

    @rule(key=keys)
    def delete(self, key: bytes) -> None:
        def call(index: Any) -> None:
            del index[key]

        self.same(call)

    @rule(ks=st.lists(keys, max_size=30, unique=True))
    def remove_present(self, ks: list[bytes]) -> None:
        present = [k for k in ks if k in self.reference]
        self.same(lambda index: index.remove(present))

    @rule(ks=st.lists(keys, max_size=30))
    def lookups(self, ks: list[bytes]) -> None:
        self.same(lambda index: index.get_many(ks))
        same_size = [k for k in ks if len(k) == 32]
        frame = b"head" + b"".join(same_size) + b"tail"  # the hashes as a lane frame carries them, in place
        in_place = HashArray(frame, 4, 32, len(same_size))
        assert self.native.get_many(in_place) == self.reference.get_many(same_size)
        for cut in (slice(1, None), slice(None, 2)):
            assert self.native.get_many(in_place[cut]) == self.reference.get_many(same_size[cut])
        for k in ks[:5]:
            self.same(lambda index, k=k: index.get(k))
            self.same(lambda index, k=k: k in index)
            self.same(lambda index, k=k: index[k])

    @rule(n=st.integers(0, 3000))
    def bulk(self, n: int) -> None:
        """Many keys at once (growth and rebuilds), then most of them removed (deleted slots)."""
        fresh = [n.to_bytes(4, "little") + i.to_bytes(28, "little") for i in range(n)]
        self.same(lambda index: index.update(fresh, list(range(n))))
        self.same(lambda index: index.remove(fresh[: n - n // 10]))

    @invariant()
    def agree(self) -> None:
        assert len(self.native) == len(self.reference)
        assert list(self.native.items()) == list(self.reference.items())
        assert list(self.native.values()) == list(self.reference.values())


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(
    max_examples=400, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_the_native_index_refuses_what_is_not_a_block_hash() -> None:
    index = _table.Index()
    with pytest.raises(TypeError, match="must be bytes"):
        index.update(["text"], [1])
    with pytest.raises(ValueError, match="page id"):
        index.update([b"k"], [-1])
    with pytest.raises(TypeError, match="takes no arguments"):
        _table.Index(1)
    assert len(index) == 0


@pytest.mark.parametrize("table", ["native", "python"])
def test_a_lane_frames_hashes_find_the_same_resident_prefix(table: str) -> None:
    """The store's query and load given a HashArray (the native index reads the frame in place) answer what they
    answer given the same hashes as bytes: the leading sealed pages, stopping at a missing or inflight one."""
    from kvseal.core.layout import LayerGeometry, build_layout
    from kvseal.core.store import BlockStore

    layout = build_layout(16, 1, [LayerGeometry("model.layers.0.attn", "bfloat16", 512, 1, 0, "t")])
    store = BlockStore(1 << 20, slab_bytes=1 << 16, table=table)
    ns = store.namespace("ns.x", layout)
    hashes = [bytes([i]) * 32 for i in range(8)]
    plan = store.begin_save(ns, layout, hashes[:5], 1)
    store.finish_save(plan, True)
    store.begin_save(ns, layout, hashes[5:6], 1)  # left inflight
    frame = b"".join(hashes)
    for probe in (hashes, hashes[2:], [hashes[7], *hashes[:3]], hashes[:0]):
        in_place = HashArray(b"..." + b"".join(probe), 3, 32, len(probe))
        as_bytes = store.query(ns, layout, probe, "A", 1)
        in_frame = store.query(ns, layout, in_place, "A", 1)
        assert as_bytes.hits == in_frame.hits == len(store.begin_load(ns, layout, in_place).pages)
    assert store.query(ns, layout, HashArray(frame, 0, 32, 8), "A", 1).hits == 5


def test_the_native_table_is_built_and_chosen() -> None:
    """CI builds the extension (`pip install -e .`): the table tests above must not be skipped for want of it, and
    a store built with no choice runs the native table unless KVSEAL_TABLE says otherwise."""
    import os

    from kvseal.core import pages
    from kvseal.core.store import BlockStore

    assert pages._table is not None, "kvseal/core/_table.c was not built: pip install -e . needs gcc and headers"
    if not os.environ.get("KVSEAL_TABLE"):
        assert BlockStore(1 << 20, slab_bytes=1 << 16).table == "native"
