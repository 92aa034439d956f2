"""The SSD tier's disk engine: which blocks are on which device, how they get there and back, and what survives.

Theory of operation. The engine hands over sealed blocks (write-through: the page stays pinned until written) in
batches per namespace. Each device has one writer thread that appends the queued batches to its newest segment
as one large aligned write (records are built in place in a staging buffer, kvseal.ssd.format), and makes them
visible in the index when the write returned. A full segment is sealed (summary record, then header); when the
device is at capacity the oldest segment is reclaimed whole: its index entries go first, under the lock, and the
file once no read is using it. Batches go to devices in turn, so several paths stripe.

Reads come from a pool of threads (queue depth > 1: one read per run of adjacent records). Every record read is
checked before its page may become visible: header and payload checksums, tenant, final namespace, block hash,
layout digest against its namespace's descriptor and payload length against the reader's page. A failure is
counted by reason, the record quarantined (dropped from the index, noted on the device so a restart skips it too)
and reported to the caller, who serves the prefix before it.

Recovery (`open`): segment files the device does not trust (kvseal.ssd.device: a symlink, another user's file)
are counted as bad ("untrusted") and skipped, their numbers never reused; sealed segments give their summary (one
read each); a segment that was being written when the engine stopped is scanned record by record, cut at its first
bad record (a torn tail) and sealed. A namespace whose descriptor is not one this version builds is dropped and
reported; one whose final namespace was computed by an older fingerprint is re-keyed to the current one (the
records keep their stored name, checked on read).

A write that fails (ENOSPC, EIO, EFBIG) takes its device out of the write rotation with one logged error: what
is already on it stays readable, and the engine keeps serving from memory. Nothing here blocks a Save: a batch
that finds the queues full is not written (counted as skipped).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvseal.copy.kernel import copy_page
from kvseal.core.layout import Layout, layout_from_descriptor, namespace_final
from kvseal.ssd import format as fmt
from kvseal.ssd.device import ALIGN, Device, aligned_buffer

log = logging.getLogger("kvseal.ssd")

NamespaceKey = tuple[int, str]  # (tenant, namespace_final)
_Group = tuple[fmt.Namespace, list[int], list[bytes]]  # a namespace of a segment: its blocks' offsets and hashes
_MAX_READ_RUN = 8 << 20  # one device read covers adjacent records up to this many bytes
_MAX_READ_GAP = 64 << 10  # records this close are read together (the gap is padding between write batches)
RECOVERY_MODES = ("scan", "strict", "none")
WRITE_DEPTH = 2  # device writes in flight per path: one being written while the next is built


@dataclass(frozen=True, slots=True)
class WriteItem:
    block_hash: bytes
    page: memoryview  # the page's bytes: the caller keeps them unchanged until the batch's `done` is called


@dataclass(slots=True)
class _Namespace:
    tenant: int
    name: str  # the current final namespace: the index key, and what new records carry
    descriptor: bytes
    layout: Layout
    blocks: dict[bytes, int] = field(default_factory=dict)  # hash -> location (see _loc)
    names: set[str] = field(default_factory=set)  # what its records may carry: name, and older names re-keyed
    longest_name: int = 0
    reads: int = 0
    read_failures: int = 0

    @property
    def page_bytes(self) -> int:
        return self.layout.page_bytes


@dataclass(slots=True)
class _Job:
    ns: _Namespace
    items: list[WriteItem]
    done: Callable[[bool], None]
    nbytes: int


@dataclass(slots=True)
class _Segment:
    seq: int
    used: int = fmt.SEGMENT_HEADER_BYTES
    table: list[fmt.Namespace] = field(default_factory=list)
    refs: dict[int, int] = field(default_factory=dict)  # id(_Namespace) -> ref in the table
    entries: list[fmt.SummaryEntry] = field(default_factory=list)  # of the records written
    planned: int = 0  # records built for this segment, written or still in flight
    table_bytes: int = 0

    def summary_reserve(self, more_entries: int = 0, more_table: int = 0) -> int:
        """Bytes the summary record needs if `more_entries` records are added (4 KiB of slack for its header)."""
        entries = (max(len(self.entries), self.planned) + more_entries) * fmt._ENTRY.itemsize
        return fmt.align(4 + self.table_bytes + more_table + entries, ALIGN) + ALIGN


@dataclass(slots=True)
class _Device:
    index: int
    device: Device
    queue: queue.Queue[_Job | None] = field(default_factory=queue.Queue)
    pending_bytes: int = 0
    failed: str = ""
    active: _Segment | None = None
    sealed: list[int] = field(default_factory=list)  # oldest first
    members: dict[int, list[tuple[_Namespace, list[bytes]]]] = field(default_factory=dict)  # seq -> its blocks
    next_seq: int = 1
    thread: threading.Thread | None = None
    io: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(WRITE_DEPTH, "kvseal-ssd-io"))
    staging: list[Any] = field(default_factory=list)  # WRITE_DEPTH aligned staging buffers (mmap), grown on demand
    turn: int = 0


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
class TierStatistics:
    records: int
    bytes: int
    segments: int
    writes: int
    write_bytes: int
    write_seconds: float
    reads: int
    read_bytes: int
    read_seconds: float
    skipped: int  # blocks not written: queues full or no device left to write
    verify_failures: dict[str, int]
    failed_devices: dict[str, str]  # device name -> the error that took it out of the write rotation
    direct: bool
    devices: tuple[str, ...] = ()


def _loc(device: int, seq: int, offset: int) -> int:
    return ((seq << 8) | device) << 32 | offset


def _unloc(loc: int) -> tuple[int, int, int]:
    return (loc >> 32) & 0xFF, loc >> 40, loc & 0xFFFFFFFF


class DiskTier:
    def __init__(
        self,
        devices: Sequence[Device],
        *,
        batch_bytes: int = 4 << 20,
        read_threads: int = 8,
        max_pending_bytes: int = 512 << 20,
    ) -> None:
        if not devices:
            raise ValueError("the SSD tier needs at least one device")
        self._devices = [_Device(i, d) for i, d in enumerate(devices)]
        self.batch_bytes = batch_bytes
        self.max_pending_bytes = max_pending_bytes
        self._lock = threading.Lock()
        self._namespaces: dict[NamespaceKey, _Namespace] = {}
        self._by_stored: dict[NamespaceKey, _Namespace] = {}
        self._quarantined: set[int] = set()
        self._reading: Counter[tuple[int, int]] = Counter()
        self._doomed: set[tuple[int, int]] = set()
        self._turn = 0
        self._reader = ThreadPoolExecutor(read_threads, thread_name_prefix="kvseal-ssd-read")
        self._records = self._bytes = 0
        self._writes = self._write_bytes = self._reads = self._read_bytes = self._skipped = 0
        self._write_seconds = self._read_seconds = 0.0
        self._verify_failures: Counter[str] = Counter()
        self._closed = False

    # ------------------------------------------------------------------ life

    def open(self, recovery: str = "scan") -> RecoveryReport:
        """Rebuilds the index from the devices, then starts the writers."""
        if recovery not in RECOVERY_MODES:
            raise ValueError(f"recovery must be one of {RECOVERY_MODES}, got {recovery!r}")
        report = _Recovery(self, recovery).run()
        for d in self._devices:
            d.thread = threading.Thread(target=self._writer, args=(d,), name=f"kvseal-ssd-write-{d.index}", daemon=True)
            d.thread.start()
        return report

    def close(self) -> None:
        """Writes what is queued, seals the active segments (so the next start reads summaries only), stops."""
        if self._closed:
            return
        self._closed = True
        for d in self._devices:
            d.queue.put(None)
        for d in self._devices:
            if d.thread is not None:
                d.thread.join()
            d.io.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        for d in self._devices:
            if d.active is not None and not d.failed:
                try:
                    self._seal(d)
                except OSError as e:
                    log.error("ssd %s: sealing segment %d at shutdown failed: %s", d.device.name, d.active.seq, e)
            d.device.close()

    # ------------------------------------------------------------------ index

    def prefix(self, key: NamespaceKey, hashes: Sequence[bytes]) -> int:
        """How many of the leading `hashes` the tier holds for the namespace."""
        with self._lock:
            ns = self._namespaces.get(key)
            if ns is None:
                return 0
            n = 0
            for h in hashes:
                if h not in ns.blocks:
                    break
                n += 1
            return n

    def absent(self, key: NamespaceKey, hashes: Sequence[bytes]) -> list[int]:
        """Positions of the hashes the tier does not hold for the namespace (queued ones are pinned in the pool,
        so they cannot be sealed again before their write lands)."""
        with self._lock:
            ns = self._namespaces.get(key)
            if ns is None:
                return list(range(len(hashes)))
            held = ns.blocks
            return [i for i, h in enumerate(hashes) if h not in held]

    def namespaces(self) -> dict[NamespaceKey, tuple[int, int, bytes]]:
        """Per namespace: blocks, bytes and its descriptor."""
        with self._lock:
            return {
                key: (len(ns.blocks), len(ns.blocks) * ns.page_bytes, ns.descriptor)
                for key, ns in self._namespaces.items()
            }

    def purge(self, key: NamespaceKey) -> int:
        """Drops a namespace's blocks: from the index now, and from every later start (a note on each device marks
        where its records end); the records go with their segments. Returns the blocks dropped."""
        with self._lock:
            ns = self._namespaces.get(key)
            if ns is None:
                return 0
            n = len(ns.blocks)
            self._records -= n
            self._bytes -= n * ns.page_bytes
            ns.blocks.clear()
            marks = [(d, d.active.seq, d.active.used) if d.active else (d, d.next_seq, 0) for d in self._devices]
        for d, seq, offset in marks:
            for name in sorted(ns.names):
                try:
                    d.device.note(f"purge {seq} {offset} {ns.tenant} {name}")
                except OSError as e:
                    log.error("ssd %s: purge of %s not noted (a restart brings it back): %s", d.device.name, name, e)
        return n

    # ------------------------------------------------------------------ write

    def write(self, key: NamespaceKey, layout: Layout, items: list[WriteItem], done: Callable[[bool], None]) -> bool:
        """Queues blocks of one namespace for a device; `done(ok)` is called from a writer thread once they are
        written (ok) or given up. False (and no call of `done`) when no device can take them now."""
        nbytes = len(items) * layout.page_bytes
        with self._lock:
            ns = self._namespace_for(key, layout)
            if ns.layout.digest != layout.digest:  # a fingerprint collision: never write one layout under another
                self._verify_failures["digest"] += len(items)
                return False
            for _ in range(len(self._devices)):
                d = self._devices[self._turn % len(self._devices)]
                self._turn += 1
                if not d.failed and d.pending_bytes + nbytes <= self.max_pending_bytes // len(self._devices):
                    d.pending_bytes += nbytes
                    d.queue.put(_Job(ns, items, done, nbytes))
                    return True
            self._skipped += len(items)
            return False

    def _namespace_for(self, key: NamespaceKey, layout: Layout) -> _Namespace:
        ns = self._namespaces.get(key)
        if ns is None:
            ns = _Namespace(key[0], key[1], layout.descriptor, layout, names={key[1]}, longest_name=len(key[1]))
            self._namespaces[key] = ns
            self._by_stored[key] = ns
        return ns

    def _writer(self, d: _Device) -> None:
        while True:
            job = d.queue.get()
            if job is None:
                return
            jobs = [job]
            size = job.nbytes
            stop = False
            while size < self.batch_bytes:
                try:
                    more = d.queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                jobs.append(more)
                size += more.nbytes
            ok = False
            if not d.failed:
                try:
                    self._append(d, jobs)
                    ok = True
                except OSError as e:
                    self._fail(d, e)
            with self._lock:
                d.pending_bytes -= size
                if not ok:
                    self._skipped += sum(len(j.items) for j in jobs)
            for j in jobs:
                j.done(ok)
            if stop:
                return

    def _fail(self, d: _Device, e: OSError) -> None:
        d.failed = f"{e.strerror or e} (errno {e.errno})"
        log.error(
            "ssd %s: write failed: %s; this path takes no more writes (its blocks stay readable); the engine keeps "
            "serving from memory",
            d.device.name,
            d.failed,
        )

    def _append(self, d: _Device, jobs: list[_Job]) -> None:
        """Writes the jobs' blocks as records, in as few device writes as segments and the batch size allow, with
        up to WRITE_DEPTH writes in flight (the next batch is built while the last one goes to the disk). A batch
        becomes visible in the index when its write returned; the first failure is raised once all have ended."""
        records = [(j.ns, item) for j in jobs for item in j.items]
        inflight: deque[tuple[Future[None], Callable[[], None]]] = deque()
        error: OSError | None = None

        def finish_oldest() -> None:
            nonlocal error
            future, commit = inflight.popleft()
            try:
                future.result()
                commit()
            except OSError as e:
                error = error or e

        pos = 0
        try:
            while pos < len(records) and error is None:
                seg = d.active
                ns, item = records[pos]
                need = _record_bytes(ns, item.block_hash) + _layout_bytes(ns)
                if seg is None or seg.used + need + seg.summary_reserve(2, len(ns.descriptor) + 64) > (
                    d.device.segment_bytes
                ):
                    while inflight:
                        finish_oldest()
                    if error is not None:
                        break
                    seg = self._next_segment(d)
                if len(inflight) == WRITE_DEPTH:
                    finish_oldest()
                slot = d.turn % WRITE_DEPTH  # the buffer of the write WRITE_DEPTH writes ago, which has ended
                d.turn += 1
                pos, start, view, commit = self._build_chunk(d, seg, records, pos, slot)
                seg.used = start + len(view)  # reserved now: the next batch goes after it
                inflight.append((d.io.submit(self._timed_write, d, seg.seq, start, view), commit))
        finally:
            while inflight:
                finish_oldest()
        if error is not None:
            raise error

    def _timed_write(self, d: _Device, seq: int, offset: int, view: memoryview) -> None:
        t0 = time.perf_counter()
        d.device.write(seq, offset, view)
        with self._lock:
            self._writes += 1
            self._write_bytes += len(view)
            self._write_seconds += time.perf_counter() - t0

    def _build_chunk(
        self, d: _Device, seg: _Segment, records: list[tuple[_Namespace, WriteItem]], pos: int, slot: int
    ) -> tuple[int, int, memoryview, Callable[[], None]]:
        """Builds as many records as fit in the segment and the batch, from records[pos], in a staging buffer.
        Returns the position after the last one, the segment offset and bytes to write, and what makes them
        visible once written."""
        limit = d.device.segment_bytes
        start = seg.used
        plan: list[tuple[int, _Namespace, int, bytes]] = []  # (offset, ns, kind, hash) in write order
        offset = start
        new_refs: dict[int, _Namespace] = {}
        end = pos
        while end < len(records):
            ns, item = records[end]
            extra = 0
            if id(ns) not in seg.refs and id(ns) not in new_refs:
                extra = _layout_bytes(ns)
            size = _record_bytes(ns, item.block_hash) + extra
            more_table = sum(len(n.descriptor) + len(n.name) + 32 for n in new_refs.values())
            if extra:
                more_table += len(ns.descriptor) + len(ns.name) + 32
            if offset + size + seg.summary_reserve(len(plan) + 2, more_table) > limit:
                break
            if plan and offset + size - start > self.batch_bytes:
                break
            if extra:
                new_refs[id(ns)] = ns
                plan.append((offset, ns, fmt.LAYOUT, b""))
                offset += extra
            plan.append((offset, ns, fmt.BLOCK, item.block_hash))
            offset += _record_bytes(ns, item.block_hash)
            end += 1
        assert end > pos, "a segment that was just opened holds at least one record"
        for ns in new_refs.values():  # the table is the segment's from now on (only this thread uses it)
            seg.refs[id(ns)] = len(seg.table)
            seg.table.append(fmt.Namespace(ns.tenant, ns.name, ns.descriptor))
            seg.table_bytes += len(ns.descriptor) + len(ns.name) + 32
        seg.planned += len(plan)
        total = fmt.align(offset - start, ALIGN)
        while len(d.staging) <= slot:
            d.staging.append(None)
        if d.staging[slot] is None or len(d.staging[slot]) < total:
            d.staging[slot] = aligned_buffer(max(total, self.batch_bytes))
        view = memoryview(d.staging[slot])
        entries: list[fmt.SummaryEntry] = []
        item_iter = iter(records[pos:end])
        for at, ns, kind, block_hash in plan:
            local = at - start
            if kind == fmt.LAYOUT:
                record = fmt.encode_record(fmt.LAYOUT, ns.tenant, ns.name, ns.layout.digest, b"", ns.descriptor)
                view[local : local + len(record)] = record
                entries.append(fmt.SummaryEntry(fmt.LAYOUT, 0, at, len(record), 0, b""))
                continue
            _, item = next(item_iter)
            hlen = fmt.header_len(ns.name, block_hash)
            payload = view[local + hlen : local + hlen + ns.page_bytes]
            copy_page(payload, item.page)
            xxh = fmt.checksum(payload)
            head = fmt.encode_record_header(fmt.BLOCK, ns.tenant, ns.name, ns.layout.digest, block_hash, payload, xxh)
            view[local : local + hlen] = head
            rlen = fmt.align(hlen + ns.page_bytes, fmt.RECORD_ALIGN)
            view[local + hlen + ns.page_bytes : local + rlen] = bytes(rlen - hlen - ns.page_bytes)
            entries.append(fmt.SummaryEntry(fmt.BLOCK, 0, at, rlen, xxh, block_hash))
        view[offset - start : total] = bytes(total - (offset - start))

        def commit() -> None:
            with self._lock:
                written: dict[int, tuple[_Namespace, list[bytes]]] = {}
                for (at, ns, kind, block_hash), e in zip(plan, entries, strict=True):
                    ref = seg.refs[id(ns)]
                    seg.entries.append(
                        fmt.SummaryEntry(e.kind, ref, e.offset, e.record_len, e.payload_xxh, e.block_hash)
                    )
                    if kind == fmt.BLOCK:
                        if block_hash not in ns.blocks:
                            self._records += 1
                            self._bytes += ns.page_bytes
                        ns.blocks[block_hash] = _loc(d.index, seg.seq, at)
                        written.setdefault(id(ns), (ns, []))[1].append(block_hash)
                d.members.setdefault(seg.seq, []).extend(written.values())

        return end, start, view[:total], commit

    def _next_segment(self, d: _Device) -> _Segment:
        """Seals the active segment, makes room (the oldest segment goes when the device is full), opens a new one."""
        if d.active is not None:
            self._seal(d)
        while len(d.sealed) >= d.device.max_segments - 1 and d.sealed:
            self._reclaim(d, d.sealed[0])
        seq = d.next_seq
        d.next_seq += 1
        d.device.create(seq)
        d.device.write(seq, 0, _aligned(fmt.encode_segment_header(fmt.SegmentHeader(seq, time.time(), False))))
        d.active = _Segment(seq)
        return d.active

    def _seal(self, d: _Device) -> None:
        seg = d.active
        assert seg is not None
        payload = fmt.encode_summary(seg.table, seg.entries)
        record = fmt.encode_record(fmt.SUMMARY, 0, "", bytes(32), b"", payload)
        at = seg.used
        d.device.write(seg.seq, at, _aligned(record))
        d.device.sync(seg.seq)
        header = fmt.encode_segment_header(fmt.SegmentHeader(seg.seq, time.time(), True, at, len(record)))
        d.device.write(seg.seq, 0, _aligned(header))
        d.device.sync(seg.seq)
        d.sealed.append(seg.seq)
        d.active = None

    def _reclaim(self, d: _Device, seq: int) -> None:
        """Drops a sealed segment: its index entries now, its file once no read uses it."""
        with self._lock:
            d.sealed.remove(seq)
            for ns, block_hashes in d.members.pop(seq, []):
                for block_hash in block_hashes:
                    loc = ns.blocks.get(block_hash)
                    if loc is not None and _unloc(loc)[:2] == (d.index, seq):
                        del ns.blocks[block_hash]
                        self._records -= 1
                        self._bytes -= ns.page_bytes
            if self._reading[(d.index, seq)]:
                self._doomed.add((d.index, seq))
                return
        d.device.remove(seq)

    # ------------------------------------------------------------------ read

    def read(
        self,
        key: NamespaceKey,
        layout: Layout,
        hashes: Sequence[bytes],
        destinations: Sequence[memoryview],
        *,
        quarantine: bool = True,
    ) -> list[str]:
        """Reads the blocks of `hashes` into `destinations` (one page each), verified. Returns per block "" (read)
        or the reason it was not: checksum, truncated, digest, mismatch, missing, io."""
        results = ["missing"] * len(hashes)
        with self._lock:
            ns = self._namespaces.get(key)
            if ns is None:
                return results
            if ns.layout.digest != layout.digest:
                self._verify_failures["digest"] += len(hashes)
                return ["digest"] * len(hashes)
            locs = [ns.blocks.get(h) for h in hashes]
            runs = _runs(ns, hashes, locs)
            for dev, seq, _, _, _ in runs:
                self._reading[(dev, seq)] += 1
        t0 = time.perf_counter()
        futures = [
            self._reader.submit(self._read_run, ns, run, hashes, destinations, results, quarantine) for run in runs
        ]
        nbytes = sum(f.result() for f in futures)
        elapsed = time.perf_counter() - t0
        remove = []
        with self._lock:
            for dev, seq, _, _, _ in runs:
                self._reading[(dev, seq)] -= 1
                if not self._reading[(dev, seq)]:
                    del self._reading[(dev, seq)]
                    if (dev, seq) in self._doomed:
                        self._doomed.discard((dev, seq))
                        remove.append((dev, seq))
            self._reads += len(runs)
            self._read_bytes += nbytes
            self._read_seconds += elapsed
            ns.reads += results.count("")
        for dev, seq in remove:
            self._devices[dev].device.remove(seq)
        return results

    def _read_run(
        self,
        ns: _Namespace,
        run: tuple[int, int, int, int, list[int]],
        hashes: Sequence[bytes],
        destinations: Sequence[memoryview],
        results: list[str],
        quarantine: bool,
    ) -> int:
        dev, seq, start, end, positions = run
        try:
            data = self._devices[dev].device.read(seq, start, end - start)
        except OSError as e:
            log.error("ssd %s: read of segment %d failed: %s", self._devices[dev].device.name, seq, e)
            for i in positions:
                results[i] = "io"
            return 0
        with self._lock:
            locs = [ns.blocks.get(hashes[i]) for i in positions]
        for i, loc in zip(positions, locs, strict=True):
            if loc is None:
                continue  # reclaimed or purged meanwhile: a miss
            at = _unloc(loc)[2] - start
            try:
                payload = _verified_payload(ns, data[at:], hashes[i])
                copy_page(destinations[i], payload)
                results[i] = ""
            except fmt.FormatError as e:
                results[i] = e.reason
                if quarantine:
                    self._quarantine(ns, hashes[i], loc, e)
        return len(data)

    def _quarantine(self, ns: _Namespace, block_hash: bytes, loc: int, error: fmt.FormatError) -> None:
        dev, seq, offset = _unloc(loc)
        with self._lock:
            self._verify_failures[error.reason] += 1
            ns.read_failures += 1
            if ns.blocks.get(block_hash) == loc:
                del ns.blocks[block_hash]
                self._records -= 1
                self._bytes -= ns.page_bytes
            self._quarantined.add(loc)
        device = self._devices[dev].device
        log.warning("ssd %s: record at segment %d offset %d quarantined: %s", device.name, seq, offset, error)
        try:
            device.note(f"quarantine {seq} {offset} {error.reason}")
        except OSError as e:
            log.error(
                "ssd %s: could not note the quarantine (a restart will check the record again): %s", device.name, e
            )

    # ------------------------------------------------------------------ views

    def statistics(self) -> TierStatistics:
        with self._lock:
            return TierStatistics(
                records=self._records,
                bytes=self._bytes,
                segments=sum(len(d.sealed) + (d.active is not None) for d in self._devices),
                writes=self._writes,
                write_bytes=self._write_bytes,
                write_seconds=self._write_seconds,
                reads=self._reads,
                read_bytes=self._read_bytes,
                read_seconds=self._read_seconds,
                skipped=self._skipped,
                verify_failures=dict(self._verify_failures),
                failed_devices={d.device.name: d.failed for d in self._devices if d.failed},
                direct=all(d.device.direct for d in self._devices),
                devices=tuple(d.device.name for d in self._devices),
            )

    def inspect(self, verify: bool = False) -> tuple[RecoveryReport, dict[NamespaceKey, dict[str, int]]]:
        """What the devices hold, changing nothing (for a stopped engine's directory): the recovery report, and per
        namespace its records and, with `verify`, how many of them fail their checks when read in full."""
        report = _Recovery(self, "scan", readonly=True).run()
        out: dict[NamespaceKey, dict[str, int]] = {}
        for key, ns in self._namespaces.items():
            entry = {"records": len(ns.blocks), "page_bytes": ns.page_bytes}
            if verify:
                block_hashes = list(ns.blocks)
                for i in range(0, len(block_hashes), 256):
                    chunk = block_hashes[i : i + 256]
                    scratch = [memoryview(bytearray(ns.page_bytes)) for _ in chunk]
                    for reason in self.read(key, ns.layout, chunk, scratch, quarantine=False):
                        if reason:
                            entry[reason] = entry.get(reason, 0) + 1
            out[key] = entry
        return report, out

    def flush(self, timeout: float = 60.0) -> None:
        """Waits until every queued batch has been written or given up (for tests and orderly shutdowns)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if all(d.pending_bytes == 0 for d in self._devices):
                    return
            if time.monotonic() > deadline:
                raise TimeoutError("the SSD writers did not drain in time")
            time.sleep(0.001)


def _aligned(data: bytes) -> memoryview:
    """`data` in page-aligned memory, zero padded to ALIGN (O_DIRECT writes need both)."""
    buf = aligned_buffer(len(data))
    buf[: len(data)] = data
    return memoryview(buf)[: fmt.align(len(data), ALIGN)]


def _record_bytes(ns: _Namespace, block_hash: bytes, name_len: int | None = None) -> int:
    """A block record's bytes, its namespace named by ns.name (or a name of `name_len` bytes)."""
    hlen = fmt.header_len("x" * (len(ns.name) if name_len is None else name_len), block_hash)
    return fmt.align(hlen + ns.page_bytes, fmt.RECORD_ALIGN)


def _layout_bytes(ns: _Namespace) -> int:
    return fmt.align(fmt.header_len(ns.name, b"") + len(ns.descriptor), fmt.RECORD_ALIGN)


def _runs(
    ns: _Namespace, hashes: Sequence[bytes], locs: list[int | None]
) -> list[tuple[int, int, int, int, list[int]]]:
    """Groups the present blocks into device reads: (device, seq, start, end, positions) of adjacent records."""
    runs: list[tuple[int, int, int, int, list[int]]] = []
    for i, loc in enumerate(locs):
        if loc is None:
            continue
        dev, seq, offset = _unloc(loc)
        end = offset + _record_bytes(ns, hashes[i], ns.longest_name)  # records may carry an older, longer name
        if runs:
            rdev, rseq, rstart, rend, positions = runs[-1]
            if (rdev, rseq) == (dev, seq) and rend <= offset <= rend + _MAX_READ_GAP and end - rstart <= _MAX_READ_RUN:
                positions.append(i)
                runs[-1] = (rdev, rseq, rstart, end, positions)
                continue
        runs.append((dev, seq, offset, end, [i]))
    return runs


def _read_notes(device: Device) -> tuple[set[tuple[int, int]], dict[tuple[int, str], tuple[int, int]]]:
    """The device's quarantined records (seq, offset) and purge marks ((tenant, stored name) -> (seq, offset): the
    namespace's records before it are gone)."""
    quarantined: set[tuple[int, int]] = set()
    purged: dict[tuple[int, str], tuple[int, int]] = {}
    for line in device.notes():
        parts = line.split(" ")
        try:
            if parts[0] == "quarantine" and len(parts) == 4:
                quarantined.add((int(parts[1]), int(parts[2])))
            elif parts[0] == "purge" and len(parts) == 5:
                name = (int(parts[3]), parts[4])
                purged[name] = max(purged.get(name, (0, 0)), (int(parts[1]), int(parts[2])))
        except ValueError:
            log.warning("ssd %s: a note that does not parse is ignored: %r", device.name, line)
    return quarantined, purged


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


def _verified_payload(ns: _Namespace, data: memoryview, block_hash: bytes) -> memoryview:
    header = fmt.decode_record_header(data)
    if header.kind != fmt.BLOCK or header.block_hash != block_hash:
        raise fmt.FormatError("mismatch", "the record there is another block's")
    if header.tenant != ns.tenant or header.namespace_final not in ns.names:
        raise fmt.FormatError("mismatch", f"the record belongs to namespace {header.namespace_final!r}")
    if header.digest != ns.layout.digest:
        raise fmt.FormatError("digest", "the record's layout digest is not its namespace's")
    if header.payload_len != ns.page_bytes:
        raise fmt.FormatError("truncated", f"payload of {header.payload_len} bytes, pages hold {ns.page_bytes}")
    return fmt.verify_payload(header, data)


# ---------------------------------------------------------------------- recovery


class _Recovery:
    def __init__(self, tier: DiskTier, mode: str, readonly: bool = False) -> None:
        self.tier = tier
        self.mode = mode
        self.readonly = readonly  # inspect: change nothing on the devices
        self.bad: Counter[str] = Counter()
        self.records = self.segments = self.scanned = self.torn = 0
        self.rekeyed: dict[str, str] = {}
        self.dropped: set[str] = set()
        self.purged: dict[tuple[int, str], tuple[int, int]] = {}

    def run(self) -> RecoveryReport:
        t0 = time.perf_counter()
        for d in self.tier._devices:
            quarantined, purged = _read_notes(d.device)
            self.purged = purged
            segments = d.device.segments()
            untrusted: dict[int, str] = dict(getattr(d.device, "untrusted", {}))
            for seq, why in sorted(untrusted.items()):
                self._distrust(d.device, seq, why)
            # segment numbers only grow, past every segment a note names too: a note never applies to a newer one,
            # and past every name an untrusted file holds (never written through, nor its name reused)
            noted = [seq for seq, _ in quarantined] + [seq for seq, _ in purged.values()]
            d.next_seq = max([d.next_seq, *(seq + 1 for seq in segments + noted + list(untrusted))])
            for seq in segments:
                if self.mode == "none":
                    d.device.remove(seq)
                    continue
                self._segment(d, seq, {off for s, off in quarantined if s == seq})
        return RecoveryReport(
            segments=self.segments,
            records=self.records,
            seconds=time.perf_counter() - t0,
            scanned_segments=self.scanned,
            torn_cut=self.torn,
            bad=dict(self.bad),
            rekeyed=self.rekeyed,
            dropped_namespaces=sorted(self.dropped),
        )

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

    def _segment(self, d: _Device, seq: int, quarantined: set[int]) -> None:
        device = d.device
        try:
            header = fmt.decode_segment_header(device.read(seq, 0, fmt.SEGMENT_HEADER_BYTES))
        except fmt.FormatError as e:  # its records describe themselves: scan them, and seal it again
            self._fault(f"{device.name} segment {seq} header (scanning instead)", e)
            header = fmt.SegmentHeader(seq, 0.0, False)
        groups: list[_Group] | None = None
        if header.sealed:
            try:
                groups = self._summary(d, seq, header)
            except fmt.FormatError as e:
                self._fault(f"{device.name} segment {seq} summary (scanning instead)", e)
        end = 0
        if groups is None:
            groups, end = self._scan(d, seq)
            self.scanned += 1
        self.segments += 1
        members = d.members.setdefault(seq, [])
        tier = self.tier
        base = _loc(d.index, seq, 0)
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
            before = len(ns.blocks)
            ns.blocks.update(zip(block_hashes, [base + o for o in offsets], strict=True))
            added = len(ns.blocks) - before
            tier._records += added
            tier._bytes += added * ns.page_bytes
            members.append((ns, block_hashes))
            self.records += len(block_hashes)
        if (header.sealed and end == 0) or self.readonly:
            d.sealed.append(seq)
            return
        # a segment that was being written: seal what is valid, so it is never appended to or scanned again
        seg = _Segment(seq, used=fmt.align(end, ALIGN))
        for ref, (table_ns, offsets, block_hashes) in enumerate(groups):
            seg.table.append(table_ns)
            for o, h in zip(offsets, block_hashes, strict=True):
                seg.entries.append(fmt.SummaryEntry(fmt.BLOCK, ref, o, 0, 0, h))
        if seg.used + seg.summary_reserve() > device.segment_bytes:  # no room for a summary: scanned every start
            d.sealed.append(seq)
            return
        d.active = seg
        try:
            tier._seal(d)
        except OSError as e:
            log.error("ssd %s: could not seal recovered segment %d: %s", device.name, seq, e)
            d.active = None
            d.sealed.append(seq)

    def _summary(self, d: _Device, seq: int, header: fmt.SegmentHeader) -> list[_Group]:
        data = d.device.read(seq, header.summary_offset, header.summary_len)
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

    def _scan(self, d: _Device, seq: int) -> tuple[list[_Group], int]:
        """Every valid block record of an unsealed segment, up to its first bad one, read in large windows.
        Returns them by namespace, and where the valid records end."""
        device = d.device
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

    def _namespace(self, table_ns: fmt.Namespace) -> _Namespace | None:
        """The tier's namespace for a table entry, created on first sight (re-keyed or dropped as the descriptor
        says)."""
        tier = self.tier
        stored = (table_ns.tenant, table_ns.namespace_final)
        ns = tier._by_stored.get(stored)
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
        current = namespace_final(client, layout)
        if current != table_ns.namespace_final:
            self.rekeyed[table_ns.namespace_final] = current
        key = (table_ns.tenant, current)
        ns = tier._namespaces.get(key)
        if ns is None:
            ns = _Namespace(table_ns.tenant, current, table_ns.descriptor, layout, names={current})
            tier._namespaces[key] = ns
        ns.names.add(table_ns.namespace_final)
        ns.longest_name = max(len(n.encode()) for n in ns.names)
        tier._by_stored[stored] = ns
        return ns
