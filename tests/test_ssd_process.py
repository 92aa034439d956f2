"""The SSD tier in a real `kvseal serve`: what a restart, a crash, a torn or corrupted directory, a full disk, two
disks and bad flags do to the blocks it serves.

Workers are in-process `SsdWorker`s: the KV of one instance (one or more layers of sealed memfd memory,
kvseal.memfd.SharedArray) registered over its own lane connection. Every block's bytes follow from (layout, hash)
(`block_bytes`), so a block served from the wrong namespace, layout, record or offset never compares equal.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import REPO, EngineProcess, free_port, serve_command, wait_until

from kvseal.client import EngineClient
from kvseal.errors import KvsealError
from kvseal.memfd import SharedArray
from kvseal.proto import kvseal_pb2 as pb
from kvseal.ssd import format as fmt
from kvseal.testing import register_one_rank
from kvseal.units import format_size

pytestmark = pytest.mark.process

NAMESPACE = "ssd-proc"
LAYER0, LAYER1 = "model.layers.0.attn", "model.layers.1.attn"
TAG = "cpu-test"
SLOT = 4096  # bytes of one block in one layer
CHUNK = 256  # blocks of a worker's memory: what one save or one load moves at most
WAIT_S = 30.0
LOADED = pb.LoadResponse.LOADED
RECOVERY_LINE = re.compile(
    r"ssd: (\d+) records in (\d+) segments recovered in [\d.]+ s \((\d+) scanned, torn tails cut (\d+), bad (.*?), "
    r"re-keyed"
)
SEGMENT_FILE = re.compile(r"^seg-\d{8}\.kvs$")

EngineFactory = Callable[..., EngineProcess]


def block_hashes(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


def block_bytes(label: str, layer: int, block_hash: bytes, n: int = SLOT) -> bytes:
    """The bytes a block of `block_hash` holds in layer `layer` of a layout named `label`."""
    return hashlib.shake_256(f"{label}|{layer}|".encode() + block_hash).digest(n)


def layout_label(namespace: str, dtype: str, layers: Sequence[str]) -> str:
    return f"{namespace}|{dtype}|{','.join(layers)}"


def ssd_args(
    *paths: Path,
    capacity: str = "64MiB",
    segment: str = "4MiB",
    recovery: str = "scan",
    pool: str = "32MiB",
    slab: str = "1MiB",
) -> list[str]:
    args: list[str] = []
    for p in paths:
        args += ["--ssd-path", str(p)]
    return [
        *args,
        "--ssd-capacity",
        capacity,
        "--ssd-segment-size",
        segment,
        "--ssd-recovery",
        recovery,
        "--slab-size",
        slab,
        "--pool-size",
        pool,
    ]


class SsdWorker:
    """One worker of instance `instance_id`: `layers` layers of CHUNK blocks of SLOT bytes in a sealed memfd,
    registered through its own client (whose lane connection is its session)."""

    def __init__(
        self,
        engine: EngineProcess,
        instance_id: str,
        *,
        layers: Sequence[str] = (LAYER0,),
        dtype: str = "bfloat16",
        namespace: str = NAMESPACE,
    ) -> None:
        self.client: EngineClient = engine.client(timeout=WAIT_S)
        self.instance_id = instance_id
        self.key = (instance_id, 0, 0)
        self.layers = list(layers)
        self.label = layout_label(namespace, dtype, self.layers)
        self.shared = SharedArray((len(self.layers), CHUNK, SLOT))
        self.kv = self.shared.array
        self.closed = False
        layers_kv = {name: self.kv[i] for i, name in enumerate(self.layers)}
        register_one_rank(
            self.client, instance_id, self.shared, layers_kv, namespace=namespace, layout_tag=TAG, dtype=dtype
        )

    def expected(self, block_hash: bytes) -> list[bytes]:
        return [block_bytes(self.label, i, block_hash) for i in range(len(self.layers))]

    def save(self, hashes: Sequence[bytes]) -> str:
        """Saves the blocks (their bytes from `expected`), CHUNK at a time; every one must be stored. Returns the
        final namespace."""
        final = ""
        for start in range(0, len(hashes), CHUNK):
            r = self.save_chunk(hashes[start : start + CHUNK])
            assert (r.written, r.not_stored) == (len(hashes[start : start + CHUNK]), 0), r
            final = r.namespace_final
        return final

    def save_chunk(self, chunk: Sequence[bytes]) -> pb.SaveResponse:
        assert len(chunk) <= CHUNK
        for b, h in enumerate(chunk):
            for i, data in enumerate(self.expected(h)):
                self.kv[i, b] = np.frombuffer(data, np.uint8)
        return self.client.save(self.key, chunk, list(range(len(chunk))))

    def load_checked(self, chunk: Sequence[bytes], q: pb.QueryResponse) -> list[bytes]:
        """Loads the query's hits into fresh (zeroed) memory; returns the hashes of those whose bytes are not the
        expected ones."""
        hits = q.hits
        if hits == 0:
            return []
        self.kv[:] = 0
        r = self.client.load(self.key, chunk[:hits], list(range(hits)), lease_id=q.lease_id)
        assert (r.outcome, r.loaded) == (LOADED, hits), r
        wrong = []
        for b, h in enumerate(chunk[:hits]):
            if any(self.kv[i, b].tobytes() != data for i, data in enumerate(self.expected(h))):
                wrong.append(h)
        return wrong

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.client.close()
            self.shared.close()


def query_until_done(
    client: EngineClient, instance: str, hashes: Sequence[bytes], timeout: float = WAIT_S
) -> tuple[pb.QueryResponse, int]:
    """Asks until the answer is not `loading` (the engine finished reading SSD records into the pool); returns the
    answer and how many answers were `loading` before it."""
    deadline = time.monotonic() + timeout
    loading = 0
    while True:
        q = client.query(instance, hashes)
        if not q.loading:
            return q, loading
        assert (q.hits, q.lease_id) == (0, 0), q
        loading += 1
        assert time.monotonic() < deadline, f"still loading after {timeout}s ({loading} answers)"
        time.sleep(0.002)  # poll interval of a bounded wait on a real condition (the engine's refill)


def load_all(worker: SsdWorker, hashes: Sequence[bytes], *, first_loading: bool = False) -> int:
    """Queries and loads every block, CHUNK at a time; each must hit in full and byte-exact. With `first_loading`,
    the first answer for each chunk must be `loading` (nothing of it is in memory yet). Returns the loads."""
    for start in range(0, len(hashes), CHUNK):
        chunk = hashes[start : start + CHUNK]
        q, loading = query_until_done(worker.client, worker.instance_id, chunk)
        assert q.hits == len(chunk), (start, q)
        if first_loading:
            assert loading >= 1, f"chunk at {start} hit without loading: it was in memory"
        assert worker.load_checked(chunk, q) == [], f"wrong bytes served in the chunk at {start}"
    return len(hashes)


def stop(engine: EngineProcess) -> None:
    """SIGTERM: the engine drains its SSD writers, seals its segments and exits 0."""
    problems = engine.stop()
    engine.expect_exit = True
    assert not problems, "\n".join(problems)


def recovery(engine: EngineProcess) -> dict[str, Any]:
    """The numbers of the engine's recovery log line."""
    lines = [m for m in RECOVERY_LINE.finditer(engine.stderr())]
    assert len(lines) == 1, engine.stderr()
    m = lines[0]
    return {
        "records": int(m.group(1)),
        "segments": int(m.group(2)),
        "scanned": int(m.group(3)),
        "torn": int(m.group(4)),
        "bad": m.group(5),
    }


def metric(engine: EngineProcess, name: str, **labels: str) -> float:
    value = engine.metric(name, **labels)
    assert value is not None, (name, labels)
    return value


def verify_failures(engine: EngineProcess) -> int:
    return int(
        sum(
            metric(engine, "kvseal_ssd_verify_failures_total", reason=r)
            for r in ("checksum", "digest", "truncated", "mismatch")
        )
    )


def segment_files(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if SEGMENT_FILE.match(p.name))


def sealed_layout(path: Path) -> tuple[fmt.SegmentHeader, list[tuple[int, bytes]]]:
    """A sealed segment file's header and its block records (offset, hash), in offset order."""
    data = path.read_bytes()
    header = fmt.decode_segment_header(data[: fmt.SEGMENT_HEADER_BYTES])
    assert header.sealed, path
    summary = data[header.summary_offset : header.summary_offset + header.summary_len]
    record = fmt.decode_record_header(summary)
    assert record.kind == fmt.SUMMARY
    _, rows = fmt.decode_summary(fmt.verify_payload(record, summary))
    rows = rows[rows["kind"] == fmt.BLOCK]
    entries = sorted(zip(rows["offset"].tolist(), fmt.entry_hashes(rows), strict=True))
    return header, entries


def scan_blocks(path: Path) -> list[tuple[int, bytes]]:
    """The block records (offset, hash) of a segment file, read record by record from its first one (what a
    segment's writer appended: records at 64-byte boundaries, zero padding to the next 4 KiB between writes)."""
    data = path.read_bytes()
    out = []
    at = fmt.SEGMENT_HEADER_BYTES
    while at + 4 <= len(data):
        if data[at : at + 4] != fmt.RECORD_MAGIC:
            nxt = fmt.align(at + 1, 4096)
            if any(data[at:nxt]) or data[nxt : nxt + 4] != fmt.RECORD_MAGIC:
                break
            at = nxt
            continue
        header = fmt.decode_record_header(data[at:])
        fmt.verify_payload(header, data[at : at + header.record_len])
        if header.kind == fmt.BLOCK:
            out.append((at, header.block_hash))
        at += header.record_len
    return out


def serve_fails(*extra: str) -> subprocess.CompletedProcess[str]:
    """A `kvseal serve` expected to refuse to start."""
    cmd = serve_command(f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}", extra)
    env = {k: v for k, v in os.environ.items() if k != "KVSEAL_TOKEN"}
    return subprocess.run(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)


def one_error_line(r: subprocess.CompletedProcess[str]) -> str:
    assert r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("kvseal serve: error: "), r.stderr
    return r.stderr.strip()


@pytest.fixture
def workers() -> Any:
    """make(engine, instance_id, **kwargs) -> an SsdWorker, closed at teardown (before its engine stops)."""
    made: list[SsdWorker] = []

    def make(engine: EngineProcess, instance_id: str, **kwargs: Any) -> SsdWorker:
        w = SsdWorker(engine, instance_id, **kwargs)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


# -------------------------------------------------------------------- 1. restart


def test_blocks_survive_a_restart_byte_exact(tmp_path: Path, engine_factory: EngineFactory, workers: Any) -> None:
    d = tmp_path / "ssd"
    n = 1200
    hashes = block_hashes("restart", n)
    e1 = engine_factory(*ssd_args(d))
    w1 = workers(e1, "i1")
    final = w1.save(hashes)
    wait_until(lambda: e1.metric("kvseal_ssd_records") == n, WAIT_S, "every block written through")
    w1.close()
    stop(e1)

    e2 = engine_factory(*ssd_args(d))
    rec = recovery(e2)
    assert (rec["records"], rec["scanned"], rec["torn"], rec["bad"]) == (n, 0, 0, "none"), rec  # SIGTERM sealed all
    assert metric(e2, "kvseal_ssd_records") == n
    [entry] = [ns for ns in e2.get_json("/v1/namespaces") if ns["namespace"] == final]
    assert (entry["resident_blocks"], entry["ssd_blocks"], entry["ssd_bytes"]) == (0, n, n * SLOT), entry
    w2 = workers(e2, "i1")
    load_all(w2, hashes, first_loading=True)
    q, _ = query_until_done(w2.client, "i1", hashes[:CHUNK])
    assert q.namespace_final == final
    assert verify_failures(e2) == 0


# -------------------------------------------------------------------- 2. layouts stay apart


def test_layouts_of_one_namespace_stay_apart_across_a_restart(
    tmp_path: Path, engine_factory: EngineFactory, workers: Any
) -> None:
    """One client namespace, three layouts (MTP off / on: one extra layer; float16 vs bfloat16 of equal bytes), the
    same hashes with different bytes in each: after a restart each instance loads exactly its own bytes."""
    d = tmp_path / "ssd"
    n = 300
    hashes = block_hashes("layouts", n)
    kinds: dict[str, dict[str, Any]] = {
        "mtp-off": {"layers": (LAYER0,), "dtype": "bfloat16"},
        "mtp-on": {"layers": (LAYER0, LAYER1), "dtype": "bfloat16"},
        "fp16": {"layers": (LAYER0,), "dtype": "float16"},
    }
    e1 = engine_factory(*ssd_args(d))
    finals = {}
    for instance, kwargs in kinds.items():
        w = workers(e1, instance, **kwargs)
        finals[instance] = w.save(hashes)
        w.close()
    assert len(set(finals.values())) == 3, finals
    assert all(f.startswith(f"{NAMESPACE}.") for f in finals.values()), finals
    a, c = (
        block_bytes(layout_label(NAMESPACE, kinds[k]["dtype"], kinds[k]["layers"]), 0, hashes[0])
        for k in ("mtp-off", "fp16")
    )
    assert a != c  # equal page bytes, different contents
    wait_until(lambda: e1.metric("kvseal_ssd_records") == 3 * n, WAIT_S, "every block of every layout written")
    stop(e1)

    e2 = engine_factory(*ssd_args(d))
    assert recovery(e2)["records"] == 3 * n
    on_ssd = {ns["namespace"]: ns for ns in e2.get_json("/v1/namespaces")}
    for instance, kwargs in kinds.items():
        entry = on_ssd[finals[instance]]
        page = SLOT * len(kwargs["layers"])
        assert (entry["ssd_blocks"], entry["ssd_bytes"], entry["page_bytes"]) == (n, n * page, page), entry
        assert entry["num_layers"] == len(kwargs["layers"])
    for instance, kwargs in kinds.items():  # registered one after the other: no layout's blocks are in memory
        w = workers(e2, instance, **kwargs)
        load_all(w, hashes, first_loading=True)
        q, _ = query_until_done(w.client, instance, hashes[:1])
        assert q.namespace_final == finals[instance]
    assert verify_failures(e2) == 0


# -------------------------------------------------------------------- 3. crash and torn tails


def test_sigkill_while_writing_recovers_and_serves_only_exact_blocks(
    tmp_path: Path, engine_factory: EngineFactory, workers: Any
) -> None:
    """SIGKILL while the save loop runs and the tier writes: the next start scans the segment that was being
    written, keeps at least every record whose write had returned, and serves each recovered block byte-exact. The
    segment is larger than everything saved, so exactly one (unsealed) segment exists when the engine dies."""
    d = tmp_path / "ssd"
    # 9600 blocks of 4 KiB: 41 MiB of records at most, under one segment; the pool holds them all and its quarter
    # (what queued writes may pin) too, so no Save evicts or finds the write queues full
    args = ssd_args(d, capacity="128MiB", segment="48MiB", pool="256MiB")
    batch, batches = 64, 150
    e1 = engine_factory(*args)
    w1 = workers(e1, "crash")
    attempted: list[list[bytes]] = []
    problems: list[str] = []
    done = threading.Event()

    def save_loop() -> None:
        try:
            for k in range(batches):
                chunk = block_hashes(f"crash-{k}", batch)
                attempted.append(chunk)
                r = w1.save_chunk(chunk)
                if (r.written, r.not_stored) != (batch, 0):
                    problems.append(f"batch {k}: {r}")
        except (KvsealError, OSError):
            pass  # the engine was killed under this save
        finally:
            done.set()

    saver = threading.Thread(target=save_loop, name="save-loop", daemon=True)
    saver.start()
    wait_until(lambda: (e1.metric("kvseal_ssd_writes_total") or 0) > 0, WAIT_S, "the first SSD write")
    written = metric(e1, "kvseal_ssd_records")  # these records' writes returned: they are in the file
    still_saving = not done.is_set()
    e1.kill()
    saver.join(WAIT_S)
    assert not saver.is_alive() and not problems, problems
    assert still_saving, "the save loop ended before the kill: make it longer"
    assert len(attempted) < batches, "the save loop ended before the kill"
    w1.close()
    [seg] = segment_files(d)
    assert not fmt.decode_segment_header(seg.read_bytes()[: fmt.SEGMENT_HEADER_BYTES]).sealed

    e2 = engine_factory(*args)
    rec = recovery(e2)
    assert (rec["segments"], rec["scanned"]) == (1, 1), rec
    assert rec["records"] >= written > 0, (rec, written)
    assert metric(e2, "kvseal_ssd_records") == rec["records"]
    w2 = workers(e2, "crash")
    hits = []
    for chunk in attempted:
        q, _ = query_until_done(w2.client, "crash", chunk)
        assert w2.load_checked(chunk, q) == []
        hits.append(q.hits)
    # one writer appends records in save order: what survives is a prefix of the saves
    assert sum(hits) == rec["records"], hits
    full = sum(1 for h in hits if h == batch)
    assert hits == [batch] * full + hits[full : full + 1] + [0] * (len(hits) - full - 1), hits
    assert verify_failures(e2) == 0


@pytest.mark.parametrize("damage", ["truncated", "zeroed"])
def test_a_segment_cut_in_the_middle_of_a_record_is_cut_there(
    tmp_path: Path, engine_factory: EngineFactory, workers: Any, damage: str
) -> None:
    """The last segment of a stopped engine's directory, damaged in the middle of a record: `truncated` (stopped by
    SIGTERM, the file cut to an unaligned size: its summary and everything after the cut gone) or `zeroed` (killed
    once every write had returned, so the segment is unsealed; 100 bytes of one record's payload zeroed, the records
    after it intact). Recovery scans it and cuts it at that record (`torn tails cut 1`): the blocks before the cut
    load byte-exact, and none from the cut on is served."""
    d = tmp_path / "ssd"
    n = 1500  # two segments of 4 MiB
    hashes = block_hashes("torn", n)
    e1 = engine_factory(*ssd_args(d))
    w1 = workers(e1, "torn")
    w1.save(hashes)
    wait_until(lambda: e1.metric("kvseal_ssd_records") == n, WAIT_S, "every block written through")
    w1.close()
    if damage == "truncated":
        stop(e1)
    else:
        e1.kill()
    segments = segment_files(d)
    assert len(segments) == 2, segments
    last = segments[-1]
    entries = scan_blocks(last)
    if damage == "truncated":
        assert sealed_layout(last)[1] == entries  # the summary lists what is there
    k = len(entries) // 2
    at = entries[k][0] + fmt.header_len(f"{NAMESPACE}.x", b"") + 1001  # inside the payload, not aligned
    assert entries[k][0] < at < entries[k + 1][0] - 100
    if damage == "truncated":
        os.truncate(last, at)
    else:
        with open(last, "r+b") as f:
            f.seek(at)
            f.write(bytes(100))
    dropped = {h for _, h in entries[k:]}
    kept = [h for h in hashes if h not in dropped]
    assert len(kept) == n - len(entries) + k

    e2 = engine_factory(*ssd_args(d))
    assert "torn tails cut 1," in e2.stderr(), e2.stderr()
    rec = recovery(e2)
    assert (rec["torn"], rec["scanned"], rec["records"]) == (1, 1, len(kept)), rec
    assert metric(e2, "kvseal_ssd_records") == len(kept)
    w2 = workers(e2, "torn")
    load_all(w2, kept, first_loading=True)
    for h in sorted(dropped):
        q, loading = query_until_done(w2.client, "torn", [h])
        assert (q.hits, loading) == (0, 0), q
    assert verify_failures(e2) == 0


# -------------------------------------------------------------------- 4. corruption


def corrupt(d: Path, seed: int, count: int) -> dict[str, int]:
    """`count` seeded corruptions of the written part of a stopped engine's (sealed) segment files: byte flips
    and zeroed ranges of 1..64 bytes. The segments take turns: the first's header is hit, the second's summary,
    the third keeps both (so its records are found bad only when read), and so on; most corruptions land anywhere
    in the records. Returns where they went."""
    rng = random.Random(seed)
    files = segment_files(d)
    layouts = {p: sealed_layout(p)[0] for p in files}
    where = {"header": 0, "summary": 0, "records": 0}
    targets: list[tuple[Path, str]] = []
    for i, p in enumerate(files):
        if i % 3 == 0:
            targets += [(p, "header")] * 2
        elif i % 3 == 1:
            targets += [(p, "summary")] * 2
    targets += [(rng.choice(files), "records") for _ in range(count - len(targets))]
    data = {p: bytearray(p.read_bytes()) for p in files}
    for p, part in targets:
        h = layouts[p]
        if part == "header":
            lo, hi = 0, 56  # the checked bytes and their checksum
        elif part == "summary":
            lo, hi = h.summary_offset, h.summary_offset + h.summary_len
        else:
            lo, hi = fmt.SEGMENT_HEADER_BYTES, h.summary_offset
        at = rng.randrange(lo, hi)
        if rng.random() < 0.5:
            data[p][at] ^= rng.randrange(1, 256)
        else:
            end = min(hi, at + rng.randrange(1, 65))
            data[p][at:end] = bytes(end - at)
        where[part] += 1
    for p, b in data.items():
        p.write_bytes(bytes(b))
    assert sum(where.values()) == count
    return where


def serve_everything(worker: SsdWorker, hashes: Sequence[bytes]) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """Queries and loads every block, skipping each one the engine does not serve. Returns the hashes served
    byte-exact, those served with wrong bytes, and those not served."""
    served: list[bytes] = []
    wrong: list[bytes] = []
    missing: list[bytes] = []
    pending = list(hashes)
    while pending:
        chunk = pending[:CHUNK]
        q, _ = query_until_done(worker.client, worker.instance_id, chunk)
        bad = worker.load_checked(chunk, q)
        wrong += bad
        served += [h for h in chunk[: q.hits] if h not in bad]
        if q.hits < len(chunk):
            missing.append(chunk[q.hits])
            pending = pending[q.hits + 1 :]
        else:
            pending = pending[q.hits :]
    return served, wrong, missing


def test_corrupted_segments_serve_no_wrong_byte_and_quarantine_what_failed(
    tmp_path: Path, engine_factory: EngineFactory, workers: Any
) -> None:
    """1000 seeded corruptions (headers, summaries, records) of a stopped engine's directory. `strict` refuses to
    start on it; `scan` serves no wrong byte, and every block it held but did not serve failed a read check (counted
    in kvseal_ssd_verify_failures_total) and is quarantined: missing on a second query, and never read again after
    another restart. `none` then starts empty."""
    d = tmp_path / "ssd"
    n = 1200  # 5 segments of 1152 KiB
    hashes = block_hashes("corrupt", n)
    small = {"segment": "1152KiB", "slab": "64KiB"}
    args = ssd_args(d, **small)
    e1 = engine_factory(*args)
    w1 = workers(e1, "bad")
    w1.save(hashes)
    wait_until(lambda: e1.metric("kvseal_ssd_records") == n, WAIT_S, "every block written through")
    w1.close()
    stop(e1)
    assert len(segment_files(d)) >= 4
    where = corrupt(d, seed=1234, count=1000)
    assert min(where.values()) > 0, where

    r = serve_fails(*ssd_args(d, **small, recovery="strict"))
    assert r.returncode == 1, r.stderr
    assert "strict" in one_error_line(r)

    e2 = engine_factory(*args)
    rec = recovery(e2)
    held = int(metric(e2, "kvseal_ssd_records"))
    assert held == rec["records"] and rec["scanned"] >= 2, rec
    w2 = workers(e2, "bad")
    served, wrong, missing = serve_everything(w2, hashes)
    assert wrong == [], f"{len(wrong)} blocks served with wrong bytes"
    failed = verify_failures(e2)
    assert 0 < failed and 0 < len(served) and held < n, (failed, len(served), held)  # both kinds of loss happened
    assert len(served) + failed == held  # every block recovery kept is served, or failed a read check
    assert len(served) + len(missing) == n
    assert metric(e2, "kvseal_ssd_records") == held - failed  # quarantined: out of the index
    for h in missing:
        q, loading = query_until_done(w2.client, "bad", [h])
        assert (q.hits, loading) == (0, 0), q
    assert verify_failures(e2) == failed  # the second queries read nothing again
    w2.close()
    stop(e2)

    e3 = engine_factory(*args)
    rec3 = recovery(e3)
    # the scanned segments were sealed again, and the quarantined records are skipped
    assert (rec3["records"], rec3["scanned"], rec3["torn"], rec3["bad"]) == (held - failed, 0, 0, "none"), rec3
    w3 = workers(e3, "bad")
    served3, wrong3, _ = serve_everything(w3, hashes)
    assert (sorted(served3), wrong3) == (sorted(served), [])
    assert verify_failures(e3) == 0
    w3.close()
    stop(e3)

    e4 = engine_factory(*ssd_args(d, **small, recovery="none"))
    assert metric(e4, "kvseal_ssd_records") == 0 and segment_files(d) == []
    w4 = workers(e4, "bad")
    q, loading = query_until_done(w4.client, "bad", hashes[:CHUNK])
    assert (q.hits, loading) == (0, 0)


@pytest.mark.parametrize("note", ["quarantine", "purge"])
def test_recovery_none_forgets_the_discarded_directorys_notes(
    tmp_path: Path, engine_factory: EngineFactory, workers: Any, note: str
) -> None:
    """`--ssd-recovery none` discards the directory, and with it what the engine noted about its records: blocks
    saved afterwards must all come back at the next start. The discarded notes are a `quarantine` (of records that
    failed a read check) or a `purge` (DELETE /v1/namespaces/<ns>); segment numbers start again at 1 after `none`,
    so the new records come back at the old (segment, offset) places those notes name."""
    d = tmp_path / "ssd"
    n = 600
    hashes = block_hashes("none", n)
    small = {"segment": "1152KiB", "slab": "64KiB"}
    args = ssd_args(d, **small)
    e1 = engine_factory(*args)
    w1 = workers(e1, "again")
    final = w1.save(hashes)
    wait_until(lambda: e1.metric("kvseal_ssd_records") == n, WAIT_S, "every block written through")
    if note == "purge":
        request = urllib.request.Request(f"{e1.http}/v1/namespaces/{final}", method="DELETE")
        with urllib.request.urlopen(request, timeout=10) as response:
            assert [p["ssd_blocks"] for p in json.loads(response.read())] == [n]
    w1.close()
    stop(e1)
    first = segment_files(d)[0]
    _, entries = sealed_layout(first)
    if note == "quarantine":
        bad = entries[10:200:20]  # records of the first Save: the first write, at the same offsets every time
        with open(first, "r+b") as f:
            for offset, _ in bad:
                f.seek(offset + 1024)
                f.write(bytes(16))
        e2 = engine_factory(*args)
        w2 = workers(e2, "again")
        served, wrong, missing = serve_everything(w2, hashes)
        assert (len(served), wrong, sorted(missing)) == (n - len(bad), [], sorted(h for _, h in bad))
        assert verify_failures(e2) == len(bad)
        w2.close()
        stop(e2)
    assert any(line.startswith(f"{note} ") for line in (d / "notes.log").read_text().splitlines())

    e3 = engine_factory(*ssd_args(d, **small, recovery="none"))
    assert metric(e3, "kvseal_ssd_records") == 0 and segment_files(d) == []
    w3 = workers(e3, "again")
    w3.save(hashes)
    wait_until(lambda: e3.metric("kvseal_ssd_records") == n, WAIT_S, "every block written through again")
    w3.close()
    stop(e3)
    assert sealed_layout(segment_files(d)[0])[1][:200] == entries[:200]  # the same records at the same offsets

    e4 = engine_factory(*args)
    assert recovery(e4)["records"] == n, e4.stderr()
    load_all(workers(e4, "again"), hashes, first_loading=True)


# -------------------------------------------------------------------- 5. disk full


def test_a_full_disk_takes_the_path_out_and_the_engine_serves_from_memory(
    tmp_path: Path, engine_factory: EngineFactory, workers: Any
) -> None:
    """Under a file size limit (RLIMIT_FSIZE, per file) below one segment, creating the first segment fails
    (EFBIG, and SIGXFSZ, which the CLI ignores): the path leaves the write rotation with one logged error, and
    the engine keeps saving and serving from memory, byte-exact."""
    d = tmp_path / "ssd"
    e = engine_factory(*ssd_args(d), wrapper=("prlimit", f"--fsize={2 << 20}", "--"))
    w = workers(e, "full")
    rounds = [block_hashes(f"full-{k}", 300) for k in range(4)]
    w.save(rounds[0])
    wait_until(lambda: e.metric("kvseal_ssd_path_failed", path=str(d)) == 1, WAIT_S, "the path to fail")
    for hashes in rounds[1:]:  # more saves after the failure: none of them is written or logged again
        w.save(hashes)
    wait_until(lambda: e.metric("kvseal_ssd_skipped_total") == 1200, WAIT_S, "every block counted as not written")
    assert e.alive()
    assert e.stderr().count("write failed") == 1, e.stderr()
    assert f"write failed: File too large (errno {errno.EFBIG})" in e.stderr(), e.stderr()
    assert (metric(e, "kvseal_ssd_records"), metric(e, "kvseal_ssd_writes_total")) == (0, 0)
    assert segment_files(d) == []
    for hashes in rounds:
        load_all(w, hashes)
    assert e.alive() and e.stderr().count("write failed") == 1


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 48 MiB tmpfs of its own, a disk that fills (mounted as root, as CI runs), unmounted at teardown."""
    disk = tmp_path / "disk"
    disk.mkdir()
    cmd = ["mount", "-t", "tmpfs", "-o", "size=48m,mode=0700", "tmpfs", str(disk)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs needs root")
        pytest.fail(f"{' '.join(cmd)} failed as root ({r.stderr.strip()}): this test needs a disk of its own to fill")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def free_bytes(path: Path) -> int:
    vfs = os.statvfs(path)
    return vfs.f_bavail * vfs.f_frsize


def test_a_restart_on_a_disk_another_writer_filled_serves_every_record(
    small_disk: Path, engine_factory: EngineFactory, workers: Any
) -> None:
    """The engine's disk filled after it stopped (another writer's file): the same flags start it again with the
    capacity that fits (its segments and the free space, in whole segments), one warning naming the numbers and the
    capacity as a metric, and every record is served byte-exact. A fresh directory there is still refused."""
    d = small_disk / "ssd"
    segment = 4 << 20
    args = ssd_args(d, capacity="40MiB", segment="4MiB")
    n = 1200
    hashes = block_hashes("filled", n)
    e1 = engine_factory(*args)
    assert metric(e1, "kvseal_ssd_capacity_bytes", path=str(d)) == 40 << 20
    w1 = workers(e1, "i1")
    w1.save(hashes)
    wait_until(lambda: e1.metric("kvseal_ssd_records") == n, WAIT_S, "every block written through")
    w1.close()
    stop(e1)
    held = sum(p.stat().st_blocks * 512 for p in segment_files(d))
    assert held == 2 * segment, segment_files(d)
    with open(small_disk / "another-writer", "wb") as f:  # all but 9 MiB: room for 2 more segments, not 8
        os.posix_fallocate(f.fileno(), 0, free_bytes(small_disk) - (9 << 20))
    free = free_bytes(small_disk)
    fits = (held + free) // segment * segment
    assert fits == 4 * segment, (held, free)

    e2 = engine_factory(*args)
    warnings = [line for line in e2.stderr().splitlines() if "--ssd-capacity" in line]
    assert len(warnings) == 1, e2.stderr()
    assert warnings[0].endswith(
        f"ssd {d}: --ssd-capacity 40 MiB does not fit there now: the engine's segments take {format_size(held)} and "
        f"{format_size(free)} is free on its filesystem: running with {format_size(fits)} (4 segments, "
        "kvseal_ssd_capacity_bytes) until space is freed and the engine restarted"
    ), warnings
    assert e2.stdout_path.read_text().endswith(f", SSD {d} (16 MiB of the 40 MiB asked: its disk is full)\n")
    assert metric(e2, "kvseal_ssd_capacity_bytes", path=str(d)) == fits
    assert recovery(e2)["records"] == n
    load_all(workers(e2, "i1"), hashes, first_loading=True)
    assert verify_failures(e2) == 0 and metric(e2, "kvseal_ssd_path_failed", path=str(d)) == 0
    assert e2.stderr().count("--ssd-capacity") == 1

    r = serve_fails(*ssd_args(small_disk / "fresh", capacity="40MiB", segment="4MiB"))
    assert r.returncode == 2 and one_error_line(r).startswith(
        "kvseal serve: error: argument --ssd-capacity: 40 MiB is more than the "
    ), r.stderr
    assert f"free on the filesystem of --ssd-path '{small_disk / 'fresh'}'" in r.stderr
    assert not (small_disk / "fresh").exists()


# -------------------------------------------------------------------- 6. two paths


def test_two_paths_stripe_and_both_recover(tmp_path: Path, engine_factory: EngineFactory, workers: Any) -> None:
    d1, d2 = tmp_path / "ssd0", tmp_path / "ssd1"
    n = 1000
    hashes = block_hashes("stripe", n)
    e1 = engine_factory(*ssd_args(d1, d2))
    w1 = workers(e1, "stripe")
    for start in range(0, n, 100):  # one batch per Save: the batches take turns
        w1.save(hashes[start : start + 100])
    wait_until(lambda: e1.metric("kvseal_ssd_records") == n, WAIT_S, "every block written through")
    assert [metric(e1, "kvseal_ssd_path_failed", path=str(p)) for p in (d1, d2)] == [0, 0]
    w1.close()
    stop(e1)
    on_disk = [sum(len(scan_blocks(seg)) for seg in segment_files(p)) for p in (d1, d2)]
    assert sum(on_disk) == n and min(on_disk) > 0, on_disk

    e2 = engine_factory(*ssd_args(d1, d2))
    rec = recovery(e2)
    assert (rec["records"], rec["segments"], rec["scanned"]) == (n, 2, 0), rec
    load_all(workers(e2, "stripe"), hashes, first_loading=True)
    assert verify_failures(e2) == 0


# -------------------------------------------------------------------- 7. bad flags


def test_bad_ssd_flags_refuse_to_start(tmp_path: Path) -> None:
    d = tmp_path / "ssd"
    r = serve_fails("--ssd-path", str(d))
    assert r.returncode == 2 and "--ssd-capacity" in one_error_line(r), r.stderr
    r = serve_fails(*ssd_args(d, capacity="7MiB", segment="4MiB"))
    line = one_error_line(r)
    assert r.returncode == 2 and line.startswith("kvseal serve: error: argument --ssd-capacity: "), r.stderr
    assert not d.exists()  # refused before touching anything
    regular = tmp_path / "a-file"
    regular.write_text("")
    r = serve_fails(*ssd_args(regular / "ssd"))
    assert r.returncode == 1 and "--ssd-path" in one_error_line(r) and str(regular / "ssd") in r.stderr, r.stderr
