"""The query lane: Query and Release over a local unix socket, for the scheduler's per-step prefix lookups.

Why: a unary gRPC call costs 0.4-0.7 ms in Python on these machines before the engine does any work (measured in
`kvseal bench engine`), which is most of a scheduler step's budget. This lane is a length-prefixed binary protocol
on a unix socket (mode 0600, so only the engine's user can connect), served by one engine thread per
connection, with the same validation and the same engine calls as the gRPC service. The socket path is
announced by the `Info` RPC; clients fall back to gRPC when it is absent or unreachable.

Frames (little endian), one request then one response at a time per connection:

    request  = u32 body_len | u8 op | body
      op 1 QUERY   body = u16 id_len | instance_id | u32 lease_ttl_ms | u32 n | n x (u8 hash_len | hash)
      op 2 RELEASE body = u16 id_len | instance_id | u64 lease_id
    response = u32 body_len | u8 code | body          code: 0 = OK, else a grpc.StatusCode value
      OK QUERY     body = u32 hits | u64 lease_id | u32 lease_ttl_ms | u16 ns_len | namespace_final
      OK RELEASE   body = (empty)
      error        body = utf-8 message
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvseal.errors import InvalidArgument

OP_QUERY = 1
OP_RELEASE = 2
MAX_FRAME = 16 << 20
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
_QUERY_OK = struct.Struct("<IQIH")


@dataclass(frozen=True, slots=True)
class QueryRequest:
    instance_id: str
    lease_ttl_ms: int
    hashes: list[bytes]


@dataclass(frozen=True, slots=True)
class ReleaseRequest:
    instance_id: str
    lease_id: int


def encode_query(instance_id: str, hashes: list[bytes], lease_ttl_ms: int = 0) -> bytes:
    ident = instance_id.encode()
    parts = [struct.pack("<H", len(ident)), ident, struct.pack("<II", lease_ttl_ms, len(hashes))]
    for h in hashes:
        if not 0 < len(h) < 256:
            raise InvalidArgument(f"block_hashes: a hash must be 1..255 bytes, got {len(h)}")
        parts.append(bytes((len(h),)))
        parts.append(h)
    return _frame(OP_QUERY, b"".join(parts))


def encode_release(instance_id: str, lease_id: int) -> bytes:
    ident = instance_id.encode()
    return _frame(OP_RELEASE, struct.pack("<H", len(ident)) + ident + struct.pack("<Q", lease_id))


def _frame(op_or_code: int, body: bytes) -> bytes:
    return _HEADER.pack(len(body), op_or_code) + body


def decode_request(op: int, body: bytes) -> QueryRequest | ReleaseRequest:
    """Raises InvalidArgument on anything malformed."""
    try:
        (id_len,) = struct.unpack_from("<H", body, 0)
        pos = 2 + id_len
        if pos > len(body):
            raise InvalidArgument("instance_id runs past the end of the frame")
        instance_id = body[2:pos].decode()
        if op == OP_RELEASE:
            (lease_id,) = struct.unpack_from("<Q", body, pos)
            if pos + 8 != len(body):
                raise InvalidArgument("RELEASE frame has trailing bytes")
            return ReleaseRequest(instance_id, lease_id)
        if op != OP_QUERY:
            raise InvalidArgument(f"unknown op {op}")
        ttl, n = struct.unpack_from("<II", body, pos)
        pos += 8
        hashes = []
        for _ in range(n):
            size = body[pos]
            end = pos + 1 + size
            if end > len(body) or size == 0:
                raise InvalidArgument(f"block_hashes[{len(hashes)}] is empty or runs past the end of the frame")
            hashes.append(body[pos + 1 : end])
            pos = end
        if pos != len(body):
            raise InvalidArgument("QUERY frame has trailing bytes")
        return QueryRequest(instance_id, ttl, hashes)
    except (struct.error, IndexError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"malformed frame: {e}") from None


def encode_release_ok() -> bytes:
    return _frame(0, b"")


def encode_query_ok(hits: int, lease_id: int, lease_ttl_ms: int, namespace_final: str) -> bytes:
    ns = namespace_final.encode()
    return _frame(0, _QUERY_OK.pack(hits, lease_id, lease_ttl_ms, len(ns)) + ns)


def encode_error(status: str, message: str) -> bytes:
    return _frame(STATUS_CODES.get(status, STATUS_CODES["INTERNAL"]), message.encode()[:4096])


def decode_query_ok(body: bytes) -> tuple[int, int, int, str]:
    hits, lease_id, ttl, ns_len = _QUERY_OK.unpack_from(body, 0)
    return hits, lease_id, ttl, body[_QUERY_OK.size : _QUERY_OK.size + ns_len].decode()


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
