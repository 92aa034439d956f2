"""The SSD tier's read path: blocks from their records into the caller's pages, each one verified.

Theory of operation. A read looks its blocks up in the index, groups the present ones into runs of adjacent records
of one segment (gaps of padding between write batches included, up to a size), pins those segments so that a
reclaim cannot remove their files meanwhile (kvseal.ssd.index), and reads the runs from a pool of threads (queue
depth > 1: one device read per run).

Every record read is checked before its page may become visible: header and payload checksums, tenant, final
namespace (its current name or an older one it was re-keyed from), block hash, layout digest against its
namespace's descriptor, and payload length against the reader's page. A failure is counted by reason, the record
quarantined (dropped from the index, noted on the device so that a restart skips it too) and reported to the
caller, who serves the prefix before it. A block reclaimed or purged while its run was being read is a miss.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from kvseal.copy.kernel import copy_page
from kvseal.core.layout import Layout
from kvseal.ssd import format as fmt
from kvseal.ssd.device import Device
from kvseal.ssd.index import BlockIndex, NamespaceBlocks, NamespaceKey, SegmentId, unlocate

log = logging.getLogger("kvseal.ssd")

MAX_READ_RUN = 8 << 20  # one device read covers adjacent records up to this many bytes
MAX_READ_GAP = 64 << 10  # records this close are read together (the gap is padding between write batches)

Run = tuple[int, int, int, int, list[int]]  # (device, seq, start, end, positions in the read)


class BlockReader:
    """Reads for a tier over `devices` (numbered as locations number them), from `threads` threads."""

    def __init__(self, devices: Sequence[Device], *, lock: threading.Lock, index: BlockIndex, threads: int) -> None:
        self._devices = list(devices)
        self._lock = lock  # the tier's: guards the index and the counters
        self._index = index
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvseal-ssd-read")
        self.reads = self.read_bytes = 0  # device reads (runs) and their bytes
        self.read_seconds = 0.0
        self.verify_failures: Counter[str] = Counter()

    def close(self) -> None:
        """Waits for the reads in flight; no read may start afterwards."""
        self._pool.shutdown(wait=True)

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
        or the reason it was not: checksum, truncated, digest, mismatch, missing, io. `quarantine`: a record that
        fails its checks leaves the index and is noted on its device (False: only counted, as for an inspection)."""
        results = ["missing"] * len(hashes)
        with self._lock:
            ns = self._index.get(key)
            if ns is None:
                return results
            if ns.layout.digest != layout.digest:
                self.verify_failures["digest"] += len(hashes)
                return ["digest"] * len(hashes)
            runs = read_runs(ns, hashes, [ns.blocks.get(h) for h in hashes])
            segments: list[SegmentId] = [(dev, seq) for dev, seq, _, _, _ in runs]
            self._index.pin(segments)
        t0 = time.perf_counter()
        futures = [
            self._pool.submit(self._read_run, ns, run, hashes, destinations, results, quarantine) for run in runs
        ]
        nbytes = sum(f.result() for f in futures)
        elapsed = time.perf_counter() - t0
        with self._lock:
            remove = self._index.unpin(segments)
            self.reads += len(runs)
            self.read_bytes += nbytes
            self.read_seconds += elapsed
            ns.reads += results.count("")
        for dev, seq in remove:
            self._devices[dev].remove(seq)
        return results

    def _read_run(
        self,
        ns: NamespaceBlocks,
        run: Run,
        hashes: Sequence[bytes],
        destinations: Sequence[memoryview],
        results: list[str],
        quarantine: bool,
    ) -> int:
        dev, seq, start, end, positions = run
        device = self._devices[dev]
        try:
            data = device.read(seq, start, end - start)
        except OSError as e:
            log.error("ssd %s: read of segment %d failed: %s", device.name, seq, e)
            for i in positions:
                results[i] = "io"
            return 0
        with self._lock:
            locs = [ns.blocks.get(hashes[i]) for i in positions]
        for i, loc in zip(positions, locs, strict=True):
            if loc is None:
                continue  # reclaimed or purged meanwhile: a miss
            at = unlocate(loc)[2] - start
            try:
                payload = verified_payload(ns, data[at:], hashes[i])
                copy_page(destinations[i], payload)
                results[i] = ""
            except fmt.FormatError as e:
                results[i] = e.reason
                if quarantine:
                    self._quarantine(ns, hashes[i], loc, e)
        return len(data)

    def _quarantine(self, ns: NamespaceBlocks, block_hash: bytes, loc: int, error: fmt.FormatError) -> None:
        dev, seq, offset = unlocate(loc)
        with self._lock:
            self.verify_failures[error.reason] += 1
            ns.read_failures += 1
            self._index.discard(ns, block_hash, loc)
        device = self._devices[dev]
        log.warning("ssd %s: record at segment %d offset %d quarantined: %s", device.name, seq, offset, error)
        try:
            device.note(fmt.quarantine_note(seq, offset, error.reason))
        except OSError as e:
            log.error(
                "ssd %s: could not note the quarantine (a restart will check the record again): %s", device.name, e
            )


def read_runs(ns: NamespaceBlocks, hashes: Sequence[bytes], locs: list[int | None]) -> list[Run]:
    """Groups the present blocks (a location each) into device reads of adjacent records."""
    runs: list[Run] = []
    for i, loc in enumerate(locs):
        if loc is None:
            continue
        dev, seq, offset = unlocate(loc)
        end = offset + ns.record_bytes(len(hashes[i]), ns.longest_name)  # records may carry an older, longer name
        if runs:
            rdev, rseq, rstart, rend, positions = runs[-1]
            if (rdev, rseq) == (dev, seq) and rend <= offset <= rend + MAX_READ_GAP and end - rstart <= MAX_READ_RUN:
                positions.append(i)
                runs[-1] = (rdev, rseq, rstart, end, positions)
                continue
        runs.append((dev, seq, offset, end, [i]))
    return runs


def verified_payload(ns: NamespaceBlocks, data: memoryview, block_hash: bytes) -> memoryview:
    """The page of the block record at the start of `data`, once it proved to be `block_hash`'s of `ns`: raises
    FormatError (its reason is what is counted) otherwise."""
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
