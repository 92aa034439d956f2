"""The local lane: every call a worker makes, as binary frames on a local unix socket.

Why a unix socket: a worker hands the engine its KV memory as file descriptors (SCM_RIGHTS), which only a unix
socket carries; the kernel tells the engine who the peer is (SO_PEERCRED: pid, uid); and a unary gRPC call costs
0.4-2 ms in Python on these machines before the engine does any work, as much as the copy itself for a Save or
Load of a few MiB. The lane connection is also the worker's *session*: what a connection registered belongs to it,
no other connection may save, load or unregister it, and it is dropped when the connection closes (exit, crash,
deadline). The socket path is announced by the `Info` RPC. Query and Release also exist on gRPC; a query the lane
cannot frame (hashes of unequal lengths) goes there.

Frames (little endian), one request then one response at a time per connection:

    request  = u32 body_len | u8 op | body          body_len <= the op's limit (FRAME_LIMITS), checked on the header
      op 5 HELLO       u16 token_len | token          first frame when the engine has a token, else optional
      op 6 REGISTER    a serialized kvseal.v1.RegisterRequest; the memfds travel as SCM_RIGHTS with the frame's
                       first byte, and each ShmHandle.fd is an index into them
      every other body starts with   u16 id_len | instance_id (utf-8)
      op 1 QUERY       ... | u32 lease_ttl_ms | u16 rid_len | request_id | hashes [| u32 limit_tokens]
                       (limit_tokens: the longest hit wanted, in tokens; sent only when nonzero, absent reads 0)
      op 2 RELEASE     ... | u64 lease_id
      op 3 SAVE        ... | u32 tp_rank | u32 pp_rank | hashes | n x u32 block_id
      op 4 LOAD        ... | u32 tp_rank | u32 pp_rank | u64 lease_id | hashes | n x u32 block_id
      op 7 UNREGISTER  ... | u32 tp_rank | u32 pp_rank
      op 8 SAVE_GROUPS ... | u32 tp_rank | u32 pp_rank | u8 n_runs | n_runs x run
      op 9 LOAD_GROUPS ... | u32 tp_rank | u32 pp_rank | u64 lease_id | u8 n_runs | n_runs x run
      op 10 PING       any bytes, up to a Query's limit, answered OK and empty without being read: the lane's
                       no-op round trip (a liveness check; `kvseal bench ops` measures the lane's floor with it)
      hashes        = u32 n | u8 hash_len | n x hash_len bytes        (one length for every hash of a request;
                                                                        in SAVE_GROUPS and LOAD_GROUPS, of a run)
      run           = u8 group | hashes | u8 n_tables | n_tables x n x u32 block_id
                      (one KV cache group's blocks, for hybrid models: 1..255 block tables, table-major, all n ids
                      of table 0 first; over all runs, at most MAX_BLOCKS_PER_REQUEST hashes and as many block ids)
    response = u32 body_len | u8 code | body          code: 0 = OK, else a grpc.StatusCode value
      OK HELLO         (empty)
      OK REGISTER      a serialized kvseal.v1.InstanceStatus
      OK QUERY         u32 hits | u64 lease_id | u32 lease_ttl_ms | u8 loading | u16 ns_len | namespace_final
                       (loading: the engine is reading more of the prefix from SSD; ask again, hits is 0)
      OK RELEASE       (empty)
      OK SAVE          u32 written | u32 skipped | u32 not_stored | u32 completed | u16 ns_len | namespace_final
      OK LOAD          u8 outcome (1 loaded, 2 missing, 3 refused) | u32 loaded | u16 len | reason | u16 len | message
      OK UNREGISTER    u32 remaining_workers
      OK SAVE_GROUPS   as OK SAVE
      OK LOAD_GROUPS   as OK LOAD
      OK PING          (empty)
      error            utf-8 message
"""

from __future__ import annotations

import re
import struct
import sys
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from kvseal.errors import STATUSES, InvalidArgument
from kvseal.limits import (
    MAX_BLOCKS_PER_REQUEST,
    MAX_HASH_BYTES,
    MAX_INSTANCE_ID_CHARS,
    MAX_LAYERS,
    MAX_REGISTER_BYTES,
    MAX_REQUEST_ID_CHARS,
    MAX_TOKEN_BYTES,
    check_length,
)
from kvseal.sockets import StreamClosed, recv_exact

OP_QUERY, OP_RELEASE, OP_SAVE, OP_LOAD, OP_HELLO, OP_REGISTER, OP_UNREGISTER = 1, 2, 3, 4, 5, 6, 7
OP_SAVE_GROUPS, OP_LOAD_GROUPS, OP_PING = 8, 9, 10
OP_NAMES = {
    OP_QUERY: "Query",
    OP_RELEASE: "Release",
    OP_SAVE: "Save",
    OP_LOAD: "Load",
    OP_HELLO: "Hello",
    OP_REGISTER: "Register",
    OP_UNREGISTER: "Unregister",
    OP_SAVE_GROUPS: "SaveGroups",
    OP_LOAD_GROUPS: "LoadGroups",
    OP_PING: "Ping",
}
OUTCOMES = {"loaded": 1, "missing": 2, "refused": 3}  # the values of kvseal.v1.LoadResponse.Outcome
_BLOCKS_FRAME = 64 + 0xFFFF + MAX_BLOCKS_PER_REQUEST * (MAX_HASH_BYTES + 4)  # the largest valid Query/Save/Load
_RUN_HEAD = 7  # a run's bytes besides its hashes and block ids: u8 group, u32 n, u8 hash_len, u8 n_tables
_GROUPS_FRAME = _BLOCKS_FRAME + 255 * _RUN_HEAD  # the largest valid SaveGroups/LoadGroups (decoding checks the caps)
FRAME_LIMITS = {  # bytes of body per op: a header announcing more is refused before any body is read
    OP_QUERY: _BLOCKS_FRAME,
    OP_SAVE: _BLOCKS_FRAME,
    OP_LOAD: _BLOCKS_FRAME,
    OP_SAVE_GROUPS: _GROUPS_FRAME,
    OP_LOAD_GROUPS: _GROUPS_FRAME,
    OP_PING: _BLOCKS_FRAME,
    OP_RELEASE: 0xFFFF + 16,
    OP_UNREGISTER: 0xFFFF + 16,
    OP_HELLO: 0xFFFF + 2,
    OP_REGISTER: MAX_REGISTER_BYTES,
}
MAX_FRAME = max(FRAME_LIMITS.values())
MAX_FDS = 253  # SCM_MAX_FD: descriptors one Register may carry (one per separate KV allocation)
STATUS_CODES = {s.name: s.code for s in STATUSES.values()}  # kvseal.errors' table: grpc.StatusCode values
STATUS_NAMES = {v: k for k, v in STATUS_CODES.items()}

_HEADER = struct.Struct("<IB")
_COUNT = struct.Struct("<IB")  # n, hash_len
_RANKS = struct.Struct("<II")  # tp_rank, pp_rank
_QUERY_OK = struct.Struct("<IQIBH")
_SAVE_OK = struct.Struct("<IIIIH")
_LOAD_OK = struct.Struct("<BIH")
_BLOCK_ID = np.dtype("<u4")


class HashArray(Sequence[bytes]):
    """A request's block hashes as the frame carries them: n hashes of `size` bytes back to back in `buffer` from
    `offset`, with no bytes object per hash until one is asked for (an item, iteration, tolist). A slice with step
    1 is another view of the same buffer. The native index (kvseal.core._table.Index) reads the buffer itself."""

    __slots__ = ("buffer", "offset", "size", "n")

    def __init__(self, buffer: bytes, offset: int, size: int, n: int) -> None:
        self.buffer, self.offset, self.size, self.n = buffer, offset, size, n

    def __len__(self) -> int:
        return self.n

    @overload
    def __getitem__(self, i: int) -> bytes: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[bytes]: ...

    def __getitem__(self, i: int | slice) -> bytes | Sequence[bytes]:
        if isinstance(i, slice):
            start, stop, step = i.indices(self.n)
            if step != 1:
                return self.tolist()[i]
            return HashArray(self.buffer, self.offset + start * self.size, self.size, max(0, stop - start))
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError("hash index out of range")
        at = self.offset + i * self.size
        return self.buffer[at : at + self.size]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.tolist())

    def tolist(self) -> list[bytes]:
        if not self.n:
            return []
        out: list[bytes] = np.frombuffer(self.buffer, f"V{self.size}", self.n, self.offset).tolist()  # in one call
        return out

    def __eq__(self, other: object) -> bool:
        if isinstance(other, HashArray | list | tuple):
            return self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"HashArray({self.tolist()!r})"


class Unframeable(InvalidArgument, ValueError):
    """The request cannot be carried by the lane (the client sends it over gRPC instead)."""


@dataclass(frozen=True, slots=True)
class QueryRequest:
    instance_id: str
    lease_ttl_ms: int
    hashes: Sequence[bytes]
    request_id: str = ""
    limit_tokens: int = 0  # the longest hit wanted, in tokens (0: every hash)


@dataclass(frozen=True, slots=True)
class ReleaseRequest:
    instance_id: str
    lease_id: int


@dataclass(frozen=True, slots=True)
class SaveRequest:
    worker: tuple[str, int, int]
    hashes: Sequence[bytes]
    block_ids: list[int]


@dataclass(frozen=True, slots=True)
class LoadRequest:
    worker: tuple[str, int, int]
    lease_id: int
    hashes: Sequence[bytes]
    block_ids: list[int]


@dataclass(frozen=True, slots=True)
class BlockRun:
    """The blocks of one KV cache group in a SaveGroups or LoadGroups: `block_ids[t]` holds block table t's ids,
    one per hash (a group may keep several block tables, each copied block by block)."""

    group: int
    hashes: Sequence[bytes]
    block_ids: list[list[int]]


@dataclass(frozen=True, slots=True)
class SaveGroupsRequest:
    worker: tuple[str, int, int]
    runs: list[BlockRun]


@dataclass(frozen=True, slots=True)
class LoadGroupsRequest:
    worker: tuple[str, int, int]
    lease_id: int
    runs: list[BlockRun]


@dataclass(frozen=True, slots=True)
class UnregisterRequest:
    worker: tuple[str, int, int]


@dataclass(frozen=True, slots=True)
class HelloRequest:
    token: str


@dataclass(frozen=True, slots=True)
class PingRequest:
    pass


@dataclass(frozen=True, slots=True)
class RegisterRequest:
    """The serialized kvseal.v1.RegisterRequest (decoded by the server, after count_layers)."""

    body: bytes


PING = PingRequest()

Request = (
    QueryRequest
    | ReleaseRequest
    | SaveRequest
    | LoadRequest
    | SaveGroupsRequest
    | LoadGroupsRequest
    | UnregisterRequest
    | HelloRequest
    | PingRequest
    | RegisterRequest
)

# ---------------------------------------------------------------------------------------------- encoding


def encode_query(
    instance_id: str, hashes: Sequence[bytes], lease_ttl_ms: int = 0, request_id: str = "", limit_tokens: int = 0
) -> bytes:
    rid = request_id.encode()
    if len(rid) > 0xFFFF:
        raise Unframeable("request_id is longer than 65535 bytes")
    body = _ident(instance_id) + _pack("<IH", lease_ttl_ms, len(rid)) + rid + _hashes(hashes)
    if limit_tokens:
        body += _pack("<I", limit_tokens)
    return _frame(OP_QUERY, body)


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


def encode_save_groups(worker: tuple[str, int, int], runs: Sequence[BlockRun]) -> bytes:
    head = _ident(worker[0]) + _pack("<II", worker[1], worker[2])
    return _frame(OP_SAVE_GROUPS, head + _runs(runs))


def encode_load_groups(worker: tuple[str, int, int], runs: Sequence[BlockRun], lease_id: int = 0) -> bytes:
    head = _ident(worker[0]) + _pack("<IIQ", worker[1], worker[2], lease_id)
    return _frame(OP_LOAD_GROUPS, head + _runs(runs))


def encode_unregister(worker: tuple[str, int, int]) -> bytes:
    return _frame(OP_UNREGISTER, _ident(worker[0]) + _pack("<II", worker[1], worker[2]))


def encode_hello(token: str) -> bytes:
    raw = token.encode()
    if len(raw) > 0xFFFF:
        raise Unframeable("the token is longer than 65535 bytes")
    return _frame(OP_HELLO, struct.pack("<H", len(raw)) + raw)


def encode_ping(payload: bytes = b"") -> bytes:
    if len(payload) > FRAME_LIMITS[OP_PING]:
        raise InvalidArgument(f"a ping carries at most {FRAME_LIMITS[OP_PING]} bytes, not {len(payload)}")
    return _frame(OP_PING, payload)


def encode_register(request_bytes: bytes) -> bytes:
    if len(request_bytes) > MAX_REGISTER_BYTES:
        raise InvalidArgument(f"the registration is {len(request_bytes)} bytes; at most {MAX_REGISTER_BYTES}")
    return _frame(OP_REGISTER, request_bytes)


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


def _runs(runs: Sequence[BlockRun]) -> bytes:
    if len(runs) > 255:
        raise Unframeable(f"the lane carries at most 255 runs, not {len(runs)}")
    parts = [struct.pack("<B", len(runs))]
    for i, run in enumerate(runs):
        if not 0 < len(run.block_ids) < 256:
            raise Unframeable(f"runs[{i}] has {len(run.block_ids)} block tables; the lane carries 1..255")
        parts += [_pack("<B", run.group), _hashes(run.hashes), struct.pack("<B", len(run.block_ids))]
        parts += [_block_ids(ids, len(run.hashes), f"runs[{i}].block_ids[{t}]") for t, ids in enumerate(run.block_ids)]
    return b"".join(parts)


def _block_ids(block_ids: Sequence[int], n: int, field: str = "block_ids") -> bytes:
    if len(block_ids) != n:
        raise Unframeable(f"{field} and block_hashes differ in length")  # the engine's error comes from gRPC
    try:
        ids = array("I", block_ids)  # C unsigned int: 32 bits on every platform kvseal runs on
    except (OverflowError, TypeError):
        raise Unframeable("a block id does not fit 32 bits") from None
    if sys.byteorder != "little":
        ids.byteswap()
    return ids.tobytes()


# ---------------------------------------------------------------------------------------------- decoding


def decode_request(op: int, body: bytes) -> Request:
    """Raises InvalidArgument on anything malformed, or longer than its limit (kvseal.limits), naming the field."""
    if op == OP_REGISTER:
        count_layers(body)
        return RegisterRequest(body)
    if op == OP_PING:
        return PING
    try:
        if op == OP_HELLO:
            (n,) = struct.unpack_from("<H", body, 0)
            _end(body, 2 + n, op)
            check_length("token", body[2:], MAX_TOKEN_BYTES)
            return HelloRequest(body[2:].decode())
        (id_len,) = struct.unpack_from("<H", body, 0)
        pos = 2 + id_len
        if pos > len(body):
            raise InvalidArgument("instance_id runs past the end of the frame")
        check_length("instance_id", body[2:pos], MAX_INSTANCE_ID_CHARS)  # utf-8 bytes: at least its characters
        instance_id = body[2:pos].decode()
        if op == OP_RELEASE:
            (lease_id,) = struct.unpack_from("<Q", body, pos)
            _end(body, pos + 8, op)
            return ReleaseRequest(instance_id, lease_id)
        if op == OP_QUERY:
            ttl, rid_len = struct.unpack_from("<IH", body, pos)
            pos += 6
            if pos + rid_len > len(body):
                raise InvalidArgument("request_id runs past the end of the frame")
            check_length("request_id", body[pos : pos + rid_len], MAX_REQUEST_ID_CHARS)
            request_id = body[pos : pos + rid_len].decode()
            hashes, pos = _read_hashes(body, pos + rid_len)
            limit_tokens = 0
            if len(body) - pos == 4:  # the optional limit; any other length is trailing bytes
                (limit_tokens,) = struct.unpack_from("<I", body, pos)
                pos += 4
            _end(body, pos, op)
            return QueryRequest(instance_id, ttl, hashes, request_id, limit_tokens)
        if op not in (OP_SAVE, OP_LOAD, OP_UNREGISTER, OP_SAVE_GROUPS, OP_LOAD_GROUPS):
            raise InvalidArgument(f"unknown op {op}")
        tp_rank, pp_rank = _RANKS.unpack_from(body, pos)
        pos += _RANKS.size
        if op == OP_UNREGISTER:
            _end(body, pos, op)
            return UnregisterRequest((instance_id, tp_rank, pp_rank))
        worker = (instance_id, tp_rank, pp_rank)
        lease_id = 0
        if op in (OP_LOAD, OP_LOAD_GROUPS):
            (lease_id,) = struct.unpack_from("<Q", body, pos)
            pos += 8
        if op in (OP_SAVE_GROUPS, OP_LOAD_GROUPS):
            runs, pos = _read_runs(body, pos)
            _end(body, pos, op)
            if op == OP_SAVE_GROUPS:
                return SaveGroupsRequest(worker, runs)
            return LoadGroupsRequest(worker, lease_id, runs)
        hashes, pos = _read_hashes(body, pos)
        end = pos + 4 * len(hashes)
        if end > len(body):
            raise InvalidArgument("block_ids run past the end of the frame")
        block_ids = np.frombuffer(body, _BLOCK_ID, len(hashes), pos).tolist()
        _end(body, end, op)
        if op == OP_SAVE:
            return SaveRequest(worker, hashes, block_ids)
        return LoadRequest(worker, lease_id, hashes, block_ids)
    except (struct.error, UnicodeDecodeError) as e:
        raise InvalidArgument(f"malformed frame: {e}") from None


def count_layers(body: bytes) -> int:
    """The number of layers (field 8) in a serialized RegisterRequest, read from the wire format without decoding
    it, so that an oversized registration is refused before protobuf builds a million messages."""
    pos, layers, end = 0, 0, len(body)
    try:
        while pos < end:
            key, pos = _varint(body, pos)
            field, wire = key >> 3, key & 7
            if wire == 0:
                _, pos = _varint(body, pos)
            elif wire == 2:
                n, pos = _varint(body, pos)
                pos += n
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            else:
                raise InvalidArgument(f"RegisterRequest: wire type {wire} of field {field} is not valid here")
            if field == 8:
                layers += 1
                if layers > MAX_LAYERS:
                    raise InvalidArgument(f"layers: at most {MAX_LAYERS} layers per worker")
        if pos != end:
            raise InvalidArgument("RegisterRequest: the last field runs past the end of the frame")
    except IndexError:
        raise InvalidArgument("RegisterRequest: truncated varint") from None
    return layers


def _varint(body: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = body[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise InvalidArgument("RegisterRequest: varint longer than 10 bytes")


def _read_runs(body: bytes, pos: int) -> tuple[list[BlockRun], int]:
    """The runs of a SaveGroups or LoadGroups, from u8 n_runs on; the caps on hashes and block ids hold over all
    runs together, and are checked before the bytes they announce are read."""
    (n_runs,) = struct.unpack_from("<B", body, pos)
    pos += 1
    runs: list[BlockRun] = []
    total_hashes = total_ids = 0
    for i in range(n_runs):
        (group,) = struct.unpack_from("<B", body, pos)
        hashes, pos = _read_hashes(body, pos + 1, total_hashes)
        n = len(hashes)
        total_hashes += n
        (n_tables,) = struct.unpack_from("<B", body, pos)
        pos += 1
        if n_tables == 0:
            raise InvalidArgument(f"runs[{i}].n_tables is 0; a run has 1..255 block tables")
        total_ids += n * n_tables
        if total_ids > MAX_BLOCKS_PER_REQUEST:
            raise InvalidArgument(f"block_ids has {total_ids} entries over all runs; at most {MAX_BLOCKS_PER_REQUEST}")
        end = pos + 4 * n * n_tables
        if end > len(body):
            raise InvalidArgument(f"runs[{i}].block_ids run past the end of the frame")
        ids = np.frombuffer(body, _BLOCK_ID, n * n_tables, pos).reshape(n_tables, n).tolist()
        runs.append(BlockRun(group, hashes, ids))
        pos = end
    return runs, pos


def _read_hashes(body: bytes, pos: int, before: int = 0) -> tuple[Sequence[bytes], int]:
    """`before`: hashes the request carried before these (earlier runs), counted against the cap."""
    n, size = _COUNT.unpack_from(body, pos)
    pos += _COUNT.size
    end = pos + n * size
    if n == 0:
        return [], pos
    if before + n > MAX_BLOCKS_PER_REQUEST:
        over = " over all runs" if before else ""
        raise InvalidArgument(f"block_hashes has {before + n} entries{over}; at most {MAX_BLOCKS_PER_REQUEST}")
    if size == 0:
        raise InvalidArgument("block_hashes: hash_len is 0")
    if end > len(body):
        raise InvalidArgument(f"block_hashes: {n} hashes of {size} bytes run past the end of the frame")
    return HashArray(body, pos, size, n), end


def _end(body: bytes, pos: int, op: int) -> None:
    if pos != len(body):
        name = re.sub(r"(?<=[a-z])(?=[A-Z])", "_", OP_NAMES[op]).upper()  # as the module docstring: SAVE_GROUPS
        raise InvalidArgument(f"{name} frame has trailing bytes")


# ---------------------------------------------------------------------------------------------- responses


def encode_ok(body: bytes = b"") -> bytes:
    """HELLO, RELEASE (empty) and REGISTER (a serialized InstanceStatus) answers."""
    return _frame(0, body)


def encode_unregister_ok(remaining: int) -> bytes:
    return _frame(0, struct.pack("<I", remaining))


def encode_query_ok(hits: int, lease_id: int, lease_ttl_ms: int, namespace_final: str, loading: bool = False) -> bytes:
    ns = namespace_final.encode()
    return _frame(0, _QUERY_OK.pack(hits, lease_id, lease_ttl_ms, loading, len(ns)) + ns)


def encode_save_ok(written: int, skipped: int, not_stored: int, completed: int, namespace_final: str) -> bytes:
    ns = namespace_final.encode()
    return _frame(0, _SAVE_OK.pack(written, skipped, not_stored, completed, len(ns)) + ns)


def encode_load_ok(outcome: str, loaded: int, reason: str, message: str) -> bytes:
    r, m = reason.encode()[:0xFFFF], message.encode()[:0xFFFF]
    return _frame(0, _LOAD_OK.pack(OUTCOMES[outcome], loaded, len(r)) + r + struct.pack("<H", len(m)) + m)


MAX_ERROR_BYTES = 4096


def encode_error(status: str, message: str) -> bytes:
    """An error frame; a message past MAX_ERROR_BYTES is cut at a character boundary (it stays valid UTF-8)."""
    body = message.encode()[:MAX_ERROR_BYTES].decode(errors="ignore").encode()
    return _frame(STATUS_CODES.get(status, STATUS_CODES["INTERNAL"]), body)


def decode_query_ok(body: bytes) -> tuple[int, int, int, str, bool]:
    """hits, lease_id, lease_ttl_ms, namespace_final, loading."""
    hits, lease_id, ttl, loading, ns_len = _QUERY_OK.unpack_from(body, 0)
    return hits, lease_id, ttl, body[_QUERY_OK.size : _QUERY_OK.size + ns_len].decode(), bool(loading)


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


class FrameBuffer:
    """Assembles frames from bytes as they arrive (the server reads without blocking). Memory grows with what the
    peer actually sent, never with what a header announces; a header over its op's limit is refused at once."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def __len__(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes) -> None:
        self._buf += data

    def next_frame(self) -> tuple[int, bytes] | None:
        """The next complete (op, body), or None until more bytes arrive. Raises InvalidArgument for an unknown op
        or a body over the op's limit."""
        if len(self._buf) < _HEADER.size:
            return None
        length, op = _HEADER.unpack_from(self._buf, 0)
        limit = FRAME_LIMITS.get(op)
        if limit is None:
            raise InvalidArgument(f"unknown op {op}")
        if length > limit:
            raise InvalidArgument(f"{OP_NAMES[op]} frame of {length} bytes exceeds its {limit}-byte limit")
        end = _HEADER.size + length
        if len(self._buf) < end:
            return None
        body = bytes(self._buf[_HEADER.size : end])
        del self._buf[:end]
        return op, body


def read_frame(sock, max_frame: int = MAX_FRAME) -> tuple[int, bytes] | None:  # type: ignore[no-untyped-def]
    """One frame from a blocking socket: (op or code, body), or None at a clean end of stream."""
    try:
        length, op = _HEADER.unpack(recv_exact(sock, _HEADER.size))
    except StreamClosed:
        return None
    if length > max_frame:
        raise InvalidArgument(f"frame of {length} bytes exceeds the {max_frame}-byte limit")
    return op, recv_exact(sock, length) if length else b""
