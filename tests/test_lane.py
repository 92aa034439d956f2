"""The local lane (kvseal.wire.lane): its codec on any bytes, the frame assembler under any chunking, the wire-level
layer count of a registration, and a real engine serving the lane beside gRPC."""

from __future__ import annotations

import os
import socket
import stat
import struct
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import REPO
from hypothesis import example, given
from hypothesis import strategies as st

from kvseal.client import BlockRun
from kvseal.errors import InvalidArgument, NotFound
from kvseal.limits import MAX_BLOCKS_PER_REQUEST, MAX_LAYERS, MAX_REGISTER_BYTES
from kvseal.memfd import SharedArray
from kvseal.proto import kvseal_pb2 as pb
from kvseal.proto import kvseal_pb2_grpc as pb_grpc
from kvseal.testing import EngineProcess, free_port, register_one_rank, serve_command
from kvseal.wire import lane as fq

HASHES = [bytes([i]) * 32 for i in range(8)]
U32, U64 = 2**32 - 1, 2**64 - 1
REQUEST_TYPES = (
    fq.QueryRequest,
    fq.ReleaseRequest,
    fq.SaveRequest,
    fq.LoadRequest,
    fq.SaveGroupsRequest,
    fq.LoadGroupsRequest,
    fq.UnregisterRequest,
    fq.HelloRequest,
    fq.PingRequest,
    fq.RegisterRequest,
)

# -------------------------------------------------------------------- codec


@given(st.integers(0, 255), st.binary(max_size=300))
def test_decode_request_parses_or_raises_invalid_argument(op: int, body: bytes) -> None:
    try:
        request = fq.decode_request(op, body)
    except InvalidArgument:
        return
    assert isinstance(request, REQUEST_TYPES)
    if isinstance(request, fq.RegisterRequest):
        assert op == fq.OP_REGISTER and request.body == body


WORKER_KEYS = st.tuples(st.text(min_size=1, max_size=40), st.integers(0, U32), st.integers(0, U32))
SAME_LENGTH_HASHES = st.integers(1, 255).flatmap(
    lambda size: st.lists(st.binary(min_size=size, max_size=size), max_size=70)
)


def _decoded(frame: bytes) -> fq.Request:
    length, op = struct.unpack_from("<IB", frame)
    assert length == len(frame) - 5
    return fq.decode_request(op, frame[5:])


@given(WORKER_KEYS, SAME_LENGTH_HASHES, st.data())
def test_save_and_load_frames_round_trip(worker: tuple[str, int, int], hashes: list[bytes], data: Any) -> None:
    ids = data.draw(st.lists(st.integers(0, U32), min_size=len(hashes), max_size=len(hashes)))
    lease = data.draw(st.integers(0, U64))
    assert _decoded(fq.encode_save(worker, hashes, ids)) == fq.SaveRequest(worker, hashes, ids)
    assert _decoded(fq.encode_load(worker, hashes, ids, lease)) == fq.LoadRequest(worker, lease, hashes, ids)


@st.composite
def block_runs(draw: Any) -> list[BlockRun]:
    """0..4 runs of a hybrid model's groups: each its own hash length, 0..20 hashes, 1..3 block tables."""
    runs = []
    for _ in range(draw(st.integers(0, 4))):
        size = draw(st.integers(1, 40))
        hashes = draw(st.lists(st.binary(min_size=size, max_size=size), max_size=20))
        table = st.lists(st.integers(0, U32), min_size=len(hashes), max_size=len(hashes))
        tables = [draw(table) for _ in range(draw(st.integers(1, 3)))]
        runs.append(BlockRun(draw(st.integers(0, 255)), hashes, tables))
    return runs


@given(WORKER_KEYS, block_runs(), st.integers(0, U64))
def test_save_and_load_groups_frames_round_trip(worker: tuple[str, int, int], runs: list[BlockRun], lease: int) -> None:
    assert BlockRun is fq.BlockRun  # kvseal.client re-exports the lane's
    assert _decoded(fq.encode_save_groups(worker, runs)) == fq.SaveGroupsRequest(worker, runs)
    assert _decoded(fq.encode_load_groups(worker, runs, lease)) == fq.LoadGroupsRequest(worker, lease, runs)
    assert _decoded(fq.encode_load_groups(worker, runs)) == fq.LoadGroupsRequest(worker, 0, runs)


def test_groups_block_ids_are_table_major() -> None:
    """All n ids of table 0, then all n of table 1: the bytes the engine reads are the ones a worker wrote."""
    frame = fq.encode_save_groups(("A", 1, 2), [BlockRun(3, [b"x", b"y"], [[1, 2], [3, 4]])])
    run = struct.pack("<BIB", 3, 2, 1) + b"xy" + struct.pack("<B4I", 2, 1, 2, 3, 4)
    assert frame[5:] == struct.pack("<H", 1) + b"A" + struct.pack("<IIB", 1, 2, 1) + run
    assert frame[4] == fq.OP_SAVE_GROUPS and fq.OP_NAMES[fq.OP_SAVE_GROUPS] == "SaveGroups"
    assert fq.OP_NAMES[fq.OP_LOAD_GROUPS] == "LoadGroups"


def _groups_body(op: int, runs: bytes, n_runs: int = 1) -> bytes:
    """A SAVE_GROUPS or LOAD_GROUPS body by hand, for instance "A", ranks 0 and 0 (lease 7), around `runs`."""
    lease = struct.pack("<Q", 7) if op == fq.OP_LOAD_GROUPS else b""
    return struct.pack("<H", 1) + b"A" + struct.pack("<II", 0, 0) + lease + struct.pack("<B", n_runs) + runs


def _run(n: int, n_tables: int, *, ids: int | None = None, hash_len: int = 1) -> bytes:
    """A run by hand: n hashes, n_tables announced, and `ids` block ids present (n * n_tables when not given)."""
    count = n * n_tables if ids is None else ids
    return struct.pack("<BIB", 0, n, hash_len) + bytes(n * hash_len) + struct.pack("<B", n_tables) + bytes(4 * count)


HALF = MAX_BLOCKS_PER_REQUEST // 2


@pytest.mark.parametrize("op", [fq.OP_SAVE_GROUPS, fq.OP_LOAD_GROUPS])
@pytest.mark.parametrize(
    "runs, n_runs, message",
    [
        (_run(2, 0), 1, r"runs\[0\]\.n_tables is 0"),
        (_run(1, 1) + _run(1, 0), 2, r"runs\[1\]\.n_tables is 0"),
        (_run(0, 0), 1, r"runs\[0\]\.n_tables is 0"),  # even with no hashes
        (_run(3, 2, ids=5), 1, r"runs\[0\]\.block_ids run past the end"),
        (_run(1, 1) + _run(3, 1, ids=0), 2, r"runs\[1\]\.block_ids run past the end"),
        (_run(3, 1)[:-14], 1, "block_hashes: 3 hashes of 1 bytes run past the end"),  # cut inside the hashes
        (_run(3, 1)[:-13], 1, "malformed frame"),  # cut before n_tables
        (_run(1, 1), 2, "malformed frame"),  # a second run announced, not sent
        (b"", 1, "malformed frame"),
        (_run(1, 1) + b"x", 1, "GROUPS frame has trailing bytes"),
        (_run(1, 1), 0, "GROUPS frame has trailing bytes"),  # no runs announced, one sent
        (struct.pack("<BIB", 0, 3, 0) + struct.pack("<B", 1), 1, "block_hashes: hash_len is 0"),
        # the caps hold over all runs, checked before the bytes they announce are read
        (struct.pack("<BIB", 0, MAX_BLOCKS_PER_REQUEST + 1, 1), 1, f"block_hashes has {MAX_BLOCKS_PER_REQUEST + 1}"),
        (_run(MAX_BLOCKS_PER_REQUEST, 1) + struct.pack("<BIB", 0, 1, 1), 2, "block_hashes has .* over all runs"),
        (_run(HALF + 1, 2, ids=0), 1, f"block_ids has {MAX_BLOCKS_PER_REQUEST + 2} entries over all runs"),
        (_run(HALF, 1) + _run(HALF // 2 + 1, 2, ids=0), 2, "block_ids has .* over all runs"),
    ],
)
def test_malformed_groups_frames_are_invalid_argument_naming_the_field(
    op: int, runs: bytes, n_runs: int, message: str
) -> None:
    body = _groups_body(op, runs, n_runs)
    assert len(body) <= fq.FRAME_LIMITS[op]  # a header the lane accepts: the body's decoding refuses it
    with pytest.raises(InvalidArgument, match=message):
        fq.decode_request(op, body)


@pytest.mark.parametrize("op", [fq.OP_SAVE_GROUPS, fq.OP_LOAD_GROUPS])
def test_groups_frames_at_the_caps_decode(op: int) -> None:
    """MAX_BLOCKS_PER_REQUEST hashes and as many block ids, over two runs, are within the caps."""
    body = _groups_body(op, _run(HALF, 1) + _run(HALF, 1, hash_len=2), 2)
    request = fq.decode_request(op, body)
    assert isinstance(request, fq.SaveGroupsRequest | fq.LoadGroupsRequest)
    assert [(len(r.hashes), len(r.hashes[0]), len(r.block_ids)) for r in request.runs] == [(HALF, 1, 1), (HALF, 2, 1)]


@given(st.sampled_from(["loaded", "missing", "refused"]), st.integers(0, U32), st.text(), st.text())
def test_load_answer_round_trips(outcome: str, loaded: int, reason: str, message: str) -> None:
    body = fq.encode_load_ok(outcome, loaded, reason, message)[5:]
    assert fq.decode_load_ok(body) == (fq.OUTCOMES[outcome], loaded, reason, message)


@given(st.text(min_size=0, max_size=3000))
@example("a" + "é" * 3000)  # 6001 bytes: byte 4096 is the first half of an é
def test_an_error_message_is_cut_at_a_character_boundary(message: str) -> None:
    """A long message (client values in it are quoted short, but a message may still be long) is cut to
    MAX_ERROR_BYTES without splitting a character: the client always decodes it."""
    frame = fq.encode_error("INVALID_ARGUMENT", message)
    body = frame[fq._HEADER.size :]
    assert len(body) <= fq.MAX_ERROR_BYTES
    text = body.decode()  # never a UnicodeDecodeError
    assert message.startswith(text)
    assert fq.MAX_ERROR_BYTES - len(body) < 4 if len(message.encode()) > fq.MAX_ERROR_BYTES else text == message


@given(st.text(min_size=1, max_size=40), SAME_LENGTH_HASHES, st.integers(0, U32))
def test_query_frame_round_trips(instance_id: str, hashes: list[bytes], ttl: int) -> None:
    assert _decoded(fq.encode_query(instance_id, hashes, ttl)) == fq.QueryRequest(instance_id, ttl, hashes)


@given(st.text(max_size=40), SAME_LENGTH_HASHES, st.text(max_size=40), st.one_of(st.just(0), st.integers(0, U32)))
@example("A", [], "", 0)
@example("A", [b"h"], "r", U32)
def test_query_frame_with_a_limit_round_trips(instance_id: str, hashes: list[bytes], rid: str, limit: int) -> None:
    """limit_tokens travels as 4 trailing bytes only when nonzero: a frame without it is the one from before."""
    frame = fq.encode_query(instance_id, hashes, 5, rid, limit)
    assert _decoded(frame) == fq.QueryRequest(instance_id, 5, hashes, rid, limit)
    assert len(frame) == len(fq.encode_query(instance_id, hashes, 5, rid)) + (4 if limit else 0)


def test_query_limit_is_exactly_four_bytes() -> None:
    body = fq.encode_query("A", HASHES[:2])[5:]
    assert fq.decode_request(fq.OP_QUERY, body + bytes(4)) == fq.QueryRequest("A", 0, HASHES[:2], "", 0)
    assert fq.decode_request(fq.OP_QUERY, body + struct.pack("<I", 9)) == fq.QueryRequest("A", 0, HASHES[:2], "", 9)
    for extra in (1, 2, 3, 5, 8):
        with pytest.raises(InvalidArgument, match="QUERY frame has trailing bytes"):
            fq.decode_request(fq.OP_QUERY, body + bytes(extra))


@given(st.text(max_size=40), st.integers(0, U64))
def test_release_frame_round_trips(instance_id: str, lease_id: int) -> None:
    assert _decoded(fq.encode_release(instance_id, lease_id)) == fq.ReleaseRequest(instance_id, lease_id)


@given(WORKER_KEYS)
def test_unregister_frame_round_trips(worker: tuple[str, int, int]) -> None:
    assert _decoded(fq.encode_unregister(worker)) == fq.UnregisterRequest(worker)


@given(st.text(max_size=300))
def test_hello_frame_round_trips(token: str) -> None:
    assert _decoded(fq.encode_hello(token)) == fq.HelloRequest(token)


u32 = st.one_of(st.sampled_from([0, 1, U32]), st.integers(0, U32))
u64 = st.one_of(st.sampled_from([0, 1, 2**63, U64]), st.integers(0, U64))
memory_handles = st.one_of(
    st.builds(pb.MemoryHandle),
    st.builds(
        lambda fd, offset, size: pb.MemoryHandle(shm=pb.ShmHandle(fd=fd, offset=offset, size=size)), u32, u64, u64
    ),
    st.builds(
        lambda device, handle, size, offset: pb.MemoryHandle(
            cuda=pb.CudaIpcHandle(device=device, handle=handle, storage_size=size, offset=offset)
        ),
        st.integers(-(2**31), 2**31 - 1),
        st.binary(max_size=64),
        u64,
        u64,
    ),
)
layer_specs = st.builds(
    pb.LayerSpec,
    name=st.text(max_size=40),
    dtype=st.sampled_from(["", "bfloat16", "float16", "fp8_e4m3"]),
    segment_bytes=u64,
    segments=u32,
    group_id=u32,
    layout_tag=st.text(max_size=20),
    num_blocks=u64,
    strides=st.lists(u64, max_size=3),
    memory=memory_handles,
)
register_requests = st.builds(
    lambda templates, n, fields: pb.RegisterRequest(layers=[templates[i % len(templates)] for i in range(n)], **fields),
    st.lists(layer_specs, min_size=1, max_size=4),
    st.one_of(st.integers(0, 8), st.integers(0, MAX_LAYERS), st.just(MAX_LAYERS)),
    st.fixed_dictionaries(
        {},
        optional={
            "instance_id": st.text(max_size=40),
            "namespace": st.text(max_size=40),
            "tp_rank": u32,
            "tp_size": u32,
            "pp_rank": u32,
            "world_size": u32,
            "block_size": u32,
        },
    ),
)


@given(register_requests)
def test_register_frame_round_trips_and_counts_its_layers(request: pb.RegisterRequest) -> None:
    wire = request.SerializeToString()
    assert fq.count_layers(wire) == len(request.layers)
    decoded = _decoded(fq.encode_register(wire))
    assert decoded == fq.RegisterRequest(wire)
    assert pb.RegisterRequest.FromString(decoded.body) == request


def test_count_layers_refuses_a_million_layers_without_decoding_them() -> None:
    """10^6 tiny layers (2 MiB: a frame the lane accepts) are refused at the 4097th layer, read from the wire format:
    their bytes are not even valid LayerSpecs (protobuf would fail on them), and what follows the 4097th layer is
    never looked at."""
    not_a_layer = b"\x42\x01\xff"  # field 8, length 1, a lone 0xff: no LayerSpec parses from it
    body = b"\x0a\x01A" + not_a_layer * 1_000_000
    assert len(body) <= MAX_REGISTER_BYTES
    start = time.perf_counter()
    with pytest.raises(InvalidArgument, match=f"at most {MAX_LAYERS} layers"):
        fq.decode_request(fq.OP_REGISTER, body)
    assert time.perf_counter() - start < 1.0  # reads 4097 keys, not a million messages
    past_the_limit = not_a_layer * (MAX_LAYERS + 1) + b"\x0f\x0f"  # followed by an invalid wire type
    with pytest.raises(InvalidArgument, match=f"at most {MAX_LAYERS} layers"):
        fq.count_layers(past_the_limit)
    assert fq.count_layers(not_a_layer * MAX_LAYERS) == MAX_LAYERS
    with pytest.raises(InvalidArgument, match="wire type"):
        fq.count_layers(not_a_layer * MAX_LAYERS + b"\x0f\x0f")


@pytest.mark.parametrize(
    "body, message",
    [
        (b"\x42", "truncated varint"),  # a key, then nothing
        (b"\x42\x05ab", "runs past the end"),  # a length longer than what follows
        (b"\x80" * 11, "longer than 10 bytes"),
        (b"\x0b", "wire type 3"),  # a group start: not valid in kvseal messages
        (b"\x41\x00", "runs past the end"),  # a fixed64 field cut short
    ],
)
def test_count_layers_refuses_malformed_wire_format(body: bytes, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        fq.count_layers(body)


def test_codec_refuses_what_the_lane_cannot_carry() -> None:
    for bad in ([b""], [b"a", b"bb"], [b"x" * 256]):
        with pytest.raises(fq.Unframeable, match="one length"):
            fq.encode_query("A", bad)
    with pytest.raises(fq.Unframeable, match="32 bits"):
        fq.encode_save(("A", 0, 0), [b"h"], [2**32])
    with pytest.raises(fq.Unframeable, match="32 bits"):
        fq.encode_load(("A", 0, 0), [b"h"], [-1])
    for encode, args in (
        (fq.encode_query, ("A", [b"h"], -1)),
        (fq.encode_release, ("A", 2**64)),
        (fq.encode_save, (("A", -1, 0), [b"h"], [0])),
        (fq.encode_load, (("A", 0, 0), [b"h"], [0], -1)),
        (fq.encode_unregister, (("A", 0, 2**32),)),
        (fq.encode_query, ("A", [b"h"], 0, "", 2**32)),
        (fq.encode_query, ("A", [b"h"], 0, "", -1)),
        (fq.encode_save_groups, (("A", 2**32, 0), [])),
        (fq.encode_load_groups, (("A", 0, 0), [], -1)),
    ):
        with pytest.raises(fq.Unframeable, match="do not fit"):
            encode(*args)
    with pytest.raises(fq.Unframeable, match="65535"):
        fq.encode_hello("t" * 0x10000)
    for runs, message in (
        ([BlockRun(0, [b"h", b"i"], [[1, 2], [3]])], r"runs\[0\]\.block_ids\[1\] and block_hashes differ"),
        ([BlockRun(0, [b"h"], [[0]]), BlockRun(1, [b"h"], [])], r"runs\[1\] has 0 block tables"),
        ([BlockRun(0, [], [[]] * 256)], "has 256 block tables; the lane carries 1..255"),
        ([BlockRun(0, [b"h"], [[2**32]])], "32 bits"),
        ([BlockRun(0, [b"h"], [[-1]])], "32 bits"),
        ([BlockRun(0, [b"a", b"bb"], [[0, 1]])], "one length"),
        ([BlockRun(256, [b"h"], [[0]])], "do not fit"),
        ([BlockRun(-1, [b"h"], [[0]])], "do not fit"),
        ([BlockRun(0, [], [[]])] * 256, "at most 255 runs"),
    ):
        with pytest.raises(fq.Unframeable, match=message):
            fq.encode_save_groups(("A", 0, 0), runs)
        with pytest.raises(fq.Unframeable, match=message):
            fq.encode_load_groups(("A", 0, 0), runs)
    assert _decoded(fq.encode_save_groups(("A", 0, 0), [BlockRun(0, [], [[]])] * 255)) == fq.SaveGroupsRequest(
        ("A", 0, 0), [BlockRun(0, [], [[]])] * 255
    )
    with pytest.raises(InvalidArgument, match="registration is"):
        fq.encode_register(bytes(MAX_REGISTER_BYTES + 1))


# -------------------------------------------------------------------- frame assembly

frames = st.one_of(
    st.builds(fq.encode_query, st.text(max_size=10), SAME_LENGTH_HASHES, st.integers(0, U32)),
    st.builds(fq.encode_release, st.text(max_size=10), st.integers(0, U64)),
    st.builds(fq.encode_unregister, WORKER_KEYS),
    st.builds(fq.encode_save_groups, WORKER_KEYS, block_runs()),
    st.builds(fq.encode_load_groups, WORKER_KEYS, block_runs(), st.integers(0, U64)),
    st.builds(fq.encode_hello, st.text(max_size=20)),
    st.builds(fq.encode_register, st.binary(max_size=200)),
    st.builds(
        lambda op, body: struct.pack("<IB", len(body), op) + body, st.sampled_from(list(fq.FRAME_LIMITS)), st.binary()
    ),
)


@given(st.lists(frames, max_size=8), st.data())
def test_frame_buffer_gives_the_same_frames_for_any_chunking(sent: list[bytes], data: Any) -> None:
    stream = b"".join(sent)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=12)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    buf = fq.FrameBuffer()
    got = []
    for chunk in chunks:
        buf.feed(chunk)
        while (frame := buf.next_frame()) is not None:
            got.append(frame)
    expected = [(f[4], f[5:]) for f in sent]
    assert got == expected
    assert len(buf) == 0


@pytest.mark.parametrize("op", sorted(fq.FRAME_LIMITS))
def test_frame_buffer_refuses_an_oversized_header_before_its_body(op: int) -> None:
    limit = fq.FRAME_LIMITS[op]
    at_limit = fq.FrameBuffer()
    at_limit.feed(struct.pack("<IB", limit, op))
    assert at_limit.next_frame() is None  # waits for the body, allocating nothing for it
    assert len(at_limit) == 5
    over = fq.FrameBuffer()
    header = struct.pack("<IB", limit + 1, op)
    over.feed(header[:3])
    assert over.next_frame() is None  # half a header: nothing to judge yet
    over.feed(header[3:])
    with pytest.raises(InvalidArgument, match=f"exceeds its {limit}-byte limit"):
        over.next_frame()


@pytest.mark.parametrize("op", [0, 11, 255])
def test_frame_buffer_refuses_an_unknown_op_from_its_header(op: int) -> None:
    buf = fq.FrameBuffer()
    buf.feed(struct.pack("<IB", 1, op))
    with pytest.raises(InvalidArgument, match=f"unknown op {op}"):
        buf.next_frame()


# -------------------------------------------------------------------- a real engine

BLOCKS, SLOT = 16, 4096


class Owner:
    """A worker in this process: one layer of sealed memfd memory, registered over its client's lane (its session)
    and saved HASHES from blocks 0..7."""

    def __init__(self, engine: EngineProcess) -> None:
        self.shared = SharedArray((BLOCKS, SLOT))
        self.shared.array[:] = np.frombuffer(os.urandom(BLOCKS * SLOT), np.uint8).reshape(BLOCKS, SLOT)
        self.client = engine.client()
        layers = {"model.layers.0.self_attn.attn": self.shared.array}
        self.status = register_one_rank(
            self.client, "A", self.shared, layers, namespace="lane", layout_tag="cpu-test", dtype="bfloat16"
        )
        assert self.status.sealed
        assert self.client.save(("A", 0, 0), HASHES, list(range(len(HASHES)))).completed == len(HASHES)

    def close(self) -> None:
        self.client.close()
        self.shared.close()


@pytest.fixture
def owner(engine: EngineProcess) -> Iterator[Owner]:
    o = Owner(engine)
    yield o
    o.close()


def _raw(path: str, frame: bytes) -> tuple[int, bytes] | None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(path)
        s.sendall(frame)
        s.shutdown(socket.SHUT_WR)  # a truncated frame then ends in EOF instead of a wait
        return fq.read_frame(s)


@pytest.mark.process
def test_lane_answers_queries_like_grpc(engine: EngineProcess, owner: Owner) -> None:
    with engine.client() as client, grpc.insecure_channel(engine.target) as channel:
        stub = pb_grpc.EngineStub(channel)
        path = client.info().lane_socket
        assert path and stat.S_ISSOCK(os.stat(path).st_mode)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        probe = HASHES[:5] + [b"\xff" * 32] + HASHES[5:]
        by_lane = client.query("A", probe)
        by_grpc = stub.Query(pb.QueryRequest(instance_id="A", block_hashes=probe), timeout=30)
        assert (by_lane.hits, by_lane.namespace_final, by_lane.lease_ttl_ms) == (
            by_grpc.hits,
            by_grpc.namespace_final,
            by_grpc.lease_ttl_ms,
        )
        assert (by_lane.hits, by_lane.namespace_final) == (5, owner.status.namespace_final)
        assert by_lane.lease_id and by_grpc.lease_id and by_lane.lease_id != by_grpc.lease_id
        assert engine.metric("kvseal_leases") == 2
        client.release("A", by_grpc.lease_id)  # a lease granted over one transport is released over the other
        stub.Release(pb.ReleaseRequest(instance_id="A", lease_id=by_lane.lease_id), timeout=30)
        assert engine.metric("kvseal_leases") == 0
        with pytest.raises(NotFound, match="lease_id"):
            client.release("A", by_lane.lease_id)
        with pytest.raises(grpc.RpcError) as info:
            stub.Release(pb.ReleaseRequest(instance_id="A", lease_id=by_grpc.lease_id), timeout=30)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(NotFound, match="not registered"):
            client.query("nobody", HASHES)
        assert engine.metric("kvseal_rpc_seconds_count", method="lane.Query", code="OK") == 1
        assert engine.metric("kvseal_rpc_seconds_count", method="Query", code="OK") == 1

        # hashes of unequal lengths cannot be framed: the client asks over gRPC and gets the engine's answer
        odd = client.query("A", [HASHES[0], HASHES[1][:16]])
        assert odd.hits == 1
        client.release("A", odd.lease_id)
        assert engine.metric("kvseal_rpc_seconds_count", method="Query", code="OK") == 2
        assert engine.metric("kvseal_rpc_seconds_count", method="lane.Query", code="OK") == 1

        # a ping carries any bytes, up to a Query's limit, and is answered without being read
        client.ping(fq.encode_query("A", HASHES))
        client.ping()
        assert engine.metric("kvseal_rpc_seconds_count", method="lane.Ping", code="OK") == 2
        with pytest.raises(InvalidArgument, match="at most"):
            client.ping(bytes(fq.FRAME_LIMITS[fq.OP_PING] + 1))
        assert _raw(path, struct.pack("<IB", fq.FRAME_LIMITS[fq.OP_PING] + 1, fq.OP_PING)) == (
            fq.STATUS_CODES["INVALID_ARGUMENT"],
            f"Ping frame of {fq.FRAME_LIMITS[fq.OP_PING] + 1} bytes exceeds its {fq.FRAME_LIMITS[fq.OP_PING]}-byte "
            "limit".encode(),
        )


@pytest.mark.process
def test_lane_survives_malformed_frames(engine: EngineProcess, owner: Owner) -> None:
    path = owner.client.info().lane_socket
    bad: list[bytes] = [
        struct.pack("<IB", 3, fq.OP_QUERY) + b"\x05\x00A",  # instance_id runs past the frame
        struct.pack("<IB", 0, 11),  # unknown op, empty body
        fq.encode_query("A", HASHES)[:-1],  # truncated: the length says one more byte
        struct.pack("<IB", fq.MAX_FRAME + 1, fq.OP_QUERY),  # oversized
        fq.encode_query("A", HASHES) + b"trailing",  # declared length excludes these: a second bad frame
        fq.encode_register(b"\x0f"),  # a RegisterRequest that is not protobuf
        fq.encode_register(pb.RegisterRequest(instance_id="B").SerializeToString()),  # parses, but says nothing
    ]
    codes = []
    for frame in bad:
        try:
            reply: Any = _raw(path, frame)
        except ConnectionError:
            reply = "closed"
        codes.append(reply if reply in (None, "closed") else reply[0])
    invalid = fq.STATUS_CODES["INVALID_ARGUMENT"]
    assert codes[0] == codes[1] == codes[3] == codes[5] == codes[6] == invalid
    assert codes[2] in (None, "closed")  # EOF inside a frame: the engine hangs up without an answer
    assert codes[4] == 0  # the first, complete frame is answered
    assert owner.client.query("A", HASHES).hits == len(HASHES)
    assert engine.alive()


@pytest.mark.process
def test_serve_refuses_to_start_without_the_lane() -> None:
    cmd = serve_command(f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}", ["--lane-socket", ""])
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode != 0
    assert "--lane-socket" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
