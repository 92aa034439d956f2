"""The SSD tier's write path: how sealed blocks become records on a device, one SegmentWriter per device.

Theory of operation. The tier queues a batch of one namespace's blocks (a WriteJob) on a device's writer; its
thread takes the queued jobs up to `batch_bytes` together and appends their blocks to the device's active segment
as records built in place in a staging buffer (kvseal.ssd.format), so a batch costs one large aligned write. Up to
WRITE_DEPTH writes are in flight: the next chunk is built while the last one goes to the device.

    queue --> writer thread: build chunk k+1 in staging[(k+1) % WRITE_DEPTH] --> io pool: write chunk k
                                                                                      |
                          index.add(...) under the tier's lock, in write order  <-----+  (the write returned)

A block becomes visible in the index only once its write returned, so a read never finds a record that is not on
the device. Each job's `done(ok)` is called from the writer thread once its blocks are written (ok) or given up.

Segments. The active segment takes records until the next one and the summary it would need no longer fit; it is
then sealed (summary record, sync, header pointing at it, sync) and a new one is created. When the device holds
`max_segments - 1` sealed segments, the oldest is reclaimed whole: its blocks leave the index first (under the
lock), its file goes once no read uses it (kvseal.ssd.index: pins).

A write that fails (ENOSPC, EIO, EFBIG) takes the device out of the write rotation (`failed`, one logged error):
what is on it stays readable, and jobs queued behind it are given up (done(False), counted as skipped).

Threads: the writer thread and its io pool touch `active`, `sealed`, `next_seq` and `staging`; the tier's lock
guards the index, `pending_bytes` and the counters.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvseal.copy.kernel import copy_page
from kvseal.ssd import format as fmt
from kvseal.ssd.device import ALIGN, Device, aligned_buffer
from kvseal.ssd.index import BlockIndex, NamespaceBlocks, location

log = logging.getLogger("kvseal.ssd")

WRITE_DEPTH = 2  # device writes in flight per device: one being written while the next is built


@dataclass(frozen=True, slots=True)
class WriteItem:
    block_hash: bytes
    page: memoryview  # the page's bytes: the caller keeps them unchanged until the batch's `done` is called


@dataclass(slots=True)
class WriteJob:
    ns: NamespaceBlocks
    items: list[WriteItem]
    done: Callable[[bool], None]
    nbytes: int


@dataclass(slots=True)
class Segment:
    """A segment being written: where the next record goes, and what its summary will list."""

    seq: int
    used: int = fmt.SEGMENT_HEADER_BYTES
    table: list[fmt.Namespace] = field(default_factory=list)
    refs: dict[int, int] = field(default_factory=dict)  # id(NamespaceBlocks) -> its ref in the table
    entries: list[fmt.SummaryEntry] = field(default_factory=list)  # of the records written
    planned: int = 0  # records built for this segment, written or still in flight
    table_bytes: int = 0

    def summary_reserve(self, more_entries: int = 0, more_table: int = 0) -> int:
        """Bytes the summary record needs if `more_entries` records are added (4 KiB of slack for its header)."""
        entries = (max(len(self.entries), self.planned) + more_entries) * fmt._ENTRY.itemsize
        return fmt.align(4 + self.table_bytes + more_table + entries, ALIGN) + ALIGN


def seal_segment(device: Device, seg: Segment) -> None:
    """Writes the segment's summary record after its last record, then its header pointing at it (each synced):
    from then on a start reads the summary instead of scanning the records."""
    payload = fmt.encode_summary(seg.table, seg.entries)
    record = fmt.encode_record(fmt.SUMMARY, 0, "", bytes(32), b"", payload)
    at = seg.used
    device.write(seg.seq, at, aligned(record))
    device.sync(seg.seq)
    header = fmt.encode_segment_header(fmt.SegmentHeader(seg.seq, time.time(), True, at, len(record)))
    device.write(seg.seq, 0, aligned(header))
    device.sync(seg.seq)


def aligned(data: bytes) -> memoryview:
    """`data` in page-aligned memory, zero padded to ALIGN (O_DIRECT writes need both)."""
    buf = aligned_buffer(len(data))
    buf[: len(data)] = data
    return memoryview(buf)[: fmt.align(len(data), ALIGN)]


class SegmentWriter:
    """The writer of one device (its `number` in the tier, which locations carry). Made idle; `start` hands it
    what recovery found and starts its thread."""

    def __init__(
        self, number: int, device: Device, *, lock: threading.Lock, index: BlockIndex, batch_bytes: int
    ) -> None:
        self.number = number
        self.device = device
        self.batch_bytes = batch_bytes
        self._lock = lock  # the tier's: guards the index, pending_bytes and the counters
        self._index = index
        self.failed = ""  # why the device takes no more writes ('' while it does)
        self.pending_bytes = 0  # page bytes queued or being written
        self.active: Segment | None = None
        self.sealed: list[int] = []  # oldest first
        self.next_seq = 1
        self.writes = self.write_bytes = self.skipped = 0
        self.write_seconds = 0.0
        self._queue: queue.Queue[WriteJob | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._io = ThreadPoolExecutor(WRITE_DEPTH, "kvseal-ssd-io")
        self._staging: list[Any] = [None] * WRITE_DEPTH  # aligned staging buffers (mmap), grown on demand
        self._turn = 0

    # ------------------------------------------------------------------ life

    def start(self, sealed: list[int], next_seq: int) -> None:
        """Takes the device's sealed segments (oldest first) and the next free segment number, starts the thread."""
        self.sealed, self.next_seq = sealed, next_seq
        self._thread = threading.Thread(target=self._run, name=f"kvseal-ssd-write-{self.number}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Asks the thread to end once what is queued now is written."""
        self._queue.put(None)

    def join(self) -> None:
        """Waits for the thread (after `stop`) and the writes in flight."""
        if self._thread is not None:
            self._thread.join()
        self._io.shutdown(wait=True)

    def close(self) -> None:
        """Seals the active segment (so the next start reads summaries only) and closes the device. After `join`."""
        if self.active is not None and not self.failed:
            try:
                self._seal()
            except OSError as e:
                log.error("ssd %s: sealing segment %d at shutdown failed: %s", self.device.name, self.active.seq, e)
        self.device.close()

    # ------------------------------------------------------------------ the tier's side (under its lock)

    def offer(self, job: WriteJob, max_pending_bytes: int) -> bool:
        """Queues the job if the device takes writes and its queue stays within `max_pending_bytes`. The caller
        holds the tier's lock."""
        if self.failed or self.pending_bytes + job.nbytes > max_pending_bytes:
            return False
        self.pending_bytes += job.nbytes
        self._queue.put(job)
        return True

    def purge_mark(self) -> tuple[int, int]:
        """(seq, offset) where this device's next record goes: what a purge note marks. The caller holds the lock."""
        return (self.active.seq, self.active.used) if self.active else (self.next_seq, 0)

    @property
    def segments(self) -> int:
        return len(self.sealed) + (self.active is not None)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            jobs = [job]
            size = job.nbytes
            stop = False
            while size < self.batch_bytes:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                jobs.append(more)
                size += more.nbytes
            ok = False
            if not self.failed:
                try:
                    self._append(jobs)
                    ok = True
                except OSError as e:
                    self._fail(e)
            with self._lock:
                self.pending_bytes -= size
                if not ok:
                    self.skipped += sum(len(j.items) for j in jobs)
            for j in jobs:
                j.done(ok)
            if stop:
                return

    def _fail(self, e: OSError) -> None:
        self.failed = f"{e.strerror or e} (errno {e.errno})"
        log.error(
            "ssd %s: write failed: %s; this path takes no more writes (its blocks stay readable); the engine keeps "
            "serving from memory",
            self.device.name,
            self.failed,
        )

    def _append(self, jobs: list[WriteJob]) -> None:
        """Writes the jobs' blocks as records, in as few device writes as segments and the batch size allow, with
        up to WRITE_DEPTH writes in flight. A chunk becomes visible in the index when its write returned; the first
        failure is raised once all have ended."""
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
                seg = self.active
                ns, item = records[pos]
                need = ns.record_bytes(len(item.block_hash)) + ns.layout_record_bytes()
                if seg is None or seg.used + need + seg.summary_reserve(2, len(ns.descriptor) + 64) > (
                    self.device.segment_bytes
                ):
                    while inflight:
                        finish_oldest()
                    if error is not None:
                        break
                    seg = self._next_segment()
                if len(inflight) == WRITE_DEPTH:
                    finish_oldest()
                slot = self._turn % WRITE_DEPTH  # the buffer of the write WRITE_DEPTH writes ago, which has ended
                self._turn += 1
                pos, start, view, commit = self._build_chunk(seg, records, pos, slot)
                seg.used = start + len(view)  # reserved now: the next chunk goes after it
                inflight.append((self._io.submit(self._timed_write, seg.seq, start, view), commit))
        finally:
            while inflight:
                finish_oldest()
        if error is not None:
            raise error

    def _timed_write(self, seq: int, offset: int, view: memoryview) -> None:
        t0 = time.perf_counter()
        self.device.write(seq, offset, view)
        with self._lock:
            self.writes += 1
            self.write_bytes += len(view)
            self.write_seconds += time.perf_counter() - t0

    def _build_chunk(
        self, seg: Segment, records: list[tuple[NamespaceBlocks, WriteItem]], pos: int, slot: int
    ) -> tuple[int, int, memoryview, Callable[[], None]]:
        """Builds as many records as fit in the segment and the batch, from records[pos], in staging buffer `slot`.
        Returns the position after the last one, the segment offset and bytes to write, and what makes them
        visible once written."""
        limit = self.device.segment_bytes
        start = seg.used
        plan: list[tuple[int, NamespaceBlocks, int, bytes]] = []  # (offset, ns, kind, hash) in write order
        offset = start
        new_refs: dict[int, NamespaceBlocks] = {}
        end = pos
        while end < len(records):
            ns, item = records[end]
            extra = 0
            if id(ns) not in seg.refs and id(ns) not in new_refs:
                extra = ns.layout_record_bytes()
            rlen = ns.record_bytes(len(item.block_hash))
            more_table = sum(len(n.descriptor) + len(n.name) + 32 for n in new_refs.values())
            if extra:
                more_table += len(ns.descriptor) + len(ns.name) + 32
            if offset + rlen + extra + seg.summary_reserve(len(plan) + 2, more_table) > limit:
                break
            if plan and offset + rlen + extra - start > self.batch_bytes:
                break
            if extra:
                new_refs[id(ns)] = ns
                plan.append((offset, ns, fmt.LAYOUT, b""))
                offset += extra
            plan.append((offset, ns, fmt.BLOCK, item.block_hash))
            offset += rlen
            end += 1
        assert end > pos, "a segment that was just opened holds at least one record"
        for ns in new_refs.values():  # the table is the segment's from now on (only this thread uses it)
            seg.refs[id(ns)] = len(seg.table)
            seg.table.append(fmt.Namespace(ns.tenant, ns.name, ns.descriptor))
            seg.table_bytes += len(ns.descriptor) + len(ns.name) + 32
        seg.planned += len(plan)
        total = fmt.align(offset - start, ALIGN)
        if self._staging[slot] is None or len(self._staging[slot]) < total:
            self._staging[slot] = aligned_buffer(max(total, self.batch_bytes))
        view = memoryview(self._staging[slot])
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
            written: dict[int, tuple[NamespaceBlocks, list[bytes], list[int]]] = {}
            with self._lock:
                for (at, ns, kind, block_hash), e in zip(plan, entries, strict=True):
                    seg.entries.append(
                        fmt.SummaryEntry(e.kind, seg.refs[id(ns)], e.offset, e.record_len, e.payload_xxh, e.block_hash)
                    )
                    if kind == fmt.BLOCK:
                        group = written.setdefault(id(ns), (ns, [], []))
                        group[1].append(block_hash)
                        group[2].append(location(self.number, seg.seq, at))
                for ns, block_hashes, locations in written.values():
                    self._index.add((self.number, seg.seq), ns, block_hashes, locations)

        return end, start, view[:total], commit

    # ------------------------------------------------------------------ segments

    def _next_segment(self) -> Segment:
        """Seals the active segment, makes room (the oldest segment goes when the device is full), opens a new one."""
        if self.active is not None:
            self._seal()
        while len(self.sealed) >= self.device.max_segments - 1 and self.sealed:
            self._reclaim(self.sealed[0])
        seq = self.next_seq
        self.next_seq += 1
        self.device.create(seq)
        self.device.write(seq, 0, aligned(fmt.encode_segment_header(fmt.SegmentHeader(seq, time.time(), False))))
        self.active = Segment(seq)
        return self.active

    def _seal(self) -> None:
        assert self.active is not None
        seal_segment(self.device, self.active)
        self.sealed.append(self.active.seq)
        self.active = None

    def _reclaim(self, seq: int) -> None:
        """Drops a sealed segment: its blocks from the index now, its file once no read uses it."""
        with self._lock:
            self.sealed.remove(seq)
            removable = self._index.drop_segment((self.number, seq))
        if removable:
            self.device.remove(seq)
