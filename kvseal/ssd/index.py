"""The SSD tier's block index: which blocks the tier holds, where each one's record is, and which segments hold which
blocks. Plain bookkeeping, no I/O: the writers (kvseal.ssd.writer) add what they wrote, the reader
(kvseal.ssd.reader) looks blocks up and drops the ones that fail their checks, recovery (kvseal.ssd.recovery)
builds one from the devices, and the tier (kvseal.ssd.tier) answers prefix / absent / namespaces / purge from it.

    namespaces:  (tenant, final namespace) -> NamespaceBlocks: block hash -> location
    stored:      (tenant, name its records carry) -> the same NamespaceBlocks (an older name after a re-key)
    members:     (device, seq) -> [(NamespaceBlocks, [block hash, ...]), ...]   what each segment was given

    location (one int per block) = | seq (bits 40 and up) | device (bits 32-39) | offset in the segment (bits 0-31) |

A block written again moves to its newest record; reclaiming a segment drops the blocks whose location is still in
it. A segment being read is pinned: reclaimed meanwhile, it loses its blocks at once and its file when the last read
ends (the reader removes it).

Not thread-safe: the caller holds the tier's lock around every call, and around any use of a NamespaceBlocks'
`blocks`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvseal.core.layout import Layout
from kvseal.ssd import format as fmt

NamespaceKey = tuple[int, str]  # (tenant, namespace_final)
SegmentId = tuple[int, int]  # (device number, segment seq)


def location(device: int, seq: int, offset: int) -> int:
    return ((seq << 8) | device) << 32 | offset


def unlocate(loc: int) -> tuple[int, int, int]:
    """(device, seq, offset) of a location."""
    return (loc >> 32) & 0xFF, loc >> 40, loc & 0xFFFFFFFF


@dataclass(slots=True)
class NamespaceBlocks:
    """One namespace's blocks on the tier."""

    tenant: int
    name: str  # the current final namespace: the index key, and what new records carry
    descriptor: bytes
    layout: Layout
    blocks: dict[bytes, int] = field(default_factory=dict)  # hash -> location
    names: set[str] = field(default_factory=set)  # what its records may carry: name, and older names re-keyed
    longest_name: int = 0  # bytes of the longest of `names`
    reads: int = 0
    read_failures: int = 0
    name_bytes: int = field(init=False)  # len(name.encode())

    def __post_init__(self) -> None:
        self.name_bytes = len(self.name.encode())

    @property
    def page_bytes(self) -> int:
        return self.layout.page_bytes

    def record_bytes(self, hash_bytes: int, name_bytes: int | None = None) -> int:
        """Bytes of one of its block records: named by `name` (or by a name of `name_bytes` bytes)."""
        return fmt.record_len(self.name_bytes if name_bytes is None else name_bytes, hash_bytes, self.page_bytes)

    def layout_record_bytes(self) -> int:
        """Bytes of its LAYOUT record (one per segment it has blocks in, before the first)."""
        return fmt.record_len(self.name_bytes, 0, len(self.descriptor))


class BlockIndex:
    def __init__(self) -> None:
        self.namespaces: dict[NamespaceKey, NamespaceBlocks] = {}
        self.records = 0  # blocks held, every namespace
        self.bytes = 0  # their page bytes
        self._stored: dict[NamespaceKey, NamespaceBlocks] = {}
        self._members: dict[SegmentId, list[tuple[NamespaceBlocks, list[bytes]]]] = {}
        self._reading: Counter[SegmentId] = Counter()
        self._doomed: set[SegmentId] = set()

    def adopt(self, other: BlockIndex) -> None:
        """Takes over what `other` holds (an index recovery built), replacing what this one held. Pins stay."""
        self.namespaces, self._stored, self._members = other.namespaces, other._stored, other._members
        self.records, self.bytes = other.records, other.bytes

    # ------------------------------------------------------------------ namespaces

    def get(self, key: NamespaceKey) -> NamespaceBlocks | None:
        return self.namespaces.get(key)

    def namespace_for(self, key: NamespaceKey, layout: Layout) -> NamespaceBlocks:
        """The namespace `key`, created (empty, with `layout`) if new. The caller compares its layout's digest."""
        ns = self.namespaces.get(key)
        if ns is None:
            ns = NamespaceBlocks(key[0], key[1], layout.descriptor, layout, names={key[1]})
            ns.longest_name = ns.name_bytes
            self.namespaces[key] = ns
            self._stored[key] = ns
        return ns

    def stored(self, tenant: int, stored_name: str) -> NamespaceBlocks | None:
        """The namespace whose records carry `stored_name`, if one was named so (recovery)."""
        return self._stored.get((tenant, stored_name))

    def alias(self, key: NamespaceKey, descriptor: bytes, layout: Layout, stored_name: str) -> NamespaceBlocks:
        """The namespace `key` (created with `descriptor` and `layout` if new), to which records that carry
        `stored_name` belong from now on (recovery: the same name, or an older one re-keyed to `key`)."""
        ns = self.namespaces.get(key)
        if ns is None:
            ns = NamespaceBlocks(key[0], key[1], descriptor, layout, names={key[1]})
            self.namespaces[key] = ns
        ns.names.add(stored_name)
        ns.longest_name = max(len(n.encode()) for n in ns.names)
        self._stored[(key[0], stored_name)] = ns
        return ns

    def summary(self) -> dict[NamespaceKey, tuple[int, int, bytes]]:
        """Per namespace: blocks, bytes and its descriptor."""
        return {
            key: (len(ns.blocks), len(ns.blocks) * ns.page_bytes, ns.descriptor) for key, ns in self.namespaces.items()
        }

    # ------------------------------------------------------------------ lookups

    def prefix(self, key: NamespaceKey, hashes: Sequence[bytes]) -> int:
        """How many of the leading `hashes` the namespace holds."""
        ns = self.namespaces.get(key)
        if ns is None:
            return 0
        held = ns.blocks
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def holds(self, key: NamespaceKey, hashes: Sequence[bytes]) -> list[bool]:
        """Per hash, whether the namespace holds it (anywhere in the list: a sliding window's blocks)."""
        ns = self.namespaces.get(key)
        if ns is None:
            return [False] * len(hashes)
        held = ns.blocks
        return [h in held for h in hashes]

    def absent(self, key: NamespaceKey, hashes: Sequence[bytes]) -> list[int]:
        """Positions of the `hashes` the namespace does not hold."""
        ns = self.namespaces.get(key)
        if ns is None:
            return list(range(len(hashes)))
        held = ns.blocks
        return [i for i, h in enumerate(hashes) if h not in held]

    # ------------------------------------------------------------------ changes

    def add(self, segment: SegmentId, ns: NamespaceBlocks, hashes: list[bytes], locations: Iterable[int]) -> None:
        """Blocks of `ns` whose records are in `segment` at `locations` (one per hash): held from now on, a block
        already held moving to its new record."""
        before = len(ns.blocks)
        ns.blocks.update(zip(hashes, locations, strict=True))
        added = len(ns.blocks) - before
        self.records += added
        self.bytes += added * ns.page_bytes
        self._members.setdefault(segment, []).append((ns, hashes))

    def discard(self, ns: NamespaceBlocks, block_hash: bytes, loc: int) -> None:
        """Forgets a block whose record at `loc` failed its checks (unless it moved to another record meanwhile)."""
        if ns.blocks.get(block_hash) == loc:
            del ns.blocks[block_hash]
            self.records -= 1
            self.bytes -= ns.page_bytes

    def clear(self, ns: NamespaceBlocks) -> int:
        """Forgets every block of a namespace (a purge; the namespace itself stays known). Returns how many."""
        n = len(ns.blocks)
        self.records -= n
        self.bytes -= n * ns.page_bytes
        ns.blocks.clear()
        return n

    def drop_segment(self, segment: SegmentId) -> bool:
        """Forgets the blocks whose record is in `segment` (a reclaim). True when its file may be removed now; False
        when a read is using it: the read's `unpin` hands it back for removal."""
        for ns, block_hashes in self._members.pop(segment, []):
            held = ns.blocks
            for block_hash in block_hashes:
                loc = held.get(block_hash)
                if loc is not None and unlocate(loc)[:2] == segment:
                    del held[block_hash]
                    self.records -= 1
                    self.bytes -= ns.page_bytes
        if self._reading[segment]:
            self._doomed.add(segment)
            return False
        return True

    # ------------------------------------------------------------------ reads in flight

    def pin(self, segments: Iterable[SegmentId]) -> None:
        """Segments a read is about to use (once per run of records: a segment may be named more than once)."""
        for segment in segments:
            self._reading[segment] += 1

    def unpin(self, segments: Iterable[SegmentId]) -> list[SegmentId]:
        """Ends the pins of `pin(segments)`; returns the segments reclaimed meanwhile whose last read this was: the
        caller removes their files."""
        remove = []
        for segment in segments:
            self._reading[segment] -= 1
            if not self._reading[segment]:
                del self._reading[segment]
                if segment in self._doomed:
                    self._doomed.discard(segment)
                    remove.append(segment)
        return remove
