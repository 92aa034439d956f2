"""The peer-fetch protocol between two engines: frames on one TCP connection (little endian). Pure: no I/O.

A connection starts with a handshake that authenticates both ends, then carries fetches, one at a time:

    client -> HELLO    magic "KVPF" | u8 version | u8 plane | 16 B client nonce | u16 len | node_id
    server -> WELCOME  magic "KVPF" | u8 code | 16 B server nonce | 32 B server proof | u16 len | offer | u16 len | msg
    client -> PROOF    32 B client proof
    server -> READY    u8 code | u16 len | msg                (code 0: fetches may follow)
    (a handshake code other than 0 is a refusal: refusal_code / refusal_reason)

    With a shared token, proofs are HMAC-SHA256(token, role | client nonce | server nonce), role b"server" or
    b"client": each end shows it knows the token without sending it. Without one (loopback only), proofs are zero
    and each end checks who owns the other's socket (kvseal.auth) instead.
    `plane` names the data plane (PLANES); `offer` is what the fetcher needs to use it (empty for tcp).

    client -> FETCH    u32 body_len | body: u16 len | namespace_final | 32 B layout digest | u32 page_bytes
                       | u32 timeout_ms | u8 checksums | u32 n | u8 hash_len | n x hash_len bytes
    server -> ANSWER   u32 body_len | u8 code | body
      code OK:         u32 count | count x u64 remote offset
                       (count: the leading hashes the server holds and has pinned, 0..n)
                       then, on the tcp plane, count x page_bytes of page bytes
                       then, when checksums were asked for and count > 0:
                       SUMS  u32 body_len | count x u64 XXH3-64 of each page, computed while pinned (the server
                             hashes while it sends, the fetcher while it receives)
      code REFUSED:    u16 len | reason | u16 len | message        (reasons: REFUSALS)
    client -> DONE     u8 1    (pull planes only, after reading: the server unpins)

Everything a frame's header announces is checked against the limits before its body is read.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

from kvseal.errors import InvalidArgument
from kvseal.limits import MAX_BLOCKS_PER_REQUEST, MAX_HASH_BYTES

MAGIC = b"KVPF"
VERSION = 1
PLANES = {"tcp": 0, "mooncake": 1}
NONCE_BYTES = 16
PROOF_BYTES = 32
DIGEST_BYTES = 32
OK, REFUSED = 0, 1
REFUSALS = ("digest", "page_bytes", "auth", "version", "plane", "busy", "bad_request")
MAX_NAME = 1024
MAX_OFFER = 4096
MAX_MESSAGE = 4096
MAX_FETCH_BODY = 2 + 0xFFFF + DIGEST_BYTES + 13 + 1 + MAX_BLOCKS_PER_REQUEST * MAX_HASH_BYTES
MAX_ANSWER_BODY = 5 + MAX_BLOCKS_PER_REQUEST * 8

_HELLO = struct.Struct(f"<4sBB{NONCE_BYTES}sH")
_WELCOME = struct.Struct(f"<4sB{NONCE_BYTES}s{PROOF_BYTES}sH")
_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_FETCH_FIXED = struct.Struct(f"<{DIGEST_BYTES}sIIBIB")


class ProtocolError(InvalidArgument, ValueError):
    """The other end sent something this protocol does not allow."""


def refusal_code(reason: str) -> int:
    """A handshake frame's code for a refusal: 1 + its index in REFUSALS (0 is OK)."""
    return 1 + REFUSALS.index(reason)


def refusal_reason(code: int) -> str:
    return REFUSALS[code - 1] if 0 < code <= len(REFUSALS) else "bad_request"


def proof(token: str, role: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(token.encode(), role + client_nonce + server_nonce, hashlib.sha256).digest()


def proofs_match(token: str | None, role: bytes, client_nonce: bytes, server_nonce: bytes, got: bytes) -> bool:
    if token is None:
        return True  # no token: the socket owner is checked instead
    return hmac.compare_digest(proof(token, role, client_nonce, server_nonce), got)


def _text(value: str, limit: int, field: str) -> bytes:
    raw = value.encode()
    if len(raw) > limit:
        raise ProtocolError(f"{field} is {len(raw)} bytes, at most {limit}")
    return _U16.pack(len(raw)) + raw


def _read_text(body: memoryview, at: int, limit: int, field: str) -> tuple[str, int]:
    if at + 2 > len(body):
        raise ProtocolError(f"{field}: frame ends before its length")
    (n,) = _U16.unpack_from(body, at)
    if n > limit or at + 2 + n > len(body):
        raise ProtocolError(f"{field}: {n} bytes do not fit (limit {limit})")
    try:
        return bytes(body[at + 2 : at + 2 + n]).decode(), at + 2 + n
    except UnicodeDecodeError:
        raise ProtocolError(f"{field} is not utf-8") from None


# ---------------------------------------------------------------- handshake


def encode_hello(plane: str, nonce: bytes, node_id: str) -> bytes:
    raw = node_id.encode()
    if len(raw) > MAX_NAME:
        raise ProtocolError(f"node_id is {len(raw)} bytes, at most {MAX_NAME}")
    return _HELLO.pack(MAGIC, VERSION, PLANES[plane], nonce, len(raw)) + raw


HELLO_FIXED = _HELLO.size


def decode_hello_fixed(raw: bytes) -> tuple[int, int, bytes, int]:
    """(version, plane, client nonce, node_id length) from the fixed part of a HELLO."""
    magic, version, plane, nonce, n = _HELLO.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError("not a kvseal peer connection (bad magic)")
    if n > MAX_NAME:
        raise ProtocolError(f"node_id is {n} bytes, at most {MAX_NAME}")
    return version, plane, nonce, n


@dataclass(frozen=True, slots=True)
class Welcome:
    code: int
    nonce: bytes
    proof: bytes
    offer: bytes
    message: str


def encode_welcome(code: int, nonce: bytes, server_proof: bytes, offer: bytes, message: str = "") -> bytes:
    if len(offer) > MAX_OFFER:
        raise ProtocolError(f"offer is {len(offer)} bytes, at most {MAX_OFFER}")
    return _WELCOME.pack(MAGIC, code, nonce, server_proof, len(offer)) + offer + _text(message, MAX_MESSAGE, "message")


WELCOME_FIXED = _WELCOME.size


def decode_welcome_fixed(raw: bytes) -> tuple[int, bytes, bytes, int]:
    magic, code, nonce, server_proof, offer_len = _WELCOME.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError("the other end is not a kvseal engine (bad magic)")
    if offer_len > MAX_OFFER:
        raise ProtocolError(f"offer is {offer_len} bytes, at most {MAX_OFFER}")
    return code, nonce, server_proof, offer_len


def encode_ready(code: int, message: str = "") -> bytes:
    return _U8.pack(code) + _text(message, MAX_MESSAGE, "message")


# ---------------------------------------------------------------- fetch


@dataclass(frozen=True, slots=True)
class Fetch:
    namespace_final: str
    digest: bytes
    page_bytes: int
    timeout_ms: int
    checksums: bool
    hashes: list[bytes]


def encode_fetch(f: Fetch) -> bytes:
    lengths = {len(h) for h in f.hashes}
    if len(lengths) > 1:
        raise ProtocolError("every hash of one fetch has one length")
    hash_len = lengths.pop() if lengths else 0
    body = b"".join(
        (
            _text(f.namespace_final, MAX_NAME, "namespace_final"),
            _FETCH_FIXED.pack(f.digest, f.page_bytes, f.timeout_ms, f.checksums, len(f.hashes), hash_len),
            *f.hashes,
        )
    )
    return _U32.pack(len(body)) + body


def decode_fetch(body: bytes | memoryview) -> Fetch:
    view = memoryview(body)
    namespace_final, at = _read_text(view, 0, MAX_NAME, "namespace_final")
    if at + _FETCH_FIXED.size > len(view):
        raise ProtocolError("fetch: frame ends inside its fixed fields")
    digest, page_bytes, timeout_ms, checksums, n, hash_len = _FETCH_FIXED.unpack_from(view, at)
    at += _FETCH_FIXED.size
    if n > MAX_BLOCKS_PER_REQUEST:
        raise ProtocolError(f"fetch: {n} hashes, at most {MAX_BLOCKS_PER_REQUEST}")
    if n and not 0 < hash_len <= MAX_HASH_BYTES:
        raise ProtocolError(f"fetch: hashes of {hash_len} bytes (1..{MAX_HASH_BYTES})")
    if at + n * hash_len != len(view):
        raise ProtocolError(f"fetch: {n} hashes of {hash_len} bytes do not match the frame's length")
    raw = bytes(view[at:])
    hashes = [raw[i : i + hash_len] for i in range(0, n * hash_len, hash_len)]
    return Fetch(namespace_final, digest, page_bytes, timeout_ms, bool(checksums), hashes)


def encode_answer(offsets: list[int]) -> bytes:
    n = len(offsets)
    body = _U8.pack(OK) + _U32.pack(n) + struct.pack(f"<{n}Q", *offsets)
    return _U32.pack(len(body)) + body


def encode_refusal(reason: str, message: str) -> bytes:
    assert reason in REFUSALS, reason
    body = _U8.pack(REFUSED) + _text(reason, 64, "reason") + _text(message, MAX_MESSAGE, "message")
    return _U32.pack(len(body)) + body


def decode_answer(body: bytes, requested: int) -> list[int] | tuple[str, str]:
    """The pinned pages' offsets, or (reason, message) of a refusal."""
    view = memoryview(body)
    if not view:
        raise ProtocolError("answer: empty frame")
    if view[0] == REFUSED:
        reason, at = _read_text(view, 1, 64, "reason")
        message, _ = _read_text(view, at, MAX_MESSAGE, "message")
        return reason, message
    if view[0] != OK or len(view) < 5:
        raise ProtocolError(f"answer: unknown code {view[0]}")
    (n,) = _U32.unpack_from(view, 1)
    if n > requested:
        raise ProtocolError(f"answer: {n} pages for {requested} hashes asked")
    if len(view) != 5 + 8 * n:
        raise ProtocolError(f"answer: {len(view)} bytes, {5 + 8 * n} expected for {n} pages")
    return list(struct.unpack_from(f"<{n}Q", view, 5))


def encode_sums(sums: list[int]) -> bytes:
    return _U32.pack(8 * len(sums)) + struct.pack(f"<{len(sums)}Q", *sums)


def decode_sums(body: bytes, count: int) -> list[int]:
    if len(body) != 8 * count:
        raise ProtocolError(f"checksums: {len(body)} bytes for {count} pages")
    return list(struct.unpack(f"<{count}Q", body))
