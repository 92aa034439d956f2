"""Assembles a running engine: gRPC (engine API + grpc.health.v1) and HTTP, on the addresses asked for."""

from __future__ import annotations

import ipaddress
import logging
import os
import resource
import tempfile
import threading
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvseal.engine.engine import Engine
from kvseal.proto import kvseal_pb2_grpc as pb_grpc
from kvseal.server.http import HttpServer
from kvseal.server.lane import LaneServer
from kvseal.server.metrics import Metrics
from kvseal.server.service import EngineService

log = logging.getLogger("kvseal.server")
MAX_MESSAGE_BYTES = 16 << 20  # the largest valid Query (131072 hashes of 64 bytes) is ~9 MiB


@dataclass(frozen=True, slots=True)
class ServeConfig:
    listen: str = "127.0.0.1:50055"
    http_listen: str = "127.0.0.1:9091"
    pool_bytes: int = 1 << 30
    slab_bytes: int = 64 << 20
    lease_ttl_s: float = 30.0
    inflight_timeout_s: float = 60.0
    allow_remote: bool = False
    token: str | None = None
    max_workers: int = 128
    prefault: bool = True
    lane_socket: str = "auto"  # unix socket path of the local lane; "auto" derives one, "" turns it off
    lane_group: str | None = None  # the lane socket becomes 0660 with this group: other local users may connect
    lane_max_connections: int = 4096
    lane_idle_timeout_s: float = 60.0


def is_loopback(address: str) -> bool:
    """Whether a gRPC/HTTP listen address only accepts local connections."""
    if address.startswith("unix:"):
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_config(cfg: ServeConfig) -> None:
    if not cfg.lane_socket:
        raise SystemExit("--lane-socket cannot be off: workers register, save and load over the local lane")
    remote = [a for a in (cfg.listen, cfg.http_listen) if a and not is_loopback(a)]
    if remote and not cfg.allow_remote:
        raise SystemExit(
            f"refusing to listen on non-loopback {remote[0]!r}: pass --allow-remote and a token (--token or "
            "KVSEAL_TOKEN) if other machines must reach this engine"
        )
    if remote and not cfg.token:
        raise SystemExit("--allow-remote needs a shared token: pass --token or set KVSEAL_TOKEN")


class _TokenInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}"
        self._deny = grpc.unary_unary_rpc_method_handler(
            lambda request, context: context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        )

    def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        if details.method.startswith("/grpc.health.v1."):
            return continuation(details)
        if dict(details.invocation_metadata or ()).get("authorization") == self._expected:
            return continuation(details)
        return self._deny


class EngineServer:
    """A running engine. `start()` binds and serves; `stop()` ends sessions and shuts both servers down."""

    def __init__(self, cfg: ServeConfig) -> None:
        check_config(cfg)
        self.cfg = cfg
        self.engine = Engine(
            cfg.pool_bytes,
            slab_bytes=cfg.slab_bytes,
            prefault=cfg.prefault,
            lease_ttl_s=cfg.lease_ttl_s,
            inflight_timeout_s=cfg.inflight_timeout_s,
        )
        self.metrics = Metrics(self.engine)
        self.service = EngineService(
            self.engine, self.metrics, token=cfg.token is not None, unix=cfg.listen.startswith("unix:")
        )
        interceptors = [_TokenInterceptor(cfg.token)] if cfg.token else []
        self._grpc = grpc.server(
            futures.ThreadPoolExecutor(max_workers=cfg.max_workers, thread_name_prefix="kvseal-rpc"),
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ],
            maximum_concurrent_rpcs=cfg.max_workers,
        )
        pb_grpc.add_EngineServicer_to_server(self.service, self._grpc)
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        self._http: HttpServer | None = None
        self._lane: LaneServer | None = None
        self._stop = threading.Event()
        self.port = 0

    def start(self) -> None:
        _raise_fd_limit()
        listen = self.cfg.listen
        old_umask = os.umask(0o177) if listen.startswith("unix:") else None
        try:
            self.port = self._grpc.add_insecure_port(listen)
        except RuntimeError as e:
            raise SystemExit(f"cannot listen on {listen!r}: {e}") from None
        finally:
            if old_umask is not None:
                os.umask(old_umask)
        if self.port == 0 and not listen.startswith("unix:"):
            raise SystemExit(f"cannot listen on {listen!r}: address in use or invalid")
        self.service.port = self.port
        self._grpc.start()
        if listen.startswith("unix:"):
            os.chmod(listen.removeprefix("unix:").removeprefix("//"), 0o600)
        if self.cfg.http_listen:
            host, port = self.cfg.http_listen.rsplit(":", 1)
            try:
                self._http = HttpServer(host.strip("[]"), int(port), self.engine, self.metrics, self.cfg.token)
            except OSError as e:
                self._grpc.stop(0)
                raise SystemExit(f"cannot listen on {self.cfg.http_listen!r} (HTTP): {e.strerror}") from None
            self._http.start()
        if self.cfg.lane_socket:
            path = self.cfg.lane_socket
            if path == "auto":
                path = (
                    listen.removeprefix("unix:").removeprefix("//") + ".lane"
                    if listen.startswith("unix:")
                    else os.path.join(tempfile.gettempdir(), f"kvseal-{self.port}.lane.sock")
                )
            self._lane = LaneServer(
                path,
                self.engine,
                self.metrics,
                token=self.cfg.token,
                group=self.cfg.lane_group,
                max_connections=self.cfg.lane_max_connections,
                idle_timeout_s=self.cfg.lane_idle_timeout_s,
            )
            self._lane.start()
            self.service.lane_socket = path
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._health.set("kvseal.v1.Engine", health_pb2.HealthCheckResponse.SERVING)
        threading.Thread(target=self._tick, name="kvseal-tick", daemon=True).start()

    @property
    def http_port(self) -> int:
        return self._http.port if self._http else 0

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            self.engine.tick()
            if self._lane:
                self._lane.sweep()

    def wait(self) -> None:
        """Blocks until request_stop() (the CLI's SIGTERM/SIGINT handler) is called."""
        self._stop.wait()

    def request_stop(self) -> None:
        self._stop.set()

    def stop(self, grace: float = 1.0) -> None:
        self._stop.set()
        self._health.enter_graceful_shutdown()
        self._grpc.stop(grace).wait()
        if self._lane:
            self._lane.stop()
        if self._http:
            self._http.stop()


def _raise_fd_limit() -> None:
    """Every lane session holds a descriptor and every mapped memfd one more: take the hard limit (default soft
    limits are often 1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            log.warning("cannot raise the open-file limit from %d to %d", soft, hard)
