"""Fixtures that run a real `kvseal serve` subprocess.

`engine` is a fresh engine per test (64 MiB pool, 8 MiB slabs: starting one costs an interpreter start and an
import of grpc). `engine_factory` starts more, or with extra arguments; `module_engine` is one engine shared by
a module. Teardown stops the engine with SIGTERM (SIGKILL if it does not exit) and fails the test when the
engine died on its own, exited non-zero or printed a Traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvseal.client import EngineClient, layer_from_array
from kvseal.errors import KvsealError
from kvseal.memfd import SharedArray
from kvseal.proto import kvseal_pb2 as pb
from kvseal.proto import kvseal_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


def free_port() -> int:
    """A TCP port nobody listens on right now (bind port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def http_get(url: str, token: str | None = None, timeout: float = 10.0) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read()


def serve_command(listen: str, http_listen: str, extra: Sequence[str] = ()) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvseal",
        "serve",
        "--listen",
        listen,
        "--http-listen",
        http_listen,
        "--pool-size",
        "64MiB",
        "--slab-size",
        "8MiB",
        *extra,
    ]


class EngineStartFailed(Exception):
    pass


class EngineProcess:
    """A running `kvseal serve`. `target` is its gRPC address, `http` its HTTP base URL."""

    def __init__(
        self, workdir: Path, extra: Sequence[str] = (), listen: str | None = None, wrapper: Sequence[str] = ()
    ) -> None:
        """`wrapper`: a command line the serve command is appended to (it must exec its arguments), e.g. one that
        sets a resource limit first."""
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.target = listen or f"127.0.0.1:{free_port()}"
        self.http_port = free_port()
        self.http = f"http://127.0.0.1:{self.http_port}"
        self.token = _token_of(extra)
        self.stdout_path = workdir / "engine.stdout"
        self.stderr_path = workdir / "engine.stderr"
        self.args = [*wrapper, *serve_command(self.target, f"127.0.0.1:{self.http_port}", extra)]
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(self.args, cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        self.expect_exit = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would; teardown then expects the engine gone."""
        self.expect_exit = True
        self.proc.kill()
        self.proc.wait()

    def wait_ready(self) -> None:
        """Returns when GET /health answers 200 and gRPC accepts connections; raises EngineStartFailed if the engine
        exits or does not get ready in time.

        /health is polled first: the engine starts HTTP after gRPC, and polling a refused HTTP port is cheap,
        whereas a gRPC channel that found nobody listening backs off for a second before trying again."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if not self.alive():
                self.expect_exit = True
                raise EngineStartFailed(f"engine exited with {self.proc.returncode} while starting:\n{self.stderr()}")
            if time.monotonic() > deadline:
                raise EngineStartFailed(f"engine HTTP not ready after {START_TIMEOUT_S}s:\n{self.stderr()}")
            try:
                if http_get(f"{self.http}/health", timeout=1.0)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.02)  # poll interval of a bounded wait on a real condition
        with EngineClient(self.target, token=self.token) as client:
            try:
                client.wait_ready(timeout=max(1.0, deadline - time.monotonic()))
            except KvsealError as e:
                raise EngineStartFailed(f"engine gRPC not ready: {e}\n{self.stderr()}") from None

    def client(self, **kwargs: Any) -> EngineClient:
        kwargs.setdefault("token", self.token)
        return EngineClient(self.target, **kwargs)

    def get(self, path: str, token: str | None = None) -> tuple[int, bytes]:
        return http_get(self.http + path, token=token if token is not None else self.token)

    def get_json(self, path: str) -> Any:
        status, body = self.get(path)
        assert status == 200, (path, status, body)
        return json.loads(body)

    def metrics_text(self) -> str:
        status, body = self.get("/metrics")
        assert status == 200, (status, body)
        return body.decode()

    def metric(self, name: str, **labels: str) -> float | None:
        """The value of one sample of /metrics (None when absent)."""
        for family in text_string_to_metric_families(self.metrics_text()):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return None

    def stop(self) -> list[str]:
        """Stops the engine; returns what went wrong (empty when it ran and stopped cleanly)."""
        problems = []
        if not self.alive():
            if not self.expect_exit:
                problems.append(f"engine died unexpectedly with exit code {self.proc.returncode}")
        else:
            self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                problems.append(f"engine ignored SIGTERM for {STOP_TIMEOUT_S}s and was killed")
            else:
                if rc != 0:
                    problems.append(f"engine exited with {rc} after SIGTERM")
        err = self.stderr()
        if "Traceback" in err:
            problems.append("engine printed a Traceback")
        if problems:
            problems.append(f"--- engine stderr ---\n{err}")
        return problems


def _token_of(extra: Sequence[str]) -> str | None:
    args = list(extra)
    for i, a in enumerate(args):
        if a == "--token" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--token="):
            return a.split("=", 1)[1]
    return None


class _Engines:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.running: list[EngineProcess] = []

    def start(self, *extra: str, listen: str | None = None, wrapper: Sequence[str] = ()) -> EngineProcess:
        """Starts an engine and waits until it serves. Ports come from free_port(), so another process may take one
        before the engine binds it: that case is retried with new ports."""
        for attempt in range(3):
            engine = EngineProcess(self.base / f"engine{len(self.running)}", extra, listen, wrapper)
            self.running.append(engine)
            try:
                engine.wait_ready()
                return engine
            except EngineStartFailed as e:
                engine.stop()
                self.running.remove(engine)
                lost_port = "cannot listen" in engine.stderr() and listen is None
                if not lost_port or attempt == 2:
                    pytest.fail(str(e), pytrace=False)
        raise AssertionError("unreachable")

    def stop_all(self) -> None:
        problems = []
        for engine in self.running:
            problems += engine.stop()
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
        layer = layer_from_array("model.layers.0.attn", shared.array, shared, layout_tag="t", dtype="uint8")
        status = client.register(
            instance_id=instance,
            namespace=namespace,
            tp_rank=0,
            tp_size=1,
            pp_rank=0,
            world_size=1,
            block_size=16,
            layers=[layer],
        )
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
