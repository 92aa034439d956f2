"""Fixtures that run a real `kvseal serve` subprocess.

`engine` is a fresh engine per test (64 MiB pool, 8 MiB slabs: starting one costs an interpreter start and an
import of grpc). `engine_factory` starts more, or with extra arguments; `module_engine` is one engine shared by
a module. Teardown stops the engine with SIGTERM (SIGKILL if it does not exit) and fails the test when the
engine died on its own, exited non-zero or printed a Traceback. The engine process is kvseal.testing.EngineProcess
(EngineProcess, free_port, http_get and serve_command can still be imported from here).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvseal.client import EngineClient
from kvseal.memfd import SharedArray
from kvseal.proto import kvseal_pb2 as pb
from kvseal.proto import kvseal_pb2_grpc as pb_grpc
from kvseal.testing.process import EngineProcess, EngineStartFailed, free_port, http_get
from kvseal.testing.process import serve_command as serve_command  # tests import it from here
from kvseal.testing.worker import register_one_rank

REPO = Path(__file__).resolve().parent.parent


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Polls `predicate` until it returns something truthy; fails naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)  # poll interval of a bounded wait on a real condition


class _Engines:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.running: list[EngineProcess] = []

    def start(self, *extra: str, listen: str | None = None, wrapper: Sequence[str] = ()) -> EngineProcess:
        """Starts an engine and waits until it serves. Ports come from free_port(), so another process may take one
        before the engine binds it: that case is retried with new ports."""
        for attempt in range(3):
            engine = EngineProcess(self.base / f"engine{len(self.running)}", extra, listen, wrapper, cwd=REPO)
            self.running.append(engine)
            try:
                engine.wait_ready()
                return engine
            except EngineStartFailed as e:
                engine.stop()
                self.running.remove(engine)
                if not (engine.lost_port() and listen is None) or attempt == 2:
                    pytest.fail(str(e), pytrace=False)
        raise AssertionError("unreachable")

    def stop_all(self) -> None:
        problems = []
        for engine in self.running:
            problems += engine.stop(dump_stacks=True)
        if problems:
            pytest.fail("\n".join(problems), pytrace=False)


@pytest.fixture
def engine_factory(tmp_path: Path) -> Iterator[Callable[..., EngineProcess]]:
    """start(*extra_args, listen=None, wrapper=()) -> a ready EngineProcess, stopped and checked at teardown."""
    engines = _Engines(tmp_path)
    yield engines.start
    engines.stop_all()


@pytest.fixture
def engine(engine_factory: Callable[..., EngineProcess]) -> EngineProcess:
    return engine_factory()


@pytest.fixture(scope="module")
def module_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    engines = _Engines(tmp_path_factory.mktemp("module-engine"))
    yield engines.start()
    engines.stop_all()


@pytest.fixture
def shm_files() -> Iterator[Callable[[int], str]]:
    """make(size) -> path of a fresh zero-filled file in /dev/shm, removed at teardown."""
    made: list[str] = []

    def make(size: int) -> str:
        path = f"/dev/shm/kvseal-test-{os.getpid()}-{len(made)}-{os.urandom(4).hex()}"
        with open(path, "wb") as f:
            f.truncate(size)
        made.append(path)
        return path

    yield make
    for path in made:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def save_blocks(engine: EngineProcess, instance: str, namespace: str, hashes: Sequence[bytes]) -> str:
    """Registers a worker of one 16 KiB layer on `engine`, saves `hashes` from its first blocks, ends its session
    (the blocks stay). Returns the instance's namespace_final."""
    shared = SharedArray((len(hashes), 16384))
    shared.array[:] = np.random.default_rng(len(hashes)).integers(0, 256, shared.array.shape, dtype=np.uint8)
    with EngineClient(engine.target, timeout=30, token=engine.token) as client:
        status = register_one_rank(client, instance, shared, namespace=namespace, layout_tag="t", dtype="uint8")
        assert client.save((instance, 0, 0), list(hashes), list(range(len(hashes)))).completed == len(hashes)
    shared.close()
    return status.namespace_final


# ---------------------------------------------------------------- the MetaServer and its Redis

NS = "llama.1a2b3c4d"


class Meta:
    """A `kvseal metaserver` subprocess and a stub to it."""

    def __init__(self, workdir: Path, *extra: str, port: int | None = None) -> None:
        self.port, self.http_port = port or free_port(), free_port()
        self.log = workdir / f"meta-{self.port}.log"
        argv = [sys.executable, "-m", "kvseal", "metaserver", "--listen", f"127.0.0.1:{self.port}"]
        argv += ["--http-listen", f"127.0.0.1:{self.http_port}", *extra]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        wait_until(self._ready, 30, "the MetaServer to serve")
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.MetaServerStub(self.channel)

    def _ready(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()
        try:
            return http_get(f"http://127.0.0.1:{self.http_port}/health", timeout=1)[0] == 200
        except OSError:
            return False

    def heartbeat(self, node: str, session: str = "s1", address: str = "127.0.0.1:7000") -> pb.HeartbeatResponse:
        return self.stub.Heartbeat(pb.HeartbeatRequest(node_id=node, session=session, address=address), timeout=10)

    def announce(self, node: str, hashes: list[bytes], session: str = "s1", ns: str = NS) -> int:
        blocks = [pb.NamespaceBlocks(namespace_final=ns, block_hashes=hashes)]
        return self.stub.Announce(pb.BlocksRequest(node_id=node, session=session, blocks=blocks), timeout=10).changed

    def withdraw(self, node: str, hashes: list[bytes], session: str = "s1") -> int:
        blocks = [pb.NamespaceBlocks(namespace_final=NS, block_hashes=hashes)]
        return self.stub.Withdraw(pb.BlocksRequest(node_id=node, session=session, blocks=blocks), timeout=10).changed

    def prefix(self, hashes: list[bytes], ns: str = NS) -> dict[str, int]:
        r = self.stub.QueryPrefix(pb.QueryPrefixRequest(namespace_final=ns, block_hashes=hashes), timeout=10)
        return {n.node_id: n.prefix for n in r.nodes}

    def stop(self, sig: int = signal.SIGTERM) -> int:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=15)


@pytest.fixture
def meta(tmp_path: Path) -> Iterator[Callable[..., Meta]]:
    """start(*extra_args, port=None) -> a serving Meta; every one is killed at teardown."""
    started: list[Meta] = []

    def start(*extra: str, port: int | None = None) -> Meta:
        started.append(Meta(tmp_path, *extra, port=port))
        return started[-1]

    yield start
    for m in started:
        m.stop(signal.SIGKILL)


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    """A real redis-server (Debian's package) on a free port, data in tmp_path, killed at teardown."""
    binary = shutil.which("redis-server")
    assert binary, "redis-server is needed (scripts/test installs Debian's redis-server package)"
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def answers() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    wait_until(answers, 20, "redis-server to answer")
    yield f"redis://127.0.0.1:{port}/0"
    proc.kill()
    proc.wait()


@pytest.fixture
def vllm_server(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """start(model, engine_target or None, kv_role, wait, extra server args) -> a VllmServer; stopped at the end."""
    from vllm_support import VllmServer  # imports vLLM's helpers only for the tests that start a server

    started: list[VllmServer] = []

    def start(
        model: Path, engine_target: str | None, kv_role: str = "kv_both", wait: bool = True, extra: tuple[str, ...] = ()
    ) -> VllmServer:
        server = VllmServer(model, engine_target, tmp_path / f"vllm-server{len(started)}.log", kv_role, extra)
        started.append(server)
        if wait:
            server.wait_ready()
        return server

    yield start
    for server in started:
        if not server.stopped:
            server.stop()
