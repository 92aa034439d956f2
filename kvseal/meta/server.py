"""`kvseal metaserver`: the MetaServer process. gRPC (kvseal.v1.MetaServer) over a store (kvseal.meta.store), plus
HTTP /health and /metrics. Every request is validated here, with the field named in the error; the store sees
only well-formed input. Time is this process's monotonic clock with the memory store and the wall clock with
Redis (replicas on several machines must agree on what "stale" means).

Who may call: loopback only unless --allow-remote with a token (like the engine); with a token every RPC and HTTP
path but /health needs it.
"""

from __future__ import annotations

import functools
import hmac
import logging
import re
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

import grpc
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, Histogram, generate_latest

from kvseal.errors import FailedPrecondition, InvalidArgument, KvsealError, Unavailable
from kvseal.limits import MAX_BLOCKS_PER_REQUEST, MAX_HASH_BYTES
from kvseal.meta.store import Block, MemoryStore, MetaStore
from kvseal.proto import kvseal_pb2 as pb
from kvseal.proto import kvseal_pb2_grpc as pb_grpc

log = logging.getLogger("kvseal.metaserver")
_ID_RE = re.compile(r"^[A-Za-z0-9._:@+=/-]{1,256}$")
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9._:/@+=-]{1,512}$")
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True, slots=True)
class MetaConfig:
    listen: str = "127.0.0.1:50056"
    http_listen: str = "127.0.0.1:9092"
    store: str = "memory"  # or redis://HOST:PORT/DB
    stale_after_s: float = 10.0
    forget_after_s: float = 60.0
    token: str | None = None


def open_store(spec: str) -> tuple[MetaStore, Callable[[], float]]:
    """The store named by `spec` and the clock that goes with it."""
    if spec == "memory":
        return MemoryStore(), time.monotonic
    if spec.startswith("redis://"):
        from kvseal.meta.redis_store import RedisStore

        return RedisStore(spec), time.time
    raise InvalidArgument(f"--store must be 'memory' or redis://HOST:PORT/DB, got {spec!r}")


def _rpc(method: F) -> F:
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self: MetaService, request: Any, context: grpc.ServicerContext) -> Any:
        start = time.perf_counter()
        code = "OK"
        try:
            with self.lock:
                return method(self, request, context)
        except KvsealError as e:
            code = e.status
            context.abort(getattr(grpc.StatusCode, e.status), str(e))
        except ConnectionError as e:  # RedisStore raises StoreUnavailable, one: the store is down, not the request
            code = "UNAVAILABLE"
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the MetaServer's store is unreachable: {e}")
        except Exception as e:
            code = "INTERNAL"
            log.exception("%s failed", name)
            context.abort(grpc.StatusCode.INTERNAL, f"{name} failed inside the MetaServer: {type(e).__name__}: {e}")
        finally:
            self.rpc_seconds.labels(name, code).observe(time.perf_counter() - start)

    return wrapper  # type: ignore[return-value]


def _check_node(node_id: str, session: str) -> None:
    if not _ID_RE.match(node_id):
        raise InvalidArgument(f"node_id must be 1..256 characters of [A-Za-z0-9._:@+=/-], got {node_id!r}")
    if not _ID_RE.match(session):
        raise InvalidArgument(f"session must be 1..256 characters of [A-Za-z0-9._:@+=/-], got {session!r}")


def _check_hashes(field: str, hashes: Any) -> list[bytes]:
    if len(hashes) > MAX_BLOCKS_PER_REQUEST:
        raise InvalidArgument(f"{field}: at most {MAX_BLOCKS_PER_REQUEST} per request, got {len(hashes)}")
    out = list(hashes)  # a repeated field builds a new bytes object at every access: walked once
    if out and (min(map(len, out)) == 0 or max(map(len, out)) > MAX_HASH_BYTES):
        i = next(i for i, h in enumerate(out) if not 0 < len(h) <= MAX_HASH_BYTES)
        raise InvalidArgument(f"{field}[{i}] must be 1..{MAX_HASH_BYTES} bytes, got {len(out[i])}")
    return out


def _check_namespace(field: str, namespace: str) -> None:
    if not _NAMESPACE_RE.match(namespace):
        raise InvalidArgument(f"{field} must be a final namespace (namespace.fingerprint), got {namespace!r}")


class MetaService(pb_grpc.MetaServerServicer):
    def __init__(self, cfg: MetaConfig, store: MetaStore, clock: Callable[[], float], registry: CollectorRegistry):
        self.cfg = cfg
        self.store = store
        self.clock = clock
        self.lock = threading.Lock()  # one request at a time on the store: its multi-step changes stay whole
        self.rpc_seconds = Histogram(
            "kvseal_meta_rpc_seconds", "MetaServer RPC latency", ["method", "code"], registry=registry
        )

    def _blocks(self, request: pb.BlocksRequest) -> list[Block]:
        _check_node(request.node_id, request.session)
        out: list[Block] = []
        for i, group in enumerate(request.blocks):
            _check_namespace(f"blocks[{i}].namespace_final", group.namespace_final)
            out += [(group.namespace_final, h) for h in _check_hashes(f"blocks[{i}].block_hashes", group.block_hashes)]
        if len(out) > MAX_BLOCKS_PER_REQUEST:
            raise InvalidArgument(f"blocks: at most {MAX_BLOCKS_PER_REQUEST} hashes per request, got {len(out)}")
        return out

    @_rpc
    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        _check_node(request.node_id, request.session)
        host, _, port = request.address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536 or len(request.address) > 256:
            raise InvalidArgument(f"address must be HOST:PORT, got {request.address!r}")
        new = self.store.heartbeat(
            request.node_id, request.session, request.address, self.clock(), self.cfg.stale_after_s
        )
        if new:
            log.info("node %s (session %s) at %s", request.node_id, request.session, request.address)
        return pb.HeartbeatResponse(
            epoch=self.store.epoch, stale_after_ms=int(self.cfg.stale_after_s * 1000), new_session=new
        )

    def _changed(self, n: int, request: pb.BlocksRequest) -> pb.BlocksResponse:
        if n < 0:
            raise FailedPrecondition(
                f"session {request.session!r} of node {request.node_id!r} is not known here (the MetaServer "
                "restarted, or the node went stale): heartbeat, then announce every resident block again"
            )
        return pb.BlocksResponse(changed=n)

    @_rpc
    def Announce(self, request: pb.BlocksRequest, context: grpc.ServicerContext) -> pb.BlocksResponse:
        blocks = self._blocks(request)
        return self._changed(self.store.announce(request.node_id, request.session, blocks), request)

    @_rpc
    def Withdraw(self, request: pb.BlocksRequest, context: grpc.ServicerContext) -> pb.BlocksResponse:
        blocks = self._blocks(request)
        return self._changed(self.store.withdraw(request.node_id, request.session, blocks), request)

    @_rpc
    def QueryPrefix(self, request: pb.QueryPrefixRequest, context: grpc.ServicerContext) -> pb.QueryPrefixResponse:
        _check_namespace("namespace_final", request.namespace_final)
        hashes = _check_hashes("block_hashes", request.block_hashes)
        hits = self.store.query_prefix(request.namespace_final, hashes, self.clock())
        return pb.QueryPrefixResponse(
            nodes=[pb.NodePrefix(node_id=h.node_id, address=h.address, prefix=h.prefix) for h in hits]
        )

    @_rpc
    def Unregister(self, request: pb.UnregisterNodeRequest, context: grpc.ServicerContext) -> pb.UnregisterNodeResponse:
        _check_node(request.node_id, request.session)
        return pb.UnregisterNodeResponse(removed=self.store.unregister(request.node_id, request.session))

    @_rpc
    def ListNodes(self, request: pb.ListNodesRequest, context: grpc.ServicerContext) -> pb.ListNodesResponse:
        now = self.clock()
        return pb.ListNodesResponse(
            nodes=[
                pb.NodeStatus(
                    node_id=n.node_id,
                    address=n.address,
                    expires_in_ms=max(0, int((n.expires - now) * 1000)),
                    blocks=n.blocks,
                )
                for n in self.store.nodes(now)
            ]
        )

    def purge(self) -> None:
        with self.lock:
            forgotten = self.store.purge(self.clock(), self.cfg.forget_after_s)
        if forgotten:
            log.info("forgot %d nodes silent for %.0f s past their staleness", forgotten, self.cfg.forget_after_s)


class MetaServer:
    """A running MetaServer: `start()` binds and serves, `stop()` ends it."""

    def __init__(self, cfg: MetaConfig) -> None:
        self.cfg = cfg
        self.store, clock = open_store(cfg.store)
        self.registry = CollectorRegistry()
        self.service = MetaService(cfg, self.store, clock, self.registry)
        nodes = Gauge("kvseal_meta_nodes", "Live nodes", registry=self.registry)
        nodes.set_function(lambda: len(self._nodes()))
        blocks = Gauge("kvseal_meta_blocks", "Blocks announced by live nodes", registry=self.registry)
        blocks.set_function(lambda: sum(n.blocks for n in self._nodes()))
        from kvseal.server.serve import _TokenInterceptor

        self._grpc = grpc.server(
            futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="kvseal-meta"),
            interceptors=[_TokenInterceptor(cfg.token)] if cfg.token else [],
            options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 16 << 20)],
        )
        pb_grpc.add_MetaServerServicer_to_server(self.service, self._grpc)
        self._http: ThreadingHTTPServer | None = None
        self._stop = threading.Event()
        self.port = 0

    def _nodes(self) -> list[Any]:
        with self.service.lock:
            try:
                return self.store.nodes(self.service.clock())
            except ConnectionError:
                return []

    def start(self) -> None:
        try:
            self.port = self._grpc.add_insecure_port(self.cfg.listen)
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise Unavailable(f"cannot listen on {self.cfg.listen!r} (--listen): in use? pass another --listen")
        if self.cfg.http_listen:
            host, port = self.cfg.http_listen.rsplit(":", 1)
            handler = type("Handler", (_Handler,), {"server_ref": self})
            try:
                self._http = ThreadingHTTPServer((host.strip("[]"), int(port)), handler)
            except OSError as e:
                raise Unavailable(f"cannot listen on {self.cfg.http_listen!r} (--http-listen): {e.strerror}") from None
            self._http.daemon_threads = True
            threading.Thread(target=self._http.serve_forever, name="kvseal-meta-http", daemon=True).start()
        self._grpc.start()
        threading.Thread(target=self._purge_loop, name="kvseal-meta-purge", daemon=True).start()

    def _purge_loop(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self.service.purge()
            except ConnectionError as e:
                log.warning("store unreachable: %s", e)

    @property
    def http_port(self) -> int:
        return self._http.server_address[1] if self._http else 0

    def wait(self) -> None:
        self._stop.wait()

    def request_stop(self) -> None:
        self._stop.set()

    def stop(self) -> None:
        self._stop.set()
        self._grpc.stop(1.0).wait()
        if self._http:
            self._http.shutdown()
            self._http.server_close()
        self.store.close()


class _Handler(BaseHTTPRequestHandler):
    server_ref: MetaServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        token = self.server_ref.cfg.token
        if path != "/health" and token is not None:
            given = self.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                self._send(401, "application/json", b'{"error":"missing or wrong bearer token"}')
                return
        if path == "/health":
            self._send(200, "application/json", b'{"status":"ok"}')
        elif path == "/metrics":
            self._send(200, CONTENT_TYPE_LATEST, generate_latest(self.server_ref.registry))
        else:
            self._send(404, "application/json", b'{"error":"no such path"}')

    def _send(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
