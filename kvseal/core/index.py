"""Namespaces and their block indexes: which page holds a block hash, per tenant's final namespace.

A namespace record (`Namespace`) holds the namespace's index (block hash -> page id, for its inflight and sealed
pages) and its statistics. The index is split into INDEX_SHARDS dicts so that no single dict resize copies
millions of entries under the engine lock. `ChangeLog` records the blocks that become resident or stop being, for
the MetaServer announcer.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvseal.core.ghost import WhatIf
from kvseal.core.layout import Layout
from kvseal.core.pages import INFLIGHT, SEALED, PageTable

try:
    from kvseal.core._table import Index as NativeIndex
except ImportError:  # not built: BlockIndex only
    NativeIndex = None  # type: ignore[assignment,misc]

INDEX_SHARDS = 256  # dicts per namespace index (see BlockIndex), a power of two
_SHARD_MASK = INDEX_SHARDS - 1


class BlockIndex:
    """A namespace's block hash -> page id map, split into INDEX_SHARDS dicts by the hash of the key. A dict that
    fills doubles its table and copies every entry in one go: at 700 k entries that took 42 ms, under the engine
    lock; a shard's resize copies 1/INDEX_SHARDS of that. Keys are block hashes (bytes cache their hash)."""

    __slots__ = ("_shards",)

    def __init__(self) -> None:
        self._shards: list[dict[bytes, int]] = [{} for _ in range(INDEX_SHARDS)]

    def get(self, key: bytes) -> int | None:
        return self._shards[hash(key) & _SHARD_MASK].get(key)

    def get_many(self, keys: Sequence[bytes]) -> list[int | None]:
        return list(map(dict.get, self._shards_of(keys), keys))

    def _shards_of(self, keys: Iterable[bytes]) -> Iterator[dict[bytes, int]]:
        # maps of builtins only: no Python bytecode per key
        return map(self._shards.__getitem__, map(_SHARD_MASK.__and__, map(hash, keys)))

    def __getitem__(self, key: bytes) -> int:
        return self._shards[hash(key) & _SHARD_MASK][key]

    def __contains__(self, key: object) -> bool:
        return key in self._shards[hash(key) & _SHARD_MASK]

    def __delitem__(self, key: bytes) -> None:
        del self._shards[hash(key) & _SHARD_MASK][key]

    def update(self, keys: Sequence[bytes], pids: Sequence[int]) -> None:
        deque(map(dict.__setitem__, self._shards_of(keys), keys, pids), maxlen=0)

    def remove(self, keys: Sequence[bytes]) -> None:
        """Deletes keys that are all present."""
        deque(map(dict.__delitem__, self._shards_of(keys), keys), maxlen=0)

    def __len__(self) -> int:
        return sum(map(len, self._shards))

    def items(self) -> Iterator[tuple[bytes, int]]:
        return itertools.chain.from_iterable(shard.items() for shard in self._shards)

    def values(self) -> Iterator[int]:
        return itertools.chain.from_iterable(shard.values() for shard in self._shards)


class HashIndex(Protocol):
    """What the store asks of a namespace's index: BlockIndex, or its C twin kvseal.core._table.Index (the native
    table's), which keeps the same order in items() and values()."""

    def get(self, key: bytes) -> int | None: ...
    def get_many(self, keys: Sequence[bytes]) -> list[int | None]: ...
    def __getitem__(self, key: bytes) -> int: ...
    def __contains__(self, key: object) -> bool: ...
    def __delitem__(self, key: bytes) -> None: ...
    def update(self, keys: Sequence[bytes], pids: Sequence[int]) -> None: ...
    def remove(self, keys: Sequence[bytes]) -> None: ...
    def __len__(self) -> int: ...
    def items(self) -> Iterable[tuple[bytes, int]]: ...
    def values(self) -> Iterable[int]: ...


@dataclass(slots=True)
class Namespace:
    """A tenant's final namespace: its index and its statistics (BlockStore.namespace_stats hands these out)."""

    namespace_final: str
    layout_id: int
    tenant: int = 0  # whose blocks these are: the same final namespace of two tenants shares nothing
    index: HashIndex = field(default_factory=BlockIndex, repr=False)  # block hash -> page id (inflight or sealed)
    resident_blocks: int = 0
    resident_bytes: int = 0
    hits: int = 0
    misses: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    last_used: float = 0.0  # wall clock (unix seconds)
    what_if: WhatIf = field(default_factory=lambda: WhatIf(0), repr=False)  # its hit ratio with a larger pool


NamespaceStats = Namespace  # the record's former name


class Namespaces:
    """Every namespace by id, and every layout by id (namespaces of one layout share its Layout)."""

    def __init__(self, native: bool = False) -> None:
        """`native`: each namespace's index is kvseal.core._table.Index (the extension must be built)."""
        self._new_index: Callable[[], HashIndex] = NativeIndex if native else BlockIndex
        self.records: list[Namespace] = []
        self.layouts: list[Layout] = []
        self._layout_ids: dict[bytes, int] = {}
        self._ids: dict[tuple[int, str], int] = {}

    def add(self, namespace_final: str, layout: Layout, tenant: int) -> int:
        """The id of a tenant's final namespace, created on first use with `layout` as the one it holds."""
        key = (tenant, namespace_final)
        ns_id = self._ids.get(key)
        if ns_id is None:
            layout_id = self._layout_ids.setdefault(layout.digest, len(self.layouts))
            if layout_id == len(self.layouts):
                self.layouts.append(layout)
            ns_id = len(self.records)
            self.records.append(Namespace(namespace_final, layout_id, tenant, self._new_index()))
            self._ids[key] = ns_id
        return ns_id

    def id_of(self, tenant: int, namespace_final: str) -> int | None:
        return self._ids.get((tenant, namespace_final))

    def __getitem__(self, ns_id: int) -> Namespace:
        return self.records[ns_id]

    def __len__(self) -> int:
        return len(self.records)

    def layout_of(self, ns_id: int) -> Layout:
        return self.layouts[self.records[ns_id].layout_id]

    def check(self, pages: PageTable) -> None:
        """Asserts that the indexes hold exactly the pages in use (inflight or sealed), each under its namespace
        and hash, and that the resident counts are the sealed ones."""
        entries = 0
        for ns_id, ns in enumerate(self.records):
            sealed = 0
            for block_hash, pid in ns.index.items():
                state = pages.state[pid]
                assert state in (INFLIGHT, SEALED) and pages.ns_of[pid] == ns_id
                assert pages.block_hash[pid] == block_hash
                sealed += state == SEALED
                entries += 1
            assert ns.resident_blocks == sealed
            assert ns.resident_bytes == ns.resident_blocks * self.layout_of(ns_id).page_bytes
        # distinct pages (a page has one namespace and hash), as many as are in use: every one is in an index
        assert entries == len(pages.cells) + pages.resident_blocks

    def count_resident(self, ns_id: int, n: int) -> None:
        """n more (or, negative, fewer) of the namespace's blocks are resident."""
        ns = self.records[ns_id]
        ns.resident_blocks += n
        ns.resident_bytes += n * self.layouts[ns.layout_id].page_bytes


class ChangeLog:
    """While tracking (`start`), every block that becomes resident (sealed) or stops being (evicted, purged), as
    (resident, namespace id, hash), in order."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: list[tuple[bool, int, bytes]] | None = None

    def start(self) -> None:
        if self._entries is None:
            self._entries = []

    def take(self) -> list[tuple[bool, int, bytes]]:
        """The changes since the last call ([] when not tracking)."""
        entries = self._entries
        if entries is None:
            return []
        self._entries = []
        return entries

    def record(self, resident: bool, ns_ids: Iterable[int], hashes: Iterable[bytes | None]) -> None:
        """Notes blocks (lazy iterables, consumed at once and only while tracking)."""
        if self._entries is not None:
            self._entries.extend(zip(itertools.repeat(resident), ns_ids, hashes))  # type: ignore[arg-type]


def resident_prefix(pages: PageTable, index: HashIndex, ns_id: int, hashes: Sequence[bytes]) -> list[int]:
    """Page ids of the leading hashes that are sealed in the namespace (ns_id, whose index this is).

    A prompt's blocks are mostly saved in one batch, so their pages mostly have consecutive ids: the run of
    pages after the first hash's is compared first (adjacent entries of the page table), and the index, whose
    lookups each touch cold memory once a pool holds millions of blocks, answers only when that run does not
    match."""
    if NativeIndex is not None and isinstance(index, NativeIndex):
        # one call, reading a lane frame's hashes in place, the page after each found one tried first (see below)
        return index.sealed_prefix(hashes, pages.state, pages.block_hash, pages.ns_of, ns_id)
    if not hashes:
        return []
    first = index.get(hashes[0])
    if first is None:
        return []
    n = len(hashes)
    found: list[int | None]
    if pages.block_hash[first : first + n] == list(hashes) and pages.ns_of[first : first + n].count(ns_id) == n:
        found = list(range(first, first + n))
    else:
        found = index.get_many(hashes)
    del found[pages.sealed_prefix(found) :]  # a hash not stored or an inflight page ends the resident prefix
    return found  # type: ignore[return-value]


def compare_layouts(stored: Layout, instance: Layout) -> tuple[str, str] | None:
    """Why pages of `stored` may not be loaded by an instance of `instance`, or None when they may."""
    if stored.digest == instance.digest:  # the descriptor fixes every slot: nothing else can differ
        return None
    if stored.num_slots != instance.num_slots:
        return "slot_count", f"stored block has {stored.num_slots} slots but instance expects {instance.num_slots}"
    for slot, (have, want) in enumerate(zip(stored.slot_sizes, instance.slot_sizes, strict=True)):
        if have != want:
            layer = instance.layers[slot // instance.tp_size].name
            return "slot_bytes", (
                f"stored block's slot {slot} ({layer!r}, tp_rank {slot % instance.tp_size}) holds {have} bytes "
                f"but instance expects {want}"
            )
    if stored.digest != instance.digest:
        return "digest", (
            f"stored block was written under layout digest {stored.digest.hex()} but instance has "
            f"{instance.digest.hex()}"
        )
    return None
