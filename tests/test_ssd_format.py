"""The SSD record format (kvseal.ssd.format): round trips, and the one rule a reader relies on — any change to a
record's bytes either raises FormatError or leaves what it says (fields and payload) exactly as written."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvseal.ssd import format as fmt

names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789._:@-", min_size=1, max_size=80)
hashes = st.binary(min_size=1, max_size=fmt.MAX_HASH_BYTES)
payloads = st.binary(min_size=0, max_size=3000)


def record(tenant: int, ns: str, block_hash: bytes, payload: bytes) -> bytes:
    return fmt.encode_record(fmt.BLOCK, tenant, ns, hashlib.sha256(ns.encode()).digest(), block_hash, payload)


def read_back(data: bytes) -> tuple[fmt.RecordHeader, bytes]:
    header = fmt.decode_record_header(data)
    return header, bytes(fmt.verify_payload(header, data))


@given(st.integers(0, 2**32 - 1), names, hashes, payloads)
def test_a_record_reads_back_as_written(tenant: int, ns: str, block_hash: bytes, payload: bytes) -> None:
    data = record(tenant, ns, block_hash, payload)
    assert len(data) % fmt.RECORD_ALIGN == 0
    header, got = read_back(data)
    assert (header.kind, header.tenant, header.namespace_final, header.block_hash) == (
        fmt.BLOCK,
        tenant,
        ns,
        block_hash,
    )
    assert header.digest == hashlib.sha256(ns.encode()).digest() and got == payload
    assert header.record_len == len(data)


@settings(max_examples=300)
@given(names, hashes, st.binary(min_size=1, max_size=600), st.data())
def test_any_changed_byte_is_refused_or_changes_nothing_said(
    ns: str, block_hash: bytes, payload: bytes, data: st.DataObject
) -> None:
    good = record(7, ns, block_hash, payload)
    expected = read_back(good)
    bad = bytearray(good)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(bad) - 1))
        bad[at] ^= data.draw(st.integers(1, 255))
    try:
        got = read_back(bytes(bad))
    except fmt.FormatError as e:
        assert e.reason in ("checksum", "truncated", "version")
        return
    assert got == expected  # only padding changed


@given(names, hashes, st.binary(min_size=1, max_size=600), st.data())
def test_a_cut_record_is_refused(ns: str, block_hash: bytes, payload: bytes, data: st.DataObject) -> None:
    good = record(1, ns, block_hash, payload)
    end = fmt.header_len(ns, block_hash) + len(payload)
    cut = data.draw(st.integers(0, end - 1))
    with pytest.raises(fmt.FormatError) as e:
        read_back(good[:cut])
    assert e.value.reason in ("truncated", "checksum")


@given(
    st.lists(st.tuples(st.integers(0, 70000), names, st.binary(min_size=2, max_size=200)), max_size=4),
    st.lists(st.tuples(st.sampled_from([fmt.BLOCK, fmt.LAYOUT]), st.integers(0, 2**31), hashes), max_size=50),
)
def test_a_summary_reads_back(table: list[tuple[int, str, bytes]], rows: list[tuple[int, int, bytes]]) -> None:
    namespaces = [fmt.Namespace(t, ns, d.hex().encode()) for t, ns, d in table]
    entries = [
        fmt.SummaryEntry(kind, i % max(1, len(namespaces)), off, 4096, off * 3, h)
        for i, (kind, off, h) in enumerate(rows)
    ]
    if not namespaces:
        entries = []
    got_table, got_rows = fmt.decode_summary(fmt.encode_summary(namespaces, entries))
    assert got_table == namespaces
    assert fmt.entry_hashes(got_rows) == [e.block_hash for e in entries]
    assert got_rows["offset"].tolist() == [e.offset for e in entries]
    assert got_rows["ns_ref"].tolist() == [e.ns_ref for e in entries]


def test_hashes_ending_in_zero_bytes_survive_the_summary() -> None:
    h = b"\x01\x00\x00"
    _, rows = fmt.decode_summary(
        fmt.encode_summary([fmt.Namespace(0, "m.x", b"{}")], [fmt.SummaryEntry(1, 0, 0, 0, 0, h)])
    )
    assert fmt.entry_hashes(rows) == [h]


@given(st.integers(0, 2**40), st.floats(0, 2e9), st.booleans(), st.integers(0, 2**40), st.integers(0, 2**30), st.data())
def test_a_segment_header_reads_back_and_any_change_is_refused(
    seq: int, created: float, sealed: bool, offset: int, length: int, data: st.DataObject
) -> None:
    header = fmt.SegmentHeader(seq, created, sealed, offset, length)
    raw = fmt.encode_segment_header(header)
    assert len(raw) == fmt.SEGMENT_HEADER_BYTES and fmt.decode_segment_header(raw) == header
    bad = bytearray(raw)
    at = data.draw(st.integers(0, 55))  # the checked bytes and their checksum
    bad[at] ^= data.draw(st.integers(1, 255))
    with pytest.raises(fmt.FormatError):
        fmt.decode_segment_header(bytes(bad))


@given(st.text(min_size=1, max_size=80), hashes, payloads)
def test_record_len_is_the_length_of_the_record_built(ns: str, block_hash: bytes, payload: bytes) -> None:
    """What the write path plans (fmt.record_len, from the name's UTF-8 length) is what encode_record builds."""
    data = fmt.encode_record(fmt.BLOCK, 3, ns, bytes(32), block_hash, payload)
    assert fmt.record_len(len(ns.encode()), len(block_hash), len(payload)) == len(data)


def test_notes_read_back_and_the_latest_purge_mark_wins() -> None:
    lines = [
        fmt.quarantine_note(3, 4096, "checksum"),
        fmt.purge_note(2, 8192, 1000, "llama.abc"),
        fmt.purge_note(5, 0, 1000, "llama.abc"),
        fmt.purge_note(4, 64, 1000, "llama.abc"),
        fmt.purge_note(1, 0, 0, "llama.abc"),
        "quarantine x 1 checksum",  # does not parse: reported
        "something newer 1 2",  # not a note this version knows: ignored
    ]
    notes = fmt.parse_notes(lines)
    assert notes.quarantined == {(3, 4096)}
    assert notes.purged == {(1000, "llama.abc"): (5, 0), (0, "llama.abc"): (1, 0)}
    assert notes.unparsed == ("quarantine x 1 checksum",)
