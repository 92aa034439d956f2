"""The SSD tier's disk engine: which blocks are on which device, how they get there and back, and what survives.

Theory of operation. The engine hands over sealed blocks (write-through: the page stays pinned until written) in
batches per namespace; batches go to devices in turn, so several paths stripe. The roles, one module each:

    kvseal.ssd.device    seam 1: where a segment's bytes live (FileDevice; kvseal.testing.MemoryDevice)
    kvseal.ssd.writer    seam 2, writes: one thread per device appends batches as records, seals, reclaims
    kvseal.ssd.reader    seam 2, reads: runs of adjacent records from a pool of threads, every record verified
    kvseal.ssd.index     which blocks are held and where (namespaces, locations, segment membership)
    kvseal.ssd.recovery  the index rebuilt from the devices at open (or for an inspection)
    kvseal.ssd.format    the on-disk bytes: segments, records, summaries, notes
    kvseal.ssd.tier      this facade (DiskTier), and the Tier interface the engine uses
    kvseal.ssd.null      NullTier: the same interface, holding nothing (no SSD configured)

One lock (the tier's) guards the index and every counter; the writers and the reader take it for their short
bookkeeping and never across device I/O.

A write that fails (ENOSPC, EIO, EFBIG) takes its device out of the write rotation with one logged error: what
is already on it stays readable, and the engine keeps serving from memory. Nothing here blocks a Save: under a
burst, a batch that finds the queues full is written as far as one device's queue has room, its leading blocks
first (a prompt's head: every later hit needs it, so it is the most likely reused), and the rest is not written
(counted as skipped).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvseal.core.eviction import SSD_AGING_SHARE
from kvseal.core.layout import Layout
from kvseal.ssd import format as fmt
from kvseal.ssd.device import Device
from kvseal.ssd.index import BlockIndex, NamespaceKey, unlocate
from kvseal.ssd.reader import BlockReader
from kvseal.ssd.recovery import RECOVERY_MODES, RecoveryReport, recover
from kvseal.ssd.writer import WRITE_DEPTH, SegmentWriter, WriteItem, WriteJob

__all__ = [
    "RECOVERY_MODES",
    "WRITE_DEPTH",
    "DiskTier",
    "NamespaceKey",
    "RecoveryReport",
    "Tier",
    "TierStatistics",
    "WriteItem",
]

log = logging.getLogger("kvseal.ssd")


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
    reinserted: int  # blocks hit on SSD in the older part of the log, taken to be written again (Tier.aging)
    verify_failures: dict[str, int]
    failed_devices: dict[str, str]  # device name -> the error that took it out of the write rotation
    direct: bool
    devices: tuple[str, ...] = ()  # empty only for the no-op tier (kvseal.ssd.null)
    capacities: tuple[int, ...] = ()  # per device, the bytes its log may take (max_segments x segment_bytes)


class Tier(Protocol):
    """What the engine asks of its SSD tier. DiskTier is the real one, NullTier (kvseal.ssd.null) the one that holds
    nothing. Every method may be called from any thread; none waits for device I/O but `read`, `purge` (it notes the
    purge on each device) and `close`."""

    def prefix(self, key: NamespaceKey, hashes: Sequence[bytes]) -> int:
        """How many of the leading `hashes` the tier holds for the namespace (0 when it holds none of them)."""
        ...

    def holds(self, key: NamespaceKey, hashes: Sequence[bytes]) -> list[bool]:
        """Per hash, whether the tier holds it for the namespace (a hybrid query's presence)."""
        ...

    def absent(self, key: NamespaceKey, hashes: Sequence[bytes]) -> list[int]:
        """Positions of the `hashes` the tier would take if written: those it does not hold yet. The caller writes
        only these (the no-op tier takes none)."""
        ...

    def aging(self, key: NamespaceKey, hashes: Sequence[bytes]) -> list[int]:
        """Positions of the `hashes` the tier holds in the older part of their device's log (SSD_AGING_SHARE): the next
        reclaims drop them unless they are written again (a block read from SSD is: `write(..., reinsert=True)`)."""
        ...

    def write(
        self,
        key: NamespaceKey,
        layout: Layout,
        items: list[WriteItem],
        done: Callable[[bool], None],
        *,
        reinsert: bool = False,
    ) -> int:
        """Takes blocks of one namespace for writing: all of them, or under a burst the leading ones the queues
        have room for (items in prompt order), and answers how many. When that is more than 0, `done(ok)` is
        called exactly once, later, from another thread (never from within `write`, so the caller may hold a lock
        that `done` takes), once the taken ones are written (ok) or given up; the caller keeps their pages
        unchanged until then. The others were not taken (counted as skipped), and with none taken `done` is never
        called. `reinsert`: blocks the tier holds, written again (counted as reinserted); a block written again
        moves to its new record."""
        ...

    def read(
        self,
        key: NamespaceKey,
        layout: Layout,
        hashes: Sequence[bytes],
        destinations: Sequence[memoryview],
        *,
        quarantine: bool = True,
    ) -> list[str]:
        """Reads the blocks of `hashes` into `destinations` (one page each), verified. Per block "" (read) or why
        not: checksum, truncated, digest, mismatch, missing, io. Only the destinations of blocks read ("") are
        written."""
        ...

    def namespaces(self) -> dict[NamespaceKey, tuple[int, int, bytes]]:
        """Per namespace held: blocks, bytes and its layout descriptor."""
        ...

    def purge(self, key: NamespaceKey) -> int:
        """Drops a namespace's blocks, for good (a restart does not bring them back). Returns how many."""
        ...

    def statistics(self) -> TierStatistics:
        """A snapshot of the counters (all zero, no device, for the no-op tier)."""
        ...

    def close(self) -> None:
        """Writes what was taken, then stops (idempotent). No other method is called afterwards."""
        ...


class DiskTier:
    """The SSD tier over `devices` (at least one): `open` it, then use it (Tier), then `close` it. `inspect` instead
    of `open` reads a stopped engine's devices without changing them."""

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
        self._devices = list(devices)
        self.batch_bytes = batch_bytes
        self.max_pending_bytes = max_pending_bytes
        self._lock = threading.Lock()
        self._index = BlockIndex()
        self._writers = [
            SegmentWriter(i, d, lock=self._lock, index=self._index, batch_bytes=batch_bytes)
            for i, d in enumerate(self._devices)
        ]
        self._reader = BlockReader(self._devices, lock=self._lock, index=self._index, threads=read_threads)
        self._turn = 0
        self._skipped = 0  # blocks refused at once: no device could take them
        self._reinserted = 0  # blocks taken to be written again (`aging`)
        self._write_collisions = 0  # blocks refused: their layout collides with the namespace's on the devices
        self._closed = False

    # ------------------------------------------------------------------ life

    def open(self, recovery: str = "scan") -> RecoveryReport:
        """Rebuilds the index from the devices (kvseal.ssd.recovery, `recovery` its mode), then starts the writers.
        RuntimeError when strict recovery finds a fault; OSError when a device cannot be read."""
        recovered = recover(self._devices, recovery)
        self._index.adopt(recovered.index)
        for writer, found in zip(self._writers, recovered.devices, strict=True):
            writer.start(found.sealed, found.next_seq)
        return recovered.report

    def close(self) -> None:
        """Writes what is queued, seals the active segments (so the next start reads summaries only), stops."""
        if self._closed:
            return
        self._closed = True
        for w in self._writers:
            w.stop()
        for w in self._writers:
            w.join()
        self._reader.close()
        for w in self._writers:
            w.close()

    # ------------------------------------------------------------------ index

    def prefix(self, key: NamespaceKey, hashes: Sequence[bytes]) -> int:
        """How many of the leading `hashes` the tier holds for the namespace."""
        with self._lock:
            return self._index.prefix(key, hashes)

    def holds(self, key: NamespaceKey, hashes: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return self._index.holds(key, hashes)

    def absent(self, key: NamespaceKey, hashes: Sequence[bytes]) -> list[int]:
        """Positions of the hashes the tier does not hold for the namespace (queued ones are pinned in the pool,
        so they cannot be sealed again before their write lands)."""
        with self._lock:
            return self._index.absent(key, hashes)

    def namespaces(self) -> dict[NamespaceKey, tuple[int, int, bytes]]:
        """Per namespace: blocks, bytes and its descriptor."""
        with self._lock:
            return self._index.summary()

    def purge(self, key: NamespaceKey) -> int:
        """Drops a namespace's blocks: from the index now, and from every later start (a note on each device marks
        where its records end); the records go with their segments. Returns the blocks dropped."""
        with self._lock:
            ns = self._index.get(key)
            if ns is None:
                return 0
            n = self._index.clear(ns)
            marks = [(w.device, w.purge_mark()) for w in self._writers]
            names = sorted(ns.names)
        for device, (seq, offset) in marks:
            for name in names:
                try:
                    device.note(fmt.purge_note(seq, offset, ns.tenant, name))
                except OSError as e:
                    log.error("ssd %s: purge of %s not noted (a restart brings it back): %s", device.name, name, e)
        return n

    def aging(self, key: NamespaceKey, hashes: Sequence[bytes]) -> list[int]:
        """Positions of the held `hashes` whose record is in the oldest SSD_AGING_SHARE of its device's segments (by
        sequence number: at least a quarter of the device's segments, and one, were started after it): second chance for
        blocks hit on SSD, which the engine writes again instead of letting the log's FIFO reclaim drop them."""
        with self._lock:
            ns = self._index.get(key)
            if ns is None:
                return []
            # at least the newest segment is young: in a log of a few segments a block written again would otherwise
            # reclaim the segment that holds everything else
            young = {w.number: math.ceil(w.device.max_segments * (1 - SSD_AGING_SHARE)) for w in self._writers}
            newest = {w.number: w.next_seq - 1 - young[w.number] for w in self._writers}
            out = []
            for i, block_hash in enumerate(hashes):
                loc = ns.blocks.get(block_hash)
                if loc is not None:
                    device, seq, _ = unlocate(loc)
                    if seq <= newest[device]:
                        out.append(i)
            return out

    # ------------------------------------------------------------------ write and read

    def write(
        self,
        key: NamespaceKey,
        layout: Layout,
        items: list[WriteItem],
        done: Callable[[bool], None],
        *,
        reinsert: bool = False,
    ) -> int:
        """Queues blocks of one namespace for a device, whole on the next device with room, or else their leading
        part on the device with the most room; `done(ok)` is called from a writer thread once the taken ones are
        written (ok) or given up. Answers how many (0: no call of `done`). `reinsert`: Tier's."""
        size = layout.page_bytes
        with self._lock:
            ns = self._index.namespace_for(key, layout)
            if ns.layout.digest != layout.digest:  # a fingerprint collision: never write one layout under another
                self._write_collisions += len(items)
                return 0
            share = self.max_pending_bytes // len(self._writers)
            taken = 0
            for _ in range(len(self._writers)):
                writer = self._writers[self._turn % len(self._writers)]
                self._turn += 1
                if writer.offer(WriteJob(ns, items, done, len(items) * size), share):
                    taken = len(items)
                    break
            else:  # a burst: the head of the batch where it fits
                writing = [w for w in self._writers if not w.failed]
                if writing:
                    roomiest = min(writing, key=lambda w: w.pending_bytes)
                    room = min((share - roomiest.pending_bytes) // size, len(items))
                    if room > 0 and roomiest.offer(WriteJob(ns, items[:room], done, room * size), share):
                        taken = room
            if reinsert:
                self._reinserted += taken
            self._skipped += len(items) - taken
            return taken

    def read(
        self,
        key: NamespaceKey,
        layout: Layout,
        hashes: Sequence[bytes],
        destinations: Sequence[memoryview],
        *,
        quarantine: bool = True,
    ) -> list[str]:
        """Reads the blocks of `hashes` into `destinations` (one page each), verified (kvseal.ssd.reader). Returns
        per block "" (read) or the reason it was not: checksum, truncated, digest, mismatch, missing, io."""
        return self._reader.read(key, layout, hashes, destinations, quarantine=quarantine)

    def flush(self, timeout: float = 60.0) -> None:
        """Waits until every queued batch has been written or given up (for tests and orderly shutdowns)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if all(w.pending_bytes == 0 for w in self._writers):
                    return
            if time.monotonic() > deadline:
                raise TimeoutError("the SSD writers did not drain in time")
            time.sleep(0.001)

    # ------------------------------------------------------------------ views

    def statistics(self) -> TierStatistics:
        with self._lock:
            failures = Counter(self._reader.verify_failures)
            if self._write_collisions:
                failures["digest"] += self._write_collisions
            return TierStatistics(
                records=self._index.records,
                bytes=self._index.bytes,
                segments=sum(w.segments for w in self._writers),
                writes=sum(w.writes for w in self._writers),
                write_bytes=sum(w.write_bytes for w in self._writers),
                write_seconds=sum(w.write_seconds for w in self._writers),
                reads=self._reader.reads,
                read_bytes=self._reader.read_bytes,
                read_seconds=self._reader.read_seconds,
                skipped=self._skipped + sum(w.skipped for w in self._writers),
                reinserted=self._reinserted,
                verify_failures=dict(failures),
                failed_devices={w.device.name: w.failed for w in self._writers if w.failed},
                direct=all(d.direct for d in self._devices),
                devices=tuple(d.name for d in self._devices),
                capacities=tuple(d.max_segments * d.segment_bytes for d in self._devices),
            )

    def inspect(self, verify: bool = False) -> tuple[RecoveryReport, dict[NamespaceKey, dict[str, int]]]:
        """What the devices hold, changing nothing (for a stopped engine's directory; instead of `open`): the
        recovery report, and per namespace its records and, with `verify`, how many of them fail their checks
        when read in full."""
        recovered = recover(self._devices, "scan", readonly=True)
        self._index.adopt(recovered.index)
        with self._lock:
            namespaces = list(self._index.namespaces.items())
        out: dict[NamespaceKey, dict[str, int]] = {}
        for key, ns in namespaces:
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
        return recovered.report, out
