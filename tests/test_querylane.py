"""The query lane (kvseal.fastquery): its codec on any bytes, and a real engine serving it beside gRPC."""

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

from kvseal import fastquery as fq
from kvseal.client import EngineClient
from kvseal.errors import InvalidArgument, NotFound

HASHES = [bytes([i]) * 32 for i in range(8)]


@given(st.integers(0, 255), st.binary(max_size=300))
def test_decode_request_parses_or_raises_invalid_argument(op: int, body: bytes) -> None:
    try:
        request = fq.decode_request(op, body)
    except InvalidArgument:
        return
    assert isinstance(request, (fq.QueryRequest, fq.ReleaseRequest))


@given(
    st.text(min_size=1, max_size=40),
    st.lists(st.binary(min_size=1, max_size=255), max_size=70),
    st.integers(0, 2**32 - 1),
)
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
        grpc_client = engine.client(use_query_lane=False)
        path = lane_client.info().query_socket
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
        path = engine.client().info().query_socket
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
    engine = engine_factory("--query-socket", "")
    worker = _sealed_instance(engine)
    try:
        client: EngineClient = engine.client()
        assert client.info().query_socket == ""
        q = client.query("A", HASHES)
        assert q.hits == len(HASHES)
        client.release("A", q.lease_id)
        assert engine.metric("kvseal_rpc_seconds_count", method="Query", code="OK") == 1
    finally:
        worker.close()


def test_codec_rejects_hashes_the_lane_cannot_carry() -> None:
    with pytest.raises(InvalidArgument, match="1..255"):
        fq.encode_query("A", [b""])
