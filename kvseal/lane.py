"""The local lane: Query, Release, Save and Load as binary frames on a local unix socket.

Why: a unary gRPC call costs 0.4-2 ms in Python on these machines before the engine does any work (measured in
`kvseal bench engine`): most of a scheduler step's budget for a query, and as much as the copy itself for a Save
or Load of a few MiB. This lane is a length-prefixed binary protocol on a unix socket (mode 0600, so only the
engine's user can connect), served by one engine thread per connection, with the same validation and the same
engine calls as the gRPC service. The socket path is announced by the `Info` RPC; clients fall back to gRPC when
it is absent or unreachable, or when a request cannot be framed here (hashes of unequal lengths, block ids past
32 bits): the engine's answer to those comes from gRPC, unchanged.

Frames (little endian), one request then one response at a time per connection:

    request  = u32 body_len | u8 op | body
      every body starts with   u16 id_len | instance_id (utf-8)
      op 1 QUERY    ... | u32 lease_ttl_ms | hashes
      op 2 RELEASE  ... | u64 lease_id
      op 3 SAVE     ... | u32 tp_rank | u32 pp_rank | hashes | n x u32 block_id
      op 4 LOAD     ... | u32 tp_rank | u32 pp_rank | u64 lease_id | hashes | n x u32 block_id
      hashes      = u32 n | u8 hash_len | n x hash_len bytes        (one length for every hash of a request)
    response = u32 body_len | u8 code | body          code: 0 = OK, else a grpc.StatusCode value
      OK QUERY      u32 hits | u64 lease_id | u32 lease_ttl_ms | u16 ns_len | namespace_final
      OK RELEASE    (empty)
      OK SAVE       u32 written | u32 skipped | u32 not_stored | u32 completed | u16 ns_len | namespace_final
      OK LOAD       u8 outcome (1 loaded, 2 missing, 3 refused) | u32 loaded | u16 len | reason | u16 len | message
      error         utf-8 message
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvseal.errors import InvalidArgument

OP_QUERY, OP_RELEASE, OP_SAVE, OP_LOAD = 1, 2, 3, 4
OP_NAMES = {OP_QUERY: "Query", OP_RELEASE: "Release", OP_SAVE: "Save", OP_LOAD: "Load"}
OUTCOMES = {"loaded": 1, "missing": 2, "refused": 3}  # the values of kvseal.v1.LoadResponse.Outcome
MAX_FRAME = 64 << 20
STATUS_CODES = {  # grpc.StatusCode values, without importing grpc
    "OK": 0,
    "INVALID_ARGUMENT": 3,
    "DEADLINE_EXCEEDED": 4,
    "NOT_FOUND": 5,
    "RESOURCE_EXHAUSTED": 8,
    "FAILED_PRECONDITION": 9,
    "INTERNAL": 13,
    "UNAVAILABLE": 14,
    "UNAUTHENTICATED": 16,
}
STATUS_NAMES = {v: k for k, v in STATUS_CODES.items()}

_HEADER = struct.Struct("<IB")
_COUNT = struct.Struct("<IB")  # n, hash_len
_RANKS = struct.Struct("<II")  # tp_rank, pp_rank
_QUERY_OK = struct.Struct("<IQIH")
_SAVE_OK = struct.Struct("<IIIIH")
_LOAD_OK = struct.Struct("<BIH")
_BLOCK_ID = np.dtype("<u4")


class Unframeable(ValueError):
    """The request cannot be carried by the lane (the client sends it over gRPC instead)."""


@dataclass(frozen=True, slots=True)
class QueryRequest:
    instance_id: str
    lease_ttl_ms: int
    hashes: list[bytes]


@dataclass(frozen=True, slots=True)
class ReleaseRequest:
    instance_id: str
    lease_id: int


@dataclass(frozen=True, slots=True)
class SaveRequest:
    worker: tuple[str, int, int]
    hashes: list[bytes]
    block_ids: list[int]


@dataclass(frozen=True, slots=True)
class LoadRequest:
    worker: tuple[str, int, int]
    lease_id: int
    hashes: list[bytes]
    block_ids: list[int]


Request = QueryRequest | ReleaseRequest | SaveRequest | LoadRequest

# ---------------------------------------------------------------------------------------------- encoding


def encode_query(instance_id: str, hashes: Sequence[bytes], lease_ttl_ms: int = 0) -> bytes:
    return _frame(OP_QUERY, _ident(instance_id) + _pack("<I", lease_ttl_ms) + _hashes(hashes))


def encode_release(instance_id: str, lease_id: int) -> bytes:
    return _frame(OP_RELEASE, _ident(instance_id) + _pack("<Q", lease_id))


def encode_save(worker: tuple[str, int, int], hashes: Sequence[bytes], block_ids: Sequence[int]) -> bytes:
    head = _ident(worker[0]) + _pack("<II", worker[1], worker[2])
    return _frame(OP_SAVE, head + _hashes(hashes) + _block_ids(block_ids, len(hashes)))


def encode_load(
    worker: tuple[str, int, int], hashes: Sequence[bytes], block_ids: Sequence[int], lease_id: int = 0
) -> bytes:
    head = _ident(worker[0]) + _pack("<IIQ", worker[1], worker[2], lease_id)
    return _frame(OP_LOAD, head + _hashes(hashes) + _block_ids(block_ids, len(hashes)))


def _frame(op_or_code: int, body: bytes) -> bytes:
    return _HEADER.pack(len(body), op_or_code) + body


def _ident(instance_id: str) -> bytes:
    ident = instance_id.encode()
    if len(ident) > 0xFFFF:
        raise Unframeable("instance_id is longer than 65535 bytes")
    return struct.pack("<H", len(ident)) + ident


def _pack(fmt: str, *values: int) -> bytes:
    try:
        return struct.pack(fmt, *values)
    except struct.error:  # out of the field's range: gRPC answers with its own error
        raise Unframeable(f"{values} do not fit {fmt}") from None


def _hashes(hashes: Sequence[bytes]) -> bytes:
    if not hashes:
        return _COUNT.pack(0, 0)
    lengths = set(map(len, hashes))
    size = lengths.pop()
    if lengths or not 0 < size < 256:
        raise Unframeable("the lane carries hashes of one length, 1..255 bytes")
    return _COUNT.pack(len(hashes), size) + b"".join(hashes)


def _block_ids(block_ids: Sequence[int], n: int) -> bytes:
    if len(block_ids) != n:
        raise Unframeable("block_ids and block_hashes differ in length")  # the engine's error comes from gRPC
    try:
        ids = array("I", block_ids)  # C unsigned int: 32 bits on every platform kvseal runs on
    except (OverflowError, TypeError):
        raise Unframeable("a block id does not fit 32 bits") from None
    if sys.byteorder != "little":
        ids.byteswap()
    return ids.tobytes()


# ---------------------------------------------------------------------------------------------- decoding


def decode_request(op: int, body: bytes) -> Request:
    """Raises InvalidArgument on anything malformed."""
    try:
        (id_len,) = struct.unpack_from("<H", body, 0)
        pos = 2 + id_len
        if pos > len(body):
            raise InvalidArgument("instance_id runs past the end of the frame")
        instance_id = body[2:pos].decode()
        if op == OP_RELEASE:
            (lease_id,) = struct.unpack_from("<Q", body, pos)
            _end(body, pos + 8, op)
            return ReleaseRequest(instance_id, lease_id)
        if op == OP_QUERY:
            (ttl,) = struct.unpack_from("<I", body, pos)
            hashes, pos = _read_hashes(body, pos + 4)
            _end(body, pos, op)
            return QueryRequest(instance_id, ttl, hashes)
        if op not in (OP_SAVE, OP_LOAD):
            raise InvalidArgument(f"unknown op {op}")
        tp_rank, pp_rank = _RANKS.unpack_from(body, pos)
        pos += _RANKS.size
        lease_id = 0
        if op == OP_LOAD:
            (lease_id,) = struct.unpack_from("<Q", body, pos)
            pos += 8
        hashes, pos = _read_hashes(body, pos)
        end = pos + 4 * len(hashes)
        if end > len(body):
            raise InvalidArgument("block_ids run past the end of the frame")
        block_ids = np.frombuffer(body, _BLOCK_ID, len(hashes), pos).tolist()
        _end(body, end, op)
        worker = (instance_id, tp_rank, pp_rank)
        if op == OP_SAVE:
            return SaveRequest(worker, hashes, block_ids)
        return LoadRequest(worker, lease_id, hashes, block_ids)
    except (struct.error, UnicodeDecodeError) as e:
        raise InvalidArgument(f"malformed frame: {e}") from None


def _read_hashes(body: bytes, pos: int) -> tuple[list[bytes], int]:
    n, size = _COUNT.unpack_from(body, pos)
    pos += _COUNT.size
    end = pos + n * size
    if n == 0:
        return [], pos
    if size == 0:
        raise InvalidArgument("block_hashes: hash_len is 0")
    if end > len(body):
        raise InvalidArgument(f"block_hashes: {n} hashes of {size} bytes run past the end of the frame")
    return [body[i : i + size] for i in range(pos, end, size)], end


def _end(body: bytes, pos: int, op: int) -> None:
    if pos != len(body):
        raise InvalidArgument(f"{OP_NAMES[op].upper()} frame has trailing bytes")


# ---------------------------------------------------------------------------------------------- responses


def encode_release_ok() -> bytes:
    return _frame(0, b"")


def encode_query_ok(hits: int, lease_id: int, lease_ttl_ms: int, namespace_final: str) -> bytes:
    ns = namespace_final.encode()
    return _frame(0, _QUERY_OK.pack(hits, lease_id, lease_ttl_ms, len(ns)) + ns)


def encode_save_ok(written: int, skipped: int, not_stored: int, completed: int, namespace_final: str) -> bytes:
    ns = namespace_final.encode()
    return _frame(0, _SAVE_OK.pack(written, skipped, not_stored, completed, len(ns)) + ns)


def encode_load_ok(outcome: str, loaded: int, reason: str, message: str) -> bytes:
    r, m = reason.encode()[:0xFFFF], message.encode()[:0xFFFF]
    return _frame(0, _LOAD_OK.pack(OUTCOMES[outcome], loaded, len(r)) + r + struct.pack("<H", len(m)) + m)


def encode_error(status: str, message: str) -> bytes:
    return _frame(STATUS_CODES.get(status, STATUS_CODES["INTERNAL"]), message.encode()[:4096])


def decode_query_ok(body: bytes) -> tuple[int, int, int, str]:
    hits, lease_id, ttl, ns_len = _QUERY_OK.unpack_from(body, 0)
    return hits, lease_id, ttl, body[_QUERY_OK.size : _QUERY_OK.size + ns_len].decode()


def decode_save_ok(body: bytes) -> tuple[int, int, int, int, str]:
    written, skipped, not_stored, completed, ns_len = _SAVE_OK.unpack_from(body, 0)
    return written, skipped, not_stored, completed, body[_SAVE_OK.size : _SAVE_OK.size + ns_len].decode()


def decode_load_ok(body: bytes) -> tuple[int, int, str, str]:
    """(outcome as the LoadResponse.Outcome value, loaded, reason, message)"""
    outcome, loaded, r_len = _LOAD_OK.unpack_from(body, 0)
    pos = _LOAD_OK.size
    reason = body[pos : pos + r_len].decode()
    (m_len,) = struct.unpack_from("<H", body, pos + r_len)
    pos += r_len + 2
    return outcome, loaded, reason, body[pos : pos + m_len].decode()


# ---------------------------------------------------------------------------------------------- sockets


def read_frame(sock, max_frame: int = MAX_FRAME) -> tuple[int, bytes] | None:  # type: ignore[no-untyped-def]
    """One frame from a blocking socket: (op or code, body), or None at a clean end of stream."""
    header = _recv_exact(sock, _HEADER.size)
    if header is None:
        return None
    length, op = _HEADER.unpack(header)
    if length > max_frame:
        raise InvalidArgument(f"frame of {length} bytes exceeds the {max_frame}-byte limit")
    body = _recv_exact(sock, length) if length else b""
    if body is None:
        raise ConnectionError("connection closed inside a frame")
    return op, body


def _recv_exact(sock, n: int) -> bytes | None:  # type: ignore[no-untyped-def]
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return None
            raise ConnectionError("connection closed inside a frame")
        got += k
    return bytes(buf)
