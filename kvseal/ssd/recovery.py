"""The SSD tier's recovery at open: what the devices hold, as an index the tier then adopts.

Theory of operation. Per device, in segment order: segment files the device does not trust (kvseal.ssd.device: a
symlink, another user's file) are counted as bad ("untrusted") and skipped, their numbers never reused; a sealed
segment gives its summary (one read); a segment that was being written when the engine stopped is scanned record by
record through a large window, cut at its first bad record (a torn tail) and sealed, so it is never scanned again.
The device's notes (kvseal.ssd.format) are honoured: quarantined records are left out, and a purged namespace's
records before its purge mark.

A namespace whose descriptor is not one this version builds is dropped and reported; one whose final namespace was
computed by an older fingerprint is re-keyed to the current one (its records keep their stored name, which the
reader accepts for it).

Modes: "scan" (the above; a bad header or summary is counted and the segment scanned instead), "strict" (the first
fault raises RuntimeError: nothing is started), "none" (every segment is removed: the tier starts empty). With
`readonly` (an inspection) nothing on the devices changes: no segment is sealed or removed.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvseal.core.layout import layout_from_descriptor, namespace_final, part_of
from kvseal.ssd import format as fmt
from kvseal.ssd.device import ALIGN, Device
from kvseal.ssd.index import BlockIndex, NamespaceBlocks, location
from kvseal.ssd.writer import Segment, seal_segment

log = logging.getLogger("kvseal.ssd")

RECOVERY_MODES = ("scan", "strict", "none")

_Group = tuple[fmt.Namespace, list[int], list[bytes]]  # a namespace of a segment: its blocks' offsets and hashes


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    segments: int = 0
    records: int = 0
    seconds: float = 0.0
    scanned_segments: int = 0
    torn_cut: int = 0  # segments whose tail was cut
    bad: dict[str, int] = field(default_factory=dict)  # records or segments dropped, by reason
    rekeyed: dict[str, str] = field(default_factory=dict)  # old final namespace -> current
    dropped_namespaces: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class RecoveredDevice:
    sealed: list[int]  # its sealed segments, oldest first (every one recovered: none is left being written)
    next_seq: int  # the first segment number never used on it, nor named by a note or an untrusted file


@dataclass(frozen=True, slots=True)
class Recovered:
    index: BlockIndex
    devices: list[RecoveredDevice]  # in the order of the devices given
    report: RecoveryReport


def recover(devices: Sequence[Device], mode: str, *, readonly: bool = False) -> Recovered:
    """Builds the index of what `devices` hold (a device's number in the locations is its position). Without
    `readonly`, segments found unsealed are sealed, and with mode "none" every segment is removed. RuntimeError in
    mode "strict" at the first fault; OSError when a device cannot be read."""
    if mode not in RECOVERY_MODES:
        raise ValueError(f"recovery must be one of {RECOVERY_MODES}, got {mode!r}")
    return _Recovery(mode, readonly).run(devices)


class _Window:
    """Reads of one segment through a large window, so a scan costs one device read per window, not per record."""

    SIZE = 8 << 20

    def __init__(self, device: Device, seq: int) -> None:
        self.device, self.seq = device, seq
        self.start, self.data = 0, memoryview(b"")

    def view(self, at: int, n: int) -> memoryview:
        """Bytes [at, at + n) (fewer at the segment's end), valid until the next call."""
        if at < self.start or at + n > self.start + len(self.data):
            self.start, self.data = at, self.device.read(self.seq, at, max(n, self.SIZE))
        return self.data[at - self.start : at - self.start + n]


class _Recovery:
    def __init__(self, mode: str, readonly: bool) -> None:
        self.mode = mode
        self.readonly = readonly
        self.index = BlockIndex()
        self.bad: Counter[str] = Counter()
        self.records = self.segments = self.scanned = self.torn = 0
        self.rekeyed: dict[str, str] = {}
        self.dropped: set[str] = set()
        self.purged: dict[tuple[int, str], tuple[int, int]] = {}

    def run(self, devices: Sequence[Device]) -> Recovered:
        t0 = time.perf_counter()
        recovered = [self._device(number, device) for number, device in enumerate(devices)]
        report = RecoveryReport(
            segments=self.segments,
            records=self.records,
            seconds=time.perf_counter() - t0,
            scanned_segments=self.scanned,
            torn_cut=self.torn,
            bad=dict(self.bad),
            rekeyed=self.rekeyed,
            dropped_namespaces=sorted(self.dropped),
        )
        return Recovered(self.index, recovered, report)

    def _device(self, number: int, device: Device) -> RecoveredDevice:
        notes = fmt.parse_notes(device.notes())
        for line in notes.unparsed:
            log.warning("ssd %s: a note that does not parse is ignored: %r", device.name, line)
        self.purged = notes.purged
        segments = device.segments()
        untrusted: dict[int, str] = dict(getattr(device, "untrusted", {}))
        for seq, why in sorted(untrusted.items()):
            self._distrust(device, seq, why)
        # segment numbers only grow, past every segment a note names too: a note never applies to a newer one,
        # and past every name an untrusted file holds (never written through, nor its name reused)
        noted = [seq for seq, _ in notes.quarantined] + [seq for seq, _ in notes.purged.values()]
        next_seq = max([1, *(seq + 1 for seq in segments + noted + list(untrusted))])
        sealed: list[int] = []
        for seq in segments:
            if self.mode == "none":
                device.remove(seq)
                continue
            self._segment(number, device, seq, {off for s, off in notes.quarantined if s == seq}, sealed)
        return RecoveredDevice(sealed, next_seq)

    def _fault(self, what: str, error: fmt.FormatError) -> None:
        if self.mode == "strict":
            raise RuntimeError(f"ssd recovery (strict): {what}: {error}")
        self.bad[error.reason] += 1
        log.warning("ssd recovery: %s: %s", what, error)

    def _distrust(self, device: Device, seq: int, why: str) -> None:
        """A segment name the device would not open as the engine's own file (a symlink, another user's file...)."""
        what = f"{device.name} segment {seq} is not trusted ({why})"
        if self.mode == "strict":
            raise RuntimeError(f"ssd recovery (strict): {what}")
        self.bad["untrusted"] += 1
        log.warning("ssd recovery: %s: skipped, never read nor written (move it away to silence this)", what)

    def _segment(self, number: int, device: Device, seq: int, quarantined: set[int], sealed: list[int]) -> None:
        """Indexes one segment's blocks and appends it to `sealed` (sealing it first if it was being written)."""
        try:
            header = fmt.decode_segment_header(device.read(seq, 0, fmt.SEGMENT_HEADER_BYTES))
        except fmt.FormatError as e:  # its records describe themselves: scan them, and seal it again
            self._fault(f"{device.name} segment {seq} header (scanning instead)", e)
            header = fmt.SegmentHeader(seq, 0.0, False)
        groups: list[_Group] | None = None
        if header.sealed:
            try:
                groups = self._summary(device, seq, header)
            except fmt.FormatError as e:
                self._fault(f"{device.name} segment {seq} summary (scanning instead)", e)
        end = 0
        if groups is None:
            groups, end = self._scan(device, seq)
            self.scanned += 1
        self.segments += 1
        base = location(number, seq, 0)
        for table_ns, offsets, block_hashes in groups:
            ns = self._namespace(table_ns)
            if ns is None:
                continue
            mark = self.purged.get((table_ns.tenant, table_ns.namespace_final))
            if mark is not None and mark > (seq, 0):  # purged after some of these records were written
                kept = [(o, h) for o, h in zip(offsets, block_hashes, strict=True) if (seq, o) >= mark]
                offsets, block_hashes = [o for o, _ in kept], [h for _, h in kept]
            if quarantined:
                kept = [(o, h) for o, h in zip(offsets, block_hashes, strict=True) if o not in quarantined]
                offsets, block_hashes = [o for o, _ in kept], [h for _, h in kept]
            self.index.add((number, seq), ns, block_hashes, [base + o for o in offsets])
            self.records += len(block_hashes)
        if (header.sealed and end == 0) or self.readonly:
            sealed.append(seq)
            return
        # a segment that was being written: seal what is valid, so it is never appended to or scanned again
        seg = Segment(seq, used=fmt.align(end, ALIGN))
        for ref, (table_ns, offsets, block_hashes) in enumerate(groups):
            seg.table.append(table_ns)
            for o, h in zip(offsets, block_hashes, strict=True):
                seg.entries.append(fmt.SummaryEntry(fmt.BLOCK, ref, o, 0, 0, h))
        if seg.used + seg.summary_reserve() <= device.segment_bytes:  # else no room: scanned at every start
            try:
                seal_segment(device, seg)
            except OSError as e:
                log.error("ssd %s: could not seal recovered segment %d: %s", device.name, seq, e)
        sealed.append(seq)

    def _summary(self, device: Device, seq: int, header: fmt.SegmentHeader) -> list[_Group]:
        data = device.read(seq, header.summary_offset, header.summary_len)
        record = fmt.decode_record_header(data)
        if record.kind != fmt.SUMMARY:
            raise fmt.FormatError("checksum", "the header points at no summary")
        table, rows = fmt.decode_summary(fmt.verify_payload(record, data))
        rows = rows[rows["kind"] == fmt.BLOCK]
        groups = []
        for ref in np.unique(rows["ns_ref"]).tolist():
            mine = rows[rows["ns_ref"] == ref]
            groups.append((table[ref], mine["offset"].tolist(), fmt.entry_hashes(mine)))
        return groups

    def _scan(self, device: Device, seq: int) -> tuple[list[_Group], int]:
        """Every valid block record of an unsealed segment, up to its first bad one, read in large windows.
        Returns them by namespace, and where the valid records end."""
        size = device.segment_bytes
        window = _Window(device, seq)
        at = fmt.SEGMENT_HEADER_BYTES
        table: dict[tuple[int, str], fmt.Namespace] = {}
        groups: dict[tuple[int, str], _Group] = {}
        end = at
        while at < size:
            head = window.view(at, min(ALIGN, size - at))
            if len(head) < 4 or bytes(head[:4]) != fmt.RECORD_MAGIC:
                gap = fmt.align(at, ALIGN) - at  # a batch's padding runs to the next aligned offset
                if not any(head[: gap or len(head)]):
                    if gap and at + gap < size and bytes(window.view(at + gap, 4)) == fmt.RECORD_MAGIC:
                        at += gap
                        continue
                    break  # zeros: the end of what was written
                self._cut(device, seq, at, fmt.FormatError("checksum", "bad magic"))
                break
            try:
                header = fmt.decode_record_header(head)
                record = window.view(at, header.record_len)
                if header.kind != fmt.SUMMARY:
                    fmt.verify_payload(header, record)
            except fmt.FormatError as e:
                self._cut(device, seq, at, e)
                break
            name = (header.tenant, header.namespace_final)
            if header.kind == fmt.LAYOUT:
                descriptor = bytes(record[header.header_len : header.header_len + header.payload_len])
                table[name] = fmt.Namespace(header.tenant, header.namespace_final, descriptor)
            elif header.kind == fmt.BLOCK:
                if name not in table:
                    self._cut(device, seq, at, fmt.FormatError("digest", "a block before its namespace's layout"))
                    break
                group = groups.setdefault(name, (table[name], [], []))
                group[1].append(at)
                group[2].append(header.block_hash)
            at += header.record_len
            end = at
        return list(groups.values()), end

    def _cut(self, device: Device, seq: int, at: int, error: fmt.FormatError) -> None:
        self.torn += 1
        self._fault(f"{device.name} segment {seq}: torn tail cut at offset {at}", error)

    def _namespace(self, table_ns: fmt.Namespace) -> NamespaceBlocks | None:
        """The index's namespace for a table entry, made on first sight (re-keyed or dropped as the descriptor
        says)."""
        ns = self.index.stored(table_ns.tenant, table_ns.namespace_final)
        if ns is not None:
            return ns
        if table_ns.namespace_final in self.dropped:
            return None
        layout = layout_from_descriptor(table_ns.descriptor)
        client, _, _ = table_ns.namespace_final.rpartition(".")
        if layout is None or not client:
            self.dropped.add(table_ns.namespace_final)
            log.warning(
                "ssd recovery: namespace %r has a layout descriptor this kvseal does not build: dropped",
                table_ns.namespace_final,
            )
            return None
        stored = table_ns.namespace_final
        # a group's namespace keeps its name: its descriptor is the group's, the fingerprint in its name the layout's
        current = stored if part_of(stored) else namespace_final(client, layout)
        if current != stored:
            self.rekeyed[stored] = current
        return self.index.alias((table_ns.tenant, current), table_ns.descriptor, layout, table_ns.namespace_final)
