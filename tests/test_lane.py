"""The local lane (kvseal.lane): its codec on any bytes, and a real engine serving it beside gRPC."""

from __future__ import annotations

import os
import socket
import stat
import struct
from typing import Any

import pytest
from conftest import EngineProcess
from hypothesis import given
from hypothesis import strategies as st
from workers import Worker, attn_layers

from kvseal import lane as fq
from kvseal.client import EngineClient
from kvseal.errors import InvalidArgument, NotFound
from kvseal.proto import kvseal_pb2 as pb

HASHES = [bytes([i]) * 32 for i in range(8)]


@given(st.integers(0, 255), st.binary(max_size=300))
def test_decode_request_parses_or_raises_invalid_argument(op: int, body: bytes) -> None:
    try:
        request = fq.decode_request(op, body)
    except InvalidArgument:
        return
    assert isinstance(request, (fq.QueryRequest, fq.ReleaseRequest, fq.SaveRequest, fq.LoadRequest))


WORKER_KEYS = st.tuples(st.text(min_size=1, max_size=40), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1))
SAME_LENGTH_HASHES = st.integers(1, 255).flatmap(
    lambda size: st.lists(st.binary(min_size=size, max_size=size), max_size=70)
)


@given(WORKER_KEYS, SAME_LENGTH_HASHES, st.data())
def test_save_and_load_frames_round_trip(worker: tuple[str, int, int], hashes: list[bytes], data: Any) -> None:
    ids = data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=len(hashes), max_size=len(hashes)))
    lease = data.draw(st.integers(0, 2**64 - 1))
    for frame, expected in (
        (fq.encode_save(worker, hashes, ids), fq.SaveRequest(worker, hashes, ids)),
        (fq.encode_load(worker, hashes, ids, lease), fq.LoadRequest(worker, lease, hashes, ids)),
    ):
        length, op = struct.unpack_from("<IB", frame)
        assert length == len(frame) - 5
        assert fq.decode_request(op, frame[5:]) == expected


@given(st.sampled_from(["loaded", "missing", "refused"]), st.integers(0, 2**32 - 1), st.text(), st.text())
def test_load_answer_round_trips(outcome: str, loaded: int, reason: str, message: str) -> None:
    body = fq.encode_load_ok(outcome, loaded, reason, message)[5:]
    assert fq.decode_load_ok(body) == (fq.OUTCOMES[outcome], loaded, reason, message)


@given(st.text(min_size=1, max_size=40), SAME_LENGTH_HASHES, st.integers(0, 2**32 - 1))
def test_query_frame_round_trips(instance_id: str, hashes: list[bytes], ttl: int) -> None:
    frame = fq.encode_query(instance_id, hashes, ttl)
    length, op = struct.unpack_from("<IB", frame)
    assert length == len(frame) - 5
    assert fq.decode_request(op, frame[5:]) == fq.QueryRequest(instance_id, ttl, hashes)


def _sealed_instance(engine: EngineProcess) -> Worker:
    worker = Worker.start(engine.target, name="lane-worker")
    worker.status = worker.register(
        instance_id="A", namespace="lane", layers=attn_layers(2), tp_rank=0, tp_size=1, world_size=1, seed=1
    )
    worker.save(HASHES, list(range(len(HASHES))))
    return worker


def _raw(path: str, frame: bytes) -> tuple[int, bytes] | None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        s.sendall(frame)
        s.shutdown(socket.SHUT_WR)  # a truncated frame then ends in EOF instead of a wait
        return fq.read_frame(s)


@pytest.mark.process
def test_lane_answers_like_grpc(engine: EngineProcess) -> None:
    worker = _sealed_instance(engine)
    try:
        lane_client = engine.client()
        grpc_client = engine.client(use_lane=False)
        path = lane_client.info().lane_socket
        assert path and stat.S_ISSOCK(os.stat(path).st_mode)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        probe = HASHES[:5] + [b"\xff" * 32] + HASHES[5:]
        by_lane, by_grpc = lane_client.query("A", probe), grpc_client.query("A", probe)
        assert (
            (by_lane.hits, by_lane.namespace_final)
            == (by_grpc.hits, by_grpc.namespace_final)
            == (
                5,
                worker.status.namespace_final,
            )
        )
        assert by_lane.lease_id and by_lane.lease_id != by_grpc.lease_id
        assert engine.metric("kvseal_leases") == 2
        lane_client.release("A", by_lane.lease_id)
        lane_client.release("A", by_grpc.lease_id)
        assert engine.metric("kvseal_leases") == 0
        with pytest.raises(NotFound, match="lease_id"):
            lane_client.release("A", by_lane.lease_id)
        with pytest.raises(NotFound, match="not registered"):
            lane_client.query("nobody", HASHES)
        assert engine.metric("kvseal_rpc_seconds_count", method="lane.Query", code="OK") == 1
    finally:
        worker.close()


@pytest.mark.process
def test_lane_survives_malformed_frames(engine: EngineProcess) -> None:
    worker = _sealed_instance(engine)
    try:
        path = engine.client().info().lane_socket
        bad: list[bytes] = [
            struct.pack("<IB", 3, fq.OP_QUERY) + b"\x05\x00A",  # instance_id runs past the frame
            struct.pack("<IB", 0, 9),  # unknown op, empty body
            fq.encode_query("A", HASHES)[:-1] + b"",  # truncated: the length says one more byte
            struct.pack("<IB", fq.MAX_FRAME + 1, fq.OP_QUERY),  # oversized
            fq.encode_query("A", HASHES) + b"trailing",  # declared length excludes these: a second bad frame
        ]
        codes = []
        for frame in bad:
            try:
                reply: Any = _raw(path, frame)
            except ConnectionError:
                reply = "closed"
            codes.append(reply if reply in (None, "closed") else reply[0])
        assert codes[0] == fq.STATUS_CODES["INVALID_ARGUMENT"]
        assert codes[1] == fq.STATUS_CODES["INVALID_ARGUMENT"]
        assert codes[2] in (None, "closed")  # EOF inside a frame: the engine hangs up without an answer
        assert codes[3] == fq.STATUS_CODES["INVALID_ARGUMENT"]
        assert codes[4] == 0  # the first, complete frame is answered
        assert engine.client().query("A", HASHES).hits == len(HASHES)
        assert engine.alive()
    finally:
        worker.close()


@pytest.mark.process
def test_without_lane_clients_use_grpc(engine_factory: Any) -> None:
    engine = engine_factory("--lane-socket", "")
    worker = _sealed_instance(engine)
    try:
        client: EngineClient = engine.client()
        assert client.info().lane_socket == ""
        q = client.query("A", HASHES)
        assert q.hits == len(HASHES)
        client.release("A", q.lease_id)
        assert engine.metric("kvseal_rpc_seconds_count", method="Query", code="OK") == 1
    finally:
        worker.close()


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
    ):
        with pytest.raises(fq.Unframeable, match="do not fit"):
            encode(*args)


@pytest.mark.process
def test_save_and_load_over_the_lane_match_grpc(engine: EngineProcess) -> None:
    worker = _sealed_instance(engine)  # saved HASHES from blocks 0..7 over the lane (the worker's client)
    try:
        key = ("A", 0, 0)
        lane_client, grpc_client = engine.client(), engine.client(use_lane=False)
        assert engine.metric("kvseal_rpc_seconds_count", method="lane.Save", code="OK") == 1
        fresh = [bytes([0xA0 + i]) * 32 for i in range(4)]
        by_lane = lane_client.save(key, fresh[:2], [8, 9])
        by_grpc = grpc_client.save(key, fresh[2:], [10, 11])
        assert by_lane == by_grpc
        assert (by_lane.written, by_lane.completed, by_lane.namespace_final) == (2, 2, worker.status.namespace_final)
        assert lane_client.save(key, fresh, [8, 9, 10, 11]).skipped == 4

        before = worker.read(list(range(12)))
        q = lane_client.query("A", HASHES + fresh)
        assert q.hits == 12
        loaded = lane_client.load(key, HASHES[:6], list(range(20, 26)), lease_id=q.lease_id)
        assert (loaded.outcome, loaded.loaded) == (pb.LoadResponse.LOADED, 6)
        assert grpc_client.load(key, HASHES[6:] + fresh, list(range(26, 32))).loaded == 6
        after = worker.read(list(range(20, 32)))
        assert after == before  # every layer's bytes of blocks 20..31 are those of 0..11

        missing = lane_client.load(key, [HASHES[0], b"\xee" * 32], [0, 1])
        assert (missing.outcome, missing.loaded) == (pb.LoadResponse.MISSING, 1)
        assert "not resident" in missing.message
        with pytest.raises(InvalidArgument, match=r"block_ids\[1\] = 99 is out of range"):
            lane_client.save(key, fresh[:2], [0, 99])
        with pytest.raises(NotFound, match="not registered"):
            lane_client.load(("A", 5, 0), HASHES[:1], [0])
        assert engine.metric("kvseal_rpc_seconds_count", method="lane.Load", code="OK") == 2
        assert engine.metric("kvseal_rpc_seconds_count", method="Load", code="OK") == 1

        # hashes of unequal lengths cannot be framed: the request goes over gRPC and gets the engine's answer
        odd = [b"\x71" * 32, b"\x72" * 16]
        assert lane_client.save(key, odd, [0, 1]).written == 2
        assert engine.metric("kvseal_rpc_seconds_count", method="Save", code="OK") == 2
    finally:
        worker.close()
