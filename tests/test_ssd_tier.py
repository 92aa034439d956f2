"""The SSD tier's disk engine (kvseal.ssd.tier) on the in-memory device (kvseal.testing.MemoryDevice): round trips,
restarts clean and after a crash, torn tails, seeded corruption, reclaim at capacity, a full or failing disk,
layouts kept apart, migration of older namespaces, and a close/reopen fuzz loop (no phantom, nothing acknowledged
lost). Then its pieces on their own: recovery's index as a value (kvseal.ssd.recovery), the block index
(kvseal.ssd.index), and the Tier interface that DiskTier and the no-op NullTier (kvseal.ssd.null) both keep. The
same logic on real files is covered by the process tests (tests/test_ssd_process.py)."""

from __future__ import annotations

import inspect
import json
import random
import threading
from collections.abc import Sequence

import numpy as np
import pytest
from conftest import wait_until

from kvseal.core.layout import LayerGeometry, Layout, build_layout, namespace_final
from kvseal.ssd import format as fmt
from kvseal.ssd.index import BlockIndex, location
from kvseal.ssd.null import NullTier
from kvseal.ssd.recovery import recover
from kvseal.ssd.tier import DiskTier, Tier, WriteItem
from kvseal.testing import MemoryDevice

SEGMENT = 256 << 10
BASE = build_layout(16, 1, [LayerGeometry("model.layers.0.attn", "float16", 4096, 2, 0, "vec")])
MTP = build_layout(
    16,
    1,
    [
        LayerGeometry("model.layers.0.attn", "float16", 4096, 2, 0, "vec"),
        LayerGeometry("model.layers.1.attn", "float16", 4096, 2, 0, "vec"),
    ],
)
BF16 = build_layout(16, 1, [LayerGeometry("model.layers.0.attn", "bfloat16", 4096, 2, 0, "vec")])


def key(layout: Layout, tenant: int = 0, client: str = "llama") -> tuple[int, str]:
    return tenant, namespace_final(client, layout)


def page(layout: Layout, block_hash: bytes) -> bytes:
    """A page whose bytes follow from its layout and hash: a phantom (another block's bytes) cannot pass."""
    seed = int.from_bytes(layout.digest[:4] + block_hash[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, layout.page_bytes, dtype=np.uint8).tobytes()


def hashes(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i}".encode().ljust(32, b".") for i in range(n)]


class Harness:
    """A DiskTier over devices, with helpers that write and read whole pages synchronously."""

    def __init__(self, devices: Sequence[MemoryDevice], recovery: str = "scan", **kwargs: int) -> None:
        self.devices = devices
        self.tier = DiskTier(devices, batch_bytes=64 << 10, **kwargs)
        self.report = self.tier.open(recovery)

    def write(
        self, layout: Layout, block_hashes: list[bytes], tenant: int = 0, client: str = "llama", reinsert: bool = False
    ) -> bool:
        done = threading.Event()
        result: list[bool] = []
        pages = [memoryview(page(layout, h)) for h in block_hashes]
        items = [WriteItem(h, p) for h, p in zip(block_hashes, pages, strict=True)]

        def finished(ok: bool) -> None:
            result.append(ok)
            done.set()

        if self.tier.write(key(layout, tenant, client), layout, items, finished, reinsert=reinsert) != len(items):
            return False
        assert done.wait(30), "the writer did not finish"
        return result[0]

    def read(self, layout: Layout, block_hashes: list[bytes], tenant: int = 0, client: str = "llama") -> list[str]:
        """Reads every hash; asserts that each block read holds exactly its bytes. Returns the per-block results."""
        dst = [memoryview(bytearray(layout.page_bytes)) for _ in block_hashes]
        results = self.tier.read(key(layout, tenant, client), layout, block_hashes, dst)
        for h, d, r in zip(block_hashes, dst, results, strict=True):
            if r == "":
                assert bytes(d) == page(layout, h), "a block read back with other bytes"
        return results

    def prefix(self, layout: Layout, block_hashes: list[bytes], tenant: int = 0) -> int:
        return self.tier.prefix(key(layout, tenant), block_hashes)

    def close(self) -> None:
        self.tier.close()


def test_blocks_read_back_byte_exact_and_survive_a_clean_restart() -> None:
    dev = MemoryDevice(4 << 20, SEGMENT)
    t = Harness([dev])
    hs = hashes("a", 40)
    assert t.write(BASE, hs)
    assert t.prefix(BASE, hs) == 40 and t.read(BASE, hs) == [""] * 40
    t.close()
    t = Harness([dev])
    assert t.report.records == 40 and t.report.scanned_segments == 0  # sealed segments: summaries only
    assert t.prefix(BASE, hs) == 40 and t.read(BASE, hs) == [""] * 40
    assert t.tier.statistics().records == 40
    t.close()


def test_after_a_crash_the_segment_being_written_is_scanned_and_sealed() -> None:
    dev = MemoryDevice(4 << 20, SEGMENT)
    t = Harness([dev])
    hs = hashes("c", 10)
    assert t.write(BASE, hs)  # no close: the process "died" with the segment unsealed
    crashed = Harness([dev])
    assert crashed.report.scanned_segments == 1 and crashed.report.records == 10
    assert crashed.read(BASE, hs) == [""] * 10
    crashed.close()
    again = Harness([dev])
    assert again.report.scanned_segments == 0 and again.report.records == 10  # the scan sealed it
    again.close()


def test_a_torn_tail_is_cut_and_nothing_after_it_is_served() -> None:
    dev = MemoryDevice(4 << 20, SEGMENT)
    t = Harness([dev])
    first, second = hashes("t1", 4), hashes("t2", 4)
    assert t.write(BASE, first) and t.write(BASE, second)
    seq = dev.segments()[-1]
    data = dev.files[seq]
    last_magic = data.rfind(fmt.RECORD_MAGIC)  # tear the last record: half of its payload never reached the disk
    data[last_magic + 4096 : last_magic + 8192] = bytes(4096)
    t2 = Harness([dev])
    assert t2.report.torn_cut == 1 and t2.report.records == 7
    assert t2.prefix(BASE, first + second) == 7
    assert t2.read(BASE, first + second[:3]) == [""] * 7
    t2.close()


@pytest.mark.parametrize("seed", range(8))
def test_seeded_corruptions_are_never_served(seed: int) -> None:
    """125 corruptions per seed (1000 in all) of a stopped tier's bytes, each followed by a start and a read of
    everything: no block ever comes back with bytes other than its own, and each failure is counted."""
    rng = random.Random(seed)
    layouts = (BASE, MTP)
    written = {lay.digest: hashes(f"s{seed}-{i}", 12) for i, lay in enumerate(layouts)}
    pristine = MemoryDevice(2 << 20, 128 << 10)
    t = Harness([pristine])
    for lay in layouts:
        assert t.write(lay, written[lay.digest][:6]) and t.write(lay, written[lay.digest][6:])
    t.close()
    for _ in range(125):
        dev = MemoryDevice(2 << 20, 128 << 10)
        dev.files = {seq: bytearray(b) for seq, b in pristine.files.items()}
        seq = rng.choice(sorted(dev.files))
        data = dev.files[seq]
        used = max(data.rfind(fmt.RECORD_MAGIC) + 8192, 4096)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(0, used)
            if rng.random() < 0.3:  # a range of zeros: a lost write
                n = rng.randint(1, 5000)
                data[at : at + n] = bytes(len(data[at : at + n]))
            else:
                data[at] ^= rng.randint(1, 255)
        t = Harness([dev])
        served = bad = 0
        for lay in layouts:
            results = t.read(lay, written[lay.digest])  # asserts every block read is byte exact
            served += results.count("")
            failures = [r for r in results if r not in ("", "missing")]
            assert all(r in ("checksum", "truncated", "digest", "mismatch") for r in failures), results
            bad += len(failures)
        assert sum(t.tier.statistics().verify_failures.values()) == bad  # each one counted
        # a quarantined block is gone from the index: asking again finds it missing, not bad
        for lay in layouts:
            assert all(r in ("", "missing") for r in t.read(lay, written[lay.digest]))
        assert served <= 24
        t.close()


def test_reclaim_at_capacity_drops_the_oldest_segments_whole() -> None:
    dev = MemoryDevice(1 << 20, 128 << 10)  # 8 segments of 128 KiB: ~13 blocks of 8 KiB each
    t = Harness([dev])
    batches = [hashes(f"r{i}", 10) for i in range(20)]
    for batch in batches:
        assert t.write(BASE, batch)
    assert len(dev.segments()) <= dev.max_segments
    held = [h for batch in batches for h in batch if t.prefix(BASE, [h])]
    assert batches[-1][-1] in held and batches[0][0] not in held  # newest kept, oldest reclaimed
    assert t.read(BASE, held) == [""] * len(held)
    assert t.tier.statistics().records == len(held)
    t.close()
    t = Harness([dev])
    assert sorted(h for batch in batches for h in batch if t.prefix(BASE, [h])) == sorted(held)
    t.close()


def test_a_full_disk_takes_the_device_out_of_the_rotation_and_keeps_what_it_holds() -> None:
    dev = MemoryDevice(4 << 20, SEGMENT)
    dev.space_bytes = 2 * SEGMENT  # room for two segments, then ENOSPC
    t = Harness([dev])
    kept = hashes("k", 10)
    assert t.write(BASE, kept)
    results = [t.write(BASE, hashes(f"f{i}", 10)) for i in range(20)]
    assert False in results
    stats = t.tier.statistics()
    assert "memory" in stats.failed_devices and "No space" in stats.failed_devices["memory"]
    assert t.write(BASE, hashes("after", 2)) is False  # no device left: refused at once, never queued
    assert t.read(BASE, kept) == [""] * 10
    t.close()


class GatedDevice(MemoryDevice):
    """A MemoryDevice whose writes wait for `gate`: a device slower than the saves (a burst)."""

    def __init__(self, capacity_bytes: int, segment_bytes: int) -> None:
        super().__init__(capacity_bytes, segment_bytes)
        self.gate = threading.Event()
        self.gate.set()

    def write(self, seq: int, offset: int, data: memoryview) -> None:
        assert self.gate.wait(30), "the test never opened the gate"
        super().write(seq, offset, data)


def test_a_burst_writes_the_head_of_each_batch_that_fits_and_counts_the_rest() -> None:
    """The queue holds 10 pages and the device is stuck: a batch of 6 is taken whole, the next batch of 7 only
    for its 4 leading blocks (a prompt's head: every later hit needs it), a third not at all; the skipped ones
    are counted, and once the device moves the taken ones read back and only they."""
    dev = GatedDevice(4 << 20, SEGMENT)
    t = Harness([dev], max_pending_bytes=10 * BASE.page_bytes)
    dev.gate.clear()
    a, b, c = hashes("a", 6), hashes("b", 7), hashes("c", 3)
    done: list[bool] = []
    for batch, taken in ((a, 6), (b, 4), (c, 0)):
        items = [WriteItem(h, memoryview(page(BASE, h))) for h in batch]
        assert t.tier.write(key(BASE), BASE, items, done.append) == taken
    assert t.tier.statistics().skipped == 3 + 3
    dev.gate.set()
    wait_until(lambda: len(done) == 2, 30, "both taken batches written")
    assert done == [True, True]  # one call per batch taken (the third never gets one)
    assert t.read(BASE, a + b[:4]) == [""] * 10
    assert [t.prefix(BASE, [h]) for h in b[4:] + c] == [0] * 6
    t.close()


def test_a_failing_device_leaves_the_others_writing() -> None:
    bad, good = MemoryDevice(4 << 20, SEGMENT, "bad"), MemoryDevice(4 << 20, SEGMENT, "good")
    t = Harness([bad, good])
    bad.fail_writes = True
    outcomes = [t.write(BASE, hashes(f"e{i}", 4)) for i in range(6)]
    assert outcomes.count(False) >= 1 and outcomes[-1] is True  # the bad path failed once, then only good writes
    assert set(t.tier.statistics().failed_devices) == {"bad"}
    t.close()


def test_striping_over_two_devices_reads_back_from_both() -> None:
    a, b = MemoryDevice(4 << 20, SEGMENT, "a"), MemoryDevice(4 << 20, SEGMENT, "b")
    t = Harness([a, b])
    batches = [hashes(f"p{i}", 5) for i in range(6)]
    for batch in batches:
        assert t.write(BASE, batch)
    assert a.writes and b.writes
    t.close()
    t = Harness([a, b])
    every = [h for batch in batches for h in batch]
    assert t.read(BASE, every) == [""] * len(every)
    t.close()


def test_layouts_and_users_stay_apart_across_a_restart() -> None:
    """MTP on/off (an extra layer) and fp16/bf16 (same bytes) under one client namespace, and two users of one
    layout: one device, shared hashes, never one's bytes for another."""
    dev = MemoryDevice(4 << 20, SEGMENT)
    t = Harness([dev])
    hs = hashes("shared", 6)
    for lay in (BASE, MTP, BF16):
        assert t.write(lay, hs)
    assert t.write(BASE, hs, tenant=1000)
    t.close()
    t = Harness([dev])
    assert len(t.tier.namespaces()) == 4
    for lay in (BASE, MTP, BF16):
        assert t.read(lay, hs) == [""] * 6  # page() differs per layout: a cross read would fail the byte check
    assert t.read(BASE, hs, tenant=1000) == [""] * 6
    assert t.tier.prefix(key(BASE, 5), hs) == 0
    t.close()


def test_a_reader_of_another_layout_under_the_same_key_is_refused() -> None:
    t = Harness([MemoryDevice(4 << 20, SEGMENT)])
    hs = hashes("x", 3)
    assert t.write(BASE, hs)
    dst = [memoryview(bytearray(BF16.page_bytes)) for _ in hs]
    assert t.tier.read(key(BASE), BF16, hs, dst) == ["digest"] * 3
    t.close()


def rewrite_namespace(dev: MemoryDevice, old: str, new: str, descriptor: bytes | None = None) -> None:
    """Rewrites a device's records as an older kvseal would have written them: every record of namespace `old`
    carries `new` instead (and `descriptor` as its layout, if given). Segments are rebuilt unsealed."""
    for seq, data in list(dev.files.items()):
        out = bytearray(fmt.encode_segment_header(fmt.SegmentHeader(seq, 0.0, False)))
        at = fmt.SEGMENT_HEADER_BYTES
        while at < len(data) and bytes(data[at : at + 4]) == fmt.RECORD_MAGIC:
            header = fmt.decode_record_header(data[at:])
            payload = bytes(fmt.verify_payload(header, data[at:]))
            if header.kind != fmt.SUMMARY:
                name = new if header.namespace_final == old else header.namespace_final
                if header.kind == fmt.LAYOUT and descriptor is not None and name == new:
                    payload = descriptor
                out += fmt.encode_record(header.kind, header.tenant, name, header.digest, header.block_hash, payload)
            at += header.record_len
            if at % 4096 and bytes(data[at : at + 4]) != fmt.RECORD_MAGIC:
                at = fmt.align(at, 4096)
        out += bytes(len(data) - len(out))
        dev.files[seq] = out


def test_namespaces_keyed_by_an_older_fingerprint_are_rekeyed() -> None:
    dev = MemoryDevice(4 << 20, SEGMENT)
    t = Harness([dev])
    hs = hashes("m", 5)
    assert t.write(BASE, hs)
    t.close()
    current = namespace_final("llama", BASE)
    older = f"llama.{BASE.digest.hex()[:12]}"  # as if fingerprints once had 12 hex digits
    rewrite_namespace(dev, current, older)
    t = Harness([dev])
    assert t.report.rekeyed == {older: current}
    assert t.read(BASE, hs) == [""] * 5  # found under the current name; records checked against the old one
    t.close()


def test_namespaces_whose_descriptor_this_version_cannot_build_are_dropped() -> None:
    dev = MemoryDevice(4 << 20, SEGMENT)
    t = Harness([dev])
    hs = hashes("d", 5)
    assert t.write(BASE, hs) and t.write(MTP, hs)
    t.close()
    doc = json.loads(BASE.descriptor)
    doc["format"] = 0
    old_descriptor = json.dumps(doc).encode()
    rewrite_namespace(dev, namespace_final("llama", BASE), namespace_final("llama", BASE), old_descriptor)
    t = Harness([dev])
    assert t.report.dropped_namespaces == [namespace_final("llama", BASE)]
    assert t.prefix(BASE, hs) == 0  # never served under a guessed namespace
    assert t.read(MTP, hs) == [""] * 5
    t.close()


def test_strict_recovery_refuses_a_bad_directory_and_none_starts_empty() -> None:
    dev = MemoryDevice(4 << 20, SEGMENT)
    t = Harness([dev])
    assert t.write(BASE, hashes("z", 4))
    dev.files[dev.segments()[0]][0] ^= 1  # a segment header
    with pytest.raises(RuntimeError, match="strict"):
        DiskTier([dev]).open("strict")
    t = Harness([dev], recovery="none")
    assert t.report.records == 0 and dev.segments() == []
    t.close()


@pytest.mark.parametrize("seed", range(4))
def test_close_and_reopen_in_a_loop_never_shows_a_phantom_nor_loses_an_acknowledged_block(seed: int) -> None:
    """New blocks, blocks written again (the second chance: their records move), clean closes and crashes, in a
    seeded order: every acknowledged block reads back byte-exact, nothing else does."""
    rng = random.Random(seed)
    dev = MemoryDevice(64 << 20, SEGMENT)  # no reclaim: every acknowledged block must stay
    acknowledged: dict[bytes, list[bytes]] = {BASE.digest: [], MTP.digest: []}
    t = Harness([dev])
    rewritten = 0
    for step in range(40):
        op = rng.random()
        if op < 0.5:
            lay = rng.choice((BASE, MTP))
            batch = hashes(f"z{seed}-{step}", rng.randint(1, 12))
            if t.write(lay, batch):
                acknowledged[lay.digest] += batch
        elif op < 0.65:
            lay = rng.choice((BASE, MTP))
            held = acknowledged[lay.digest]
            if held:
                assert t.write(lay, rng.sample(held, min(len(held), rng.randint(1, 8))), reinsert=True)
                rewritten += 1
        elif op < 0.8:
            if rng.random() < 0.5:
                t.close()
            t = Harness([dev])  # without close: a crash
        for lay in (BASE, MTP):
            probe = acknowledged[lay.digest] + hashes(f"never-{step}", 2)
            results = t.read(lay, probe)  # byte checks: no phantom
            assert results[: len(acknowledged[lay.digest])] == [""] * len(acknowledged[lay.digest])
            assert results[len(acknowledged[lay.digest]) :] == ["missing", "missing"]
    t.close()
    assert rewritten > 0


def test_blocks_in_the_newest_segment_are_never_written_again() -> None:
    """A log of two segments: a quarter of it rounds to one segment, the newest, whose blocks are young (writing
    them again would start a segment and reclaim the other, which holds everything else)."""
    t = Harness([MemoryDevice(2 * SEGMENT, SEGMENT)])
    hs = hashes("young", 4)
    assert t.write(BASE, hs)
    assert t.tier.aging(key(BASE), hs) == []
    t.close()
    t = Harness([MemoryDevice(8 * SEGMENT, SEGMENT)])
    assert t.write(BASE, hs)
    assert t.tier.aging(key(BASE), hs) == []
    t.close()


def test_a_purged_namespace_stays_gone_after_a_restart_and_new_blocks_come_back() -> None:
    dev = MemoryDevice(4 << 20, SEGMENT)
    t = Harness([dev])
    old, other = hashes("old", 6), hashes("other", 3)
    assert t.write(BASE, old) and t.write(MTP, other)
    assert t.tier.purge(key(BASE)) == 6
    assert t.prefix(BASE, old) == 0
    new = hashes("new", 4)
    assert t.write(BASE, new)  # written after the purge: kept
    t.close()
    t = Harness([dev])
    assert t.prefix(BASE, old) == 0 and t.read(BASE, new) == [""] * 4 and t.read(MTP, other) == [""] * 3
    t.close()


def test_inspection_changes_nothing_and_finds_bad_records() -> None:
    dev = MemoryDevice(4 << 20, SEGMENT)
    t = Harness([dev])
    hs = hashes("i", 8)
    assert t.write(BASE, hs)  # no close: the segment stays unsealed
    data = dev.files[dev.segments()[0]]
    data[data.find(hs[7]) + 300] ^= 1  # the last block's payload
    before = {seq: bytes(b) for seq, b in dev.files.items()}
    report, found = DiskTier([dev]).inspect(verify=True)
    assert {seq: bytes(b) for seq, b in dev.files.items()} == before and dev.lines == []
    assert report.scanned_segments == 1 and report.torn_cut == 1 and report.records == 7
    assert found == {key(BASE): {"records": 7, "page_bytes": BASE.page_bytes}}
    t.close()  # sealed now by the writer, whose summary lists all 8; corrupt one more: only a full read finds them
    data = dev.files[dev.segments()[0]]
    data[data.find(hs[2]) + 300] ^= 1
    report, found = DiskTier([dev]).inspect(verify=True)
    assert report.scanned_segments == 0
    assert found == {key(BASE): {"records": 8, "page_bytes": BASE.page_bytes, "checksum": 2}}


def test_a_layout_colliding_with_a_namespace_on_disk_is_never_written_under_it() -> None:
    t = Harness([MemoryDevice(4 << 20, SEGMENT)])
    hs = hashes("col", 3)
    assert t.write(BASE, hs)
    pages = [memoryview(page(BF16, h)) for h in hs]
    done: list[bool] = []
    assert t.tier.write(key(BASE), BF16, [WriteItem(h, p) for h, p in zip(hs, pages, strict=True)], done.append) == 0
    assert done == [] and t.read(BASE, hs) == [""] * 3
    t.close()


# ---------------------------------------------------------------------- the pieces


def test_recovery_returns_the_index_and_changes_nothing_when_readonly() -> None:
    dev = MemoryDevice(4 << 20, SEGMENT)
    t = Harness([dev])
    first, second = hashes("v1", 5), hashes("v2", 3)
    assert t.write(BASE, first)
    t.close()  # segment 1 sealed
    t = Harness([dev])
    assert t.write(MTP, second)  # segment 2, left unsealed: a crash
    before = {seq: bytes(b) for seq, b in dev.files.items()}
    found = recover([dev], "scan", readonly=True)
    assert {seq: bytes(b) for seq, b in dev.files.items()} == before
    assert found.report.records == 8 and found.report.scanned_segments == 1
    assert [(d.sealed, d.next_seq) for d in found.devices] == [([1, 2], 3)]
    assert found.index.prefix(key(BASE), first) == 5 and found.index.prefix(key(MTP), second) == 3
    assert found.index.records == 8 and found.index.bytes == 5 * BASE.page_bytes + 3 * MTP.page_bytes
    assert found.index.summary()[key(MTP)] == (3, 3 * MTP.page_bytes, MTP.descriptor)
    sealing = recover([dev], "scan")  # not readonly: the unsealed segment is sealed
    assert sealing.report.scanned_segments == 1 and recover([dev], "scan").report.scanned_segments == 0
    with pytest.raises(ValueError, match="recovery must be one of"):
        recover([dev], "fast")


def test_the_index_moves_blocks_forgets_reclaimed_segments_and_defers_a_file_in_use() -> None:
    index = BlockIndex()
    ns = index.namespace_for(key(BASE), BASE)
    a, b = hashes("ix", 2)
    index.add((0, 1), ns, [a, b], [location(0, 1, 4096), location(0, 1, 8192)])
    index.add((0, 2), ns, [b], [location(0, 2, 4096)])  # written again: it moves to its newest record
    assert (index.records, index.bytes) == (2, 2 * BASE.page_bytes)
    index.pin([(0, 1), (0, 1)])  # two runs of one read
    assert index.drop_segment((0, 1)) is False  # in use: the file stays
    assert index.prefix(key(BASE), [b, a]) == 1 and index.absent(key(BASE), [a, b]) == [0]
    assert index.holds(key(BASE), [a, b, a]) == [False, True, False] and index.holds(key(MTP), [b]) == [False]
    assert index.unpin([(0, 1)]) == [] and index.unpin([(0, 1)]) == [(0, 1)]  # the last read removes it
    assert index.drop_segment((0, 2)) is True
    assert (index.records, index.bytes) == (0, 0) and index.summary() == {key(BASE): (0, 0, BASE.descriptor)}
    index.add((0, 3), ns, [a, b], [location(0, 3, 4096), location(0, 3, 8192)])
    index.discard(ns, a, location(0, 9, 4096))  # a stale location: nothing
    index.discard(ns, a, location(0, 3, 4096))
    assert index.absent(key(BASE), [a, b]) == [0] and index.clear(ns) == 1 and index.records == 0


def test_the_index_finds_a_namespace_by_an_older_stored_name() -> None:
    index = BlockIndex()
    current = namespace_final("llama", BASE)
    ns = index.alias((7, current), BASE.descriptor, BASE, "llama.0123456789ab")
    assert index.stored(7, "llama.0123456789ab") is ns and index.stored(7, current) is None
    assert ns.names == {current, "llama.0123456789ab"} and ns.longest_name == len("llama.0123456789ab")
    assert index.alias((7, current), BASE.descriptor, BASE, current) is ns and index.stored(7, current) is ns


TIER_METHODS = ("prefix", "holds", "absent", "aging", "write", "read", "namespaces", "purge", "statistics", "close")


@pytest.mark.parametrize("implementation", [DiskTier, NullTier])
def test_the_tier_interface_is_kept_by_every_tier(implementation: type) -> None:
    """Same methods, same parameters, as the Tier protocol: the engine may hold either."""
    for name in TIER_METHODS:
        assert inspect.signature(getattr(implementation, name)) == inspect.signature(getattr(Tier, name)), name
    assert {n for n in vars(Tier) if not n.startswith("_")} == set(TIER_METHODS)


def test_the_null_tier_holds_nothing_and_takes_nothing() -> None:
    tier: Tier = NullTier()
    hs = hashes("null", 3)
    assert tier.prefix(key(BASE), hs) == 0
    assert tier.absent(key(BASE), hs) == [] and tier.aging(key(BASE), hs) == []  # nothing to write, nor to pin
    assert tier.holds(key(BASE), hs) == [False] * 3
    done: list[bool] = []
    items = [WriteItem(h, memoryview(page(BASE, h))) for h in hs]
    assert tier.write(key(BASE), BASE, items, done.append) == 0 and done == []  # not taken: no call
    dst = [memoryview(bytearray(BASE.page_bytes)) for _ in hs]
    assert tier.read(key(BASE), BASE, hs, dst) == ["missing"] * 3
    assert all(not any(d) for d in dst)
    assert tier.namespaces() == {} and tier.purge(key(BASE)) == 0
    stats = tier.statistics()
    assert stats.devices == () and stats.records == stats.writes == stats.reads == stats.skipped == 0
    assert stats.verify_failures == {} and stats.failed_devices == {}
    tier.close()
    tier.close()
