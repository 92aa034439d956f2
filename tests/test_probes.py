"""Readiness probes (issue 19, item 10): an engine that says it is ready is ready.

/health once answered 200, and Info an empty lane path, for a moment after start: a worker that registered the
instant /health answered got "announces no local lane" in 1-4 of 10 starts. Here real `kvseal serve` processes
(small pools, not pre-faulted) start one after another; the instant a probe says ready (HTTP /health 200 on even
starts, grpc.health.v1 SERVING on odd ones), a worker registers over the lane, and it must succeed every time.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import pytest
from conftest import REPO
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvseal.client import EngineClient
from kvseal.engine.memory import ShmLayer, ShmSpec, map_shm, plan_shm
from kvseal.errors import KvsealError
from kvseal.memfd import SharedArray, new_memfd, seal
from kvseal.testing import EngineProcess, http_get, register_one_rank

pytestmark = pytest.mark.process

STARTS = 50  # ~0.5 s each on 2 vCPUs (interpreter, imports, an 8 MiB pool): ~25 s in all
READY_TIMEOUT_S = 30.0
SERVING = health_pb2.HealthCheckResponse.SERVING


def _health_ok(http: str) -> bool:
    try:
        return http_get(f"{http}/health", timeout=1.0)[0] == 200
    except OSError:
        return False


def _grpc_serving(stub: health_pb2_grpc.HealthStub) -> bool:
    try:
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0).status == SERVING
    except grpc.RpcError:
        return False


def _start(workdir: Path, i: int) -> EngineProcess:
    extra = ["--pool-size", "8MiB", "--no-prefault", "--lane-socket", str(workdir / f"lane{i}.sock")]
    return EngineProcess(workdir, extra, name=f"engine{i}", cwd=REPO)


def _probe_and_register(i: int, workdir: Path, shared: SharedArray, stopping: list[EngineProcess]) -> str:
    """Starts engine `i`, polls it until it says ready, registers at once. '' when that worked, 'lost' when the
    engine could not have its ports, else what went wrong. The engine is left stopping (SIGTERM) in `stopping`."""
    engine = _start(workdir, i)
    stopping.append(engine)
    by_http = i % 2 == 0
    channel = grpc.insecure_channel(engine.target)
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        while not (_health_ok(engine.http) if by_http else _grpc_serving(stub)):
            if not engine.alive():
                return "lost" if engine.lost_port() else f"exited with {engine.proc.returncode}: {engine.stderr()}"
            if time.monotonic() > deadline:
                return f"not ready after {READY_TIMEOUT_S} s"
            time.sleep(0.002)  # a tight poll: what a replay harness does
        with EngineClient(engine.target, timeout=10) as client:
            try:
                status = register_one_rank(
                    client, f"probe-{i}", shared, namespace="probe", layout_tag="t", dtype="uint8"
                )
                lane = client.info().lane_socket
            except KvsealError as e:
                return "lost" if engine.lost_port() else f"{'HTTP' if by_http else 'gRPC'} probe: {e!r}"
        if not status.sealed or lane != str(workdir / f"lane{i}.sock"):
            return f"sealed {status.sealed}, lane {lane!r}"
        if not (_health_ok(engine.http) and _grpc_serving(stub)):
            return "the probes disagree"
        return ""
    finally:
        channel.close()
        engine.terminate()  # it stops while the next one starts


def test_a_worker_registering_the_instant_the_engine_says_ready_always_succeeds(tmp_path: Path) -> None:
    shared = SharedArray((4, 4096))
    stopping: list[EngineProcess] = []
    try:
        outcomes = [_probe_and_register(i, tmp_path, shared, stopping) for i in range(STARTS)]
    finally:
        for engine in stopping:
            engine.stop(dump_stacks=True)  # one that hangs writes every thread's stack to its stderr first
        shared.close()
    failures = [f"start {i}: {o}" for i, o in enumerate(outcomes) if o not in ("", "lost")]
    assert not failures, f"{len(failures)} of {STARTS} registrations failed:\n" + "\n".join(failures)
    assert outcomes.count("") >= STARTS - 5, outcomes  # ports lost to other processes: a few at most
    for engine in stopping:
        text = engine.stderr()
        assert "Traceback" not in text, text
        assert engine.proc.returncode == 0 or "cannot listen" in text, (engine.proc.returncode, text)


# -------------------------------------------------------------------- what registering maps (issue 19, item 11)


def test_the_engine_plans_to_map_only_what_layers_cover() -> None:
    """Layers that are views of one allocation share one window (the copier sees one array); a layer far away in
    the same memfd gets its own; a memfd handed over twice is one file; offsets need not be page-aligned."""
    page, size = 4096, 1 << 30
    fd = new_memfd(size)
    seal(fd)
    dup = os.dup(fd)
    try:
        layers = [
            ShmLayer("layers[0].memory", ShmSpec(0, 100, size), 2 * page),  # [100, 8292): pages 0-2
            ShmLayer("layers[1].memory", ShmSpec(1, 100 + 2 * page, size), 2 * page),  # same memfd (dup), next
            ShmLayer("layers[2].memory", ShmSpec(0, 512 << 20, size), page),  # far away
        ]
        plan = plan_shm(layers, [fd, dup])
        assert [(w.start, w.size) for w in plan.windows] == [(0, 5 * page), (512 << 20, page)]
        assert plan.layers == [(0, 100), (0, 100 + 2 * page), (1, 0)]
        assert plan.bytes == 6 * page
        mapped = map_shm(plan)
        assert mapped[0][0] is mapped[1][0] and mapped[0][0].size == 5 * page
        mapped[2][0][:4] = [1, 2, 3, 4]
        assert os.pread(fd, 4, 512 << 20) == bytes([1, 2, 3, 4])
        mapped[1][0][mapped[1][1]] = 9
        assert os.pread(fd, 1, 100 + 2 * page) == b"\x09"
    finally:
        os.close(dup)
        os.close(fd)
