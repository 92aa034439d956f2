"""The SSD tier's on-disk format: segment files of self-describing records. Pure: bytes in, values out.

A tier directory holds segment files `seg-<seq>.kvs` of a fixed size. Records are appended to the newest
segment; a full segment is sealed by writing a summary record and then its header again, pointing at the summary.

    segment = | header (4096 B) | record | record | ... | record | summary record | (unused) |
                                 ^ every record starts at a multiple of 64 bytes

    header  = | magic "KVSEG001" 8 | format u16 | flags u16 (1 = sealed) | pad u32 | seq u64 | created f64
              | summary_offset u64 | summary_len u64 | xxh3 of the 48 bytes before it u64 | zero ... 4096 |

    record  = | magic "KVR1" 4 | version u8 | kind u8 | hash_len u8 | pad u8 | ns_len u16 | header_len u16
              | tenant u32 | pad u32 | payload_len u64 | layout digest 32 | payload xxh3 u64 | header xxh3 u64
              | namespace_final (ns_len) | block hash (hash_len) | zero to header_len (a multiple of 64)
              | payload (payload_len) | zero to the next multiple of 64 |

The header checksum covers the 68 bytes before it and the namespace and hash after it, so a record names its
tenant, final namespace, full layout digest and block hash and proves all of them; the payload has its own checksum.
Kinds: BLOCK (payload = one page), LAYOUT (payload = the canonical layout descriptor of (tenant, namespace_final),
written before the first block of that namespace in each segment, so any segment alone tells what its blocks mean),
SUMMARY (payload = every record of the segment, so recovery reads one record per sealed segment instead of all):

    summary payload = | table_len u32 | table (JSON: [[tenant, namespace_final, descriptor], ...]) | entries |
    entry           = | kind u8 | hash_len u8 | ns_ref u16 | offset u32 | record_len u32 | payload xxh3 u64
                      | hash 64 (zero padded) |

Checksums are XXH3-64 (tens of GB/s, so they cost nothing beside the disk).

Beside the segments, a device keeps the tier's notes (kvseal.ssd.device: `note`), one line each, which recovery
honours at every start:

    quarantine <seq> <offset> <reason>        the record there failed its checks on read: never index it again
    purge <seq> <offset> <tenant> <name>      the namespace stored as (tenant, name) was purged when the device's
                                              next write was to go at (seq, offset): its records before that are gone
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvseal.copy.kernel import checksums
from kvseal.errors import DataLoss

FORMAT = 1
SEGMENT_MAGIC = b"KVSEG001"
RECORD_MAGIC = b"KVR1"
RECORD_VERSION = 1
SEGMENT_HEADER_BYTES = 4096
RECORD_ALIGN = 64
MAX_HASH_BYTES = 64
SEALED = 1

BLOCK, LAYOUT, SUMMARY = 1, 2, 3

_SEGMENT = struct.Struct("<8sHHIQdQQ")  # magic, format, flags, pad, seq, created, summary offset, summary len
_RECORD = struct.Struct("<4sBBBBHHIIQ32sQ")  # the 68 checked bytes before the header checksum
_RECORD_FIXED = _RECORD.size + 8
_U64 = struct.Struct("<Q")
_ENTRY = np.dtype(
    [
        ("kind", "u1"),
        ("hash_len", "u1"),
        ("ns_ref", "<u2"),
        ("offset", "<u4"),
        ("record_len", "<u4"),
        ("payload_xxh", "<u8"),
        ("hash", "S64"),
    ]
)
_HASH_AT: int = _ENTRY.fields["hash"][1]  # type: ignore[index]  # a structured dtype has fields


class FormatError(DataLoss):
    """Bytes that are not a valid record or segment. `reason` is what the tier counts: checksum (bytes changed),
    truncated (bytes missing), digest (a block whose layout is not its namespace's), mismatch (a valid record that
    is not the one expected), version (written by a format this code does not read)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    seq: int
    created: float
    sealed: bool
    summary_offset: int = 0
    summary_len: int = 0


@dataclass(frozen=True, slots=True)
class RecordHeader:
    kind: int
    tenant: int
    namespace_final: str
    digest: bytes
    block_hash: bytes
    payload_len: int
    payload_xxh: int
    header_len: int

    @property
    def record_len(self) -> int:
        return align(self.header_len + self.payload_len, RECORD_ALIGN)


@dataclass(frozen=True, slots=True)
class Namespace:
    """One namespace of a segment's table: the descriptor is the canonical layout descriptor (kvseal.core.layout)."""

    tenant: int
    namespace_final: str
    descriptor: bytes


@dataclass(frozen=True, slots=True)
class SummaryEntry:
    kind: int
    ns_ref: int
    offset: int
    record_len: int
    payload_xxh: int
    block_hash: bytes


def align(n: int, to: int) -> int:
    return -(-n // to) * to


def checksum(data: bytes | memoryview) -> int:
    """XXH3-64 of a payload (without the GIL when the copy kernel can: readers and the writer hash in parallel)."""
    return checksums((data,))[0]


# -------------------------------------------------------------------- segment header


def encode_segment_header(header: SegmentHeader) -> bytes:
    fixed = _SEGMENT.pack(
        SEGMENT_MAGIC,
        FORMAT,
        SEALED if header.sealed else 0,
        0,
        header.seq,
        header.created,
        header.summary_offset,
        header.summary_len,
    )
    out = fixed + _U64.pack(checksum(fixed))
    return out + bytes(SEGMENT_HEADER_BYTES - len(out))


def decode_segment_header(data: bytes | memoryview) -> SegmentHeader:
    if len(data) < _SEGMENT.size + 8:
        raise FormatError("truncated", f"segment header: {len(data)} bytes")
    fixed = bytes(data[: _SEGMENT.size])
    magic, fmt, flags, _, seq, created, summary_offset, summary_len = _SEGMENT.unpack(fixed)
    if magic != SEGMENT_MAGIC:
        raise FormatError("checksum", "not a kvseal segment (bad magic)")
    if _U64.unpack_from(data, _SEGMENT.size)[0] != checksum(fixed):
        raise FormatError("checksum", "segment header checksum mismatch")
    if fmt != FORMAT:
        raise FormatError("version", f"segment format {fmt}, this kvseal reads format {FORMAT}")
    return SegmentHeader(seq, created, bool(flags & SEALED), summary_offset, summary_len)


# -------------------------------------------------------------------- records


def header_len(namespace_final: str, block_hash: bytes) -> int:
    return align(_RECORD_FIXED + len(namespace_final.encode()) + len(block_hash), RECORD_ALIGN)


def record_len(name_bytes: int, hash_bytes: int, payload_len: int) -> int:
    """The bytes a record takes in its segment (header and payload, padded), its namespace `name_bytes` long."""
    return align(align(_RECORD_FIXED + name_bytes + hash_bytes, RECORD_ALIGN) + payload_len, RECORD_ALIGN)


def encode_record_header(
    kind: int,
    tenant: int,
    namespace_final: str,
    digest: bytes,
    block_hash: bytes,
    payload: bytes | memoryview,
    payload_xxh: int | None = None,
) -> bytes:
    """The header of a record whose payload is `payload` (whose checksum the caller may have computed already);
    the payload follows it at offset len(header)."""
    ns = namespace_final.encode()
    if len(block_hash) > MAX_HASH_BYTES or len(digest) != 32:
        raise ValueError("block hash over 64 bytes or digest not 32 bytes")
    hlen = header_len(namespace_final, block_hash)
    fixed = _RECORD.pack(
        RECORD_MAGIC,
        RECORD_VERSION,
        kind,
        len(block_hash),
        0,
        len(ns),
        hlen,
        tenant,
        0,
        len(payload),
        digest,
        checksum(payload) if payload_xxh is None else payload_xxh,
    )
    variable = ns + block_hash
    return fixed + _U64.pack(checksum(fixed + variable)) + variable + bytes(hlen - _RECORD_FIXED - len(variable))


def decode_record_header(data: bytes | memoryview) -> RecordHeader:
    """Parses and checks a record header at the start of `data` (its payload is not checked: verify_payload)."""
    if len(data) < _RECORD_FIXED:
        raise FormatError("truncated", f"record header: {len(data)} bytes")
    fixed = bytes(data[: _RECORD.size])
    magic, version, kind, hash_len, _, ns_len, hlen, tenant, _, payload_len, digest, payload_xxh = _RECORD.unpack(fixed)
    if magic != RECORD_MAGIC:
        raise FormatError("checksum", "no record here (bad magic)")
    end = _RECORD_FIXED + ns_len + hash_len
    if hlen < end or len(data) < end:
        raise FormatError("checksum" if hlen < end else "truncated", "record header cut short")
    variable = bytes(data[_RECORD_FIXED:end])
    if _U64.unpack_from(data, _RECORD.size)[0] != checksum(fixed + variable):
        raise FormatError("checksum", "record header checksum mismatch")
    if version != RECORD_VERSION:
        raise FormatError("version", f"record version {version}, this kvseal reads {RECORD_VERSION}")
    if kind not in (BLOCK, LAYOUT, SUMMARY):
        raise FormatError("checksum", f"unknown record kind {kind}")
    try:
        namespace_final = variable[:ns_len].decode()
    except UnicodeDecodeError:
        raise FormatError("checksum", "namespace is not UTF-8") from None
    return RecordHeader(kind, tenant, namespace_final, digest, variable[ns_len:], payload_len, payload_xxh, hlen)


def verify_payload(header: RecordHeader, record: bytes | memoryview) -> memoryview:
    """The payload of `record` (its header first), checked against the header's length and checksum."""
    view = memoryview(record)
    payload = view[header.header_len : header.header_len + header.payload_len]
    if len(payload) < header.payload_len:
        raise FormatError("truncated", f"payload: {len(payload)} of {header.payload_len} bytes")
    if checksum(payload) != header.payload_xxh:
        raise FormatError("checksum", "payload checksum mismatch")
    return payload


def encode_record(
    kind: int, tenant: int, namespace_final: str, digest: bytes, block_hash: bytes, payload: bytes | memoryview
) -> bytes:
    """A whole record, padded to RECORD_ALIGN (the write path builds records in place instead)."""
    head = encode_record_header(kind, tenant, namespace_final, digest, block_hash, payload)
    body = head + bytes(payload)
    return body + bytes(align(len(body), RECORD_ALIGN) - len(body))


# -------------------------------------------------------------------- summary


def encode_summary(table: Sequence[Namespace], entries: Sequence[SummaryEntry]) -> bytes:
    table_json = json.dumps(
        [[ns.tenant, ns.namespace_final, ns.descriptor.decode()] for ns in table], separators=(",", ":")
    ).encode()
    rows = np.zeros(len(entries), dtype=_ENTRY)
    for i, e in enumerate(entries):
        rows[i] = (e.kind, len(e.block_hash), e.ns_ref, e.offset, e.record_len, e.payload_xxh, e.block_hash)
    return struct.pack("<I", len(table_json)) + table_json + rows.tobytes()


def decode_summary(payload: bytes | memoryview) -> tuple[list[Namespace], np.ndarray]:
    """The namespace table and the entries (a structured array: kind, hash_len, ns_ref, offset, record_len,
    payload_xxh, hash) of a checked summary payload."""
    data = bytes(payload)
    try:
        (table_len,) = struct.unpack_from("<I", data, 0)
        table = [Namespace(int(t), str(ns), str(d).encode()) for t, ns, d in json.loads(data[4 : 4 + table_len])]
        rows = np.frombuffer(data, dtype=_ENTRY, offset=4 + table_len)
    except (struct.error, ValueError, TypeError) as e:
        raise FormatError("checksum", f"summary does not parse: {e}") from None
    if len(rows) and (int(rows["ns_ref"].max()) >= len(table) or int(rows["hash_len"].max()) > MAX_HASH_BYTES):
        raise FormatError("checksum", "summary entry out of range")
    return table, rows


def entry_hashes(rows: np.ndarray) -> list[bytes]:
    """The block hashes of summary entries, each its stored length (numpy's S64 would drop trailing zero bytes)."""
    rows = np.ascontiguousarray(rows)
    raw = rows.view(np.uint8).reshape(len(rows), _ENTRY.itemsize)[:, _HASH_AT : _HASH_AT + MAX_HASH_BYTES]
    lengths = rows["hash_len"]
    if len(rows) and (lengths == lengths[0]).all():  # the usual case: one hash length, one slice per hash
        n = int(lengths[0])
        blob = np.ascontiguousarray(raw[:, :n]).tobytes()
        return [blob[i : i + n] for i in range(0, len(blob), n)] if n else [b""] * len(rows)
    return [raw[i, : int(length)].tobytes() for i, length in enumerate(lengths.tolist())]


# -------------------------------------------------------------------- notes


def quarantine_note(seq: int, offset: int, reason: str) -> str:
    return f"quarantine {seq} {offset} {reason}"


def purge_note(seq: int, offset: int, tenant: int, name: str) -> str:
    return f"purge {seq} {offset} {tenant} {name}"


@dataclass(frozen=True, slots=True)
class Notes:
    """What a device's notes say: quarantined records, and per stored namespace where its purge mark lies (the
    latest one), plus the lines that did not parse."""

    quarantined: frozenset[tuple[int, int]]  # (seq, offset)
    purged: dict[tuple[int, str], tuple[int, int]]  # (tenant, stored name) -> (seq, offset)
    unparsed: tuple[str, ...] = ()


def parse_notes(lines: Sequence[str]) -> Notes:
    quarantined: set[tuple[int, int]] = set()
    purged: dict[tuple[int, str], tuple[int, int]] = {}
    unparsed: list[str] = []
    for line in lines:
        parts = line.split(" ")
        try:
            if parts[0] == "quarantine" and len(parts) == 4:
                quarantined.add((int(parts[1]), int(parts[2])))
            elif parts[0] == "purge" and len(parts) == 5:
                name = (int(parts[3]), parts[4])
                purged[name] = max(purged.get(name, (0, 0)), (int(parts[1]), int(parts[2])))
        except ValueError:
            unparsed.append(line)
    return Notes(frozenset(quarantined), purged, tuple(unparsed))
