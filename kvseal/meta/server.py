"""`kvseal metaserver`: the MetaServer process. gRPC (kvseal.v1.MetaServer) over a store (kvseal.meta.store), plus
HTTP /health and /metrics. Every request is validated here, with the field named in the error (a client's value is
quoted a few dozen characters at most: kvseal.errors.quote); the store sees only well-formed input. Time is this
process's monotonic clock with the memory store and the wall clock with Redis (replicas on several machines must
agree on what "stale" means).

Who may call: loopback only unless --allow-remote with a token (like the engine); with a token every RPC and HTTP
path but /health needs it. Without a token, over TCP only the MetaServer's own user and root (the socket owner of
a loopback client, as the engine identifies its tokenless TCP clients: kvseal.auth), on a unix socket
(mode 0600) its own user. A node id belongs to one live session: another session's heartbeat is refused
(ALREADY_EXISTS) until the current one unregisters or goes stale.

Bounded work: requests are validated before the store is touched; a MemoryStore is used under one lock (a FIFO
lock: a waiting request goes before the holder's next step), and large batches are applied in steps of
STEP_BLOCKS blocks (a QueryPrefix in steps of QUERY_STEP hashes), the lock handed over between steps; a dropped
node's blocks are cleaned up by the maintenance thread in such steps too. Nodes, blocks per node and blocks in all
are capped (--max-nodes, --max-blocks-per-node, --max-blocks): past a cap the request is RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import json
import logging
import os
import re
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

import grpc
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, Histogram, generate_latest

from kvseal.auth import local_uid_allowed, parse_grpc_peer, tcp_peer_uid, token_interceptor
from kvseal.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
    quote,
)
from kvseal.limits import (
    MAX_ADDRESS_CHARS,
    MAX_BLOCKS_PER_REQUEST,
    MAX_HASH_BYTES,
    MAX_NAMESPACE_FINAL_CHARS,
    MAX_NAMESPACES_PER_REQUEST,
    MAX_NODE_ID_CHARS,
)
from kvseal.meta.store import Block, MemoryStore, MetaStore, NodeHeld, NodeHit, StoreFull
from kvseal.proto import kvseal_pb2 as pb
from kvseal.proto import kvseal_pb2_grpc as pb_grpc
from kvseal.rpc import handler

log = logging.getLogger("kvseal.metaserver")
_ID_RE = re.compile(r"^[A-Za-z0-9._:@+=/-]+$")  # lengths are checked first
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9._:/@+=-]+$")
STEP_BLOCKS = 4096  # blocks applied per hold of the store's lock (about 1-2 ms of a MemoryStore)
QUERY_STEP = 8192  # hashes of a QueryPrefix looked up per hold
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True, slots=True)
class MetaConfig:
    listen: str = "127.0.0.1:50056"
    http_listen: str = "127.0.0.1:9092"
    store: str = "memory"  # or redis://HOST:PORT/DB
    stale_after_s: float = 10.0
    forget_after_s: float = 60.0
    token: str | None = None
    max_nodes: int = 4096
    max_blocks_per_node: int = 1 << 21
    max_blocks: int = 1 << 23  # every node's together (a MemoryStore needs ~0.6 KB per block)


def redacted(url: str) -> str:
    """A store URL without its password, for messages and logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def open_store(spec: str) -> tuple[MetaStore, Callable[[], float]]:
    """The store named by `spec` and the clock that goes with it."""
    if spec == "memory":
        return MemoryStore(), time.monotonic
    if spec.startswith("redis://"):
        from kvseal.meta.redis_store import RedisStore

        try:
            return RedisStore(spec), time.time
        except ConnectionError as e:
            parts = urllib.parse.urlsplit(spec)
            raise Unavailable(
                f"cannot reach Redis at {redacted(spec)} (--store): {_reason(e)}: start redis-server there (e.g. "
                f"`redis-server --port {parts.port or 6379}`, from Debian's redis-server package), or pass "
                "--store memory"
            ) from None
    raise InvalidArgument(f"--store must be 'memory' or redis://HOST:PORT/DB, got {quote(spec)}")


def _reason(e: BaseException) -> str:
    """The first line of an error, without redis' class-name prefixes."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.removeprefix("ConnectionError: ").removeprefix("TimeoutError: ").rstrip(".")


class FairLock:
    """A FIFO lock that measures its holds: a releasing holder hands it to the longest waiter, so a thread applying
    a batch in steps cannot take it straight back while a small request waits."""

    def __init__(self, on_hold: Callable[[float], None] = lambda seconds: None) -> None:
        self._mutex = threading.Lock()
        self._waiters: deque[threading.Lock] = deque()
        self._held = False
        self._since = 0.0
        self._on_hold = on_hold
        self.longest_s = 0.0  # the longest hold since start

    def acquire(self) -> None:
        with self._mutex:
            if not self._held:
                self._held = True
                self._since = time.perf_counter()
                return
            waiter = threading.Lock()
            waiter.acquire()
            self._waiters.append(waiter)
        waiter.acquire()  # released by the holder that hands the lock over
        self._since = time.perf_counter()

    def release(self) -> None:
        held_s = time.perf_counter() - self._since
        with self._mutex:
            self.longest_s = max(self.longest_s, held_s)
            if self._waiters:
                self._waiters.popleft().release()
            else:
                self._held = False
        self._on_hold(held_s)

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _rpc(method: F) -> F:
    """kvseal.rpc.handler, after the caller is checked; the store's health is noted from how the call went: a
    ConnectionError is the store being down (RedisStore raises StoreUnavailable, one), not the request."""

    @handler
    @functools.wraps(method)
    def wrapper(self: MetaService, request: Any, context: grpc.ServicerContext) -> Any:
        self._check_caller(context)
        try:
            answer = method(self, request, context)
        except ConnectionError as e:
            self.store_failed(e)
            raise Unavailable(f"the MetaServer's store is unreachable: {_reason(e)}") from None
        self.store_reached()
        return answer

    return wrapper  # type: ignore[return-value]


def _check_id(field: str, value: str) -> None:
    if len(value) > MAX_NODE_ID_CHARS or not _ID_RE.match(value):
        raise InvalidArgument(
            f"{field} must be 1..{MAX_NODE_ID_CHARS} characters of [A-Za-z0-9._:@+=/-], got {quote(value)}"
        )


def _check_node(node_id: str, session: str) -> None:
    _check_id("node_id", node_id)
    _check_id("session", session)


def _check_address(address: str) -> None:
    host, _, port = address.rpartition(":")
    if len(address) > MAX_ADDRESS_CHARS or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(
            f"address must be HOST:PORT of at most {MAX_ADDRESS_CHARS} characters, got {quote(address)}"
        )


def _check_hashes(field: str, hashes: Any) -> list[bytes]:
    if len(hashes) > MAX_BLOCKS_PER_REQUEST:
        raise InvalidArgument(f"{field}: at most {MAX_BLOCKS_PER_REQUEST} per request, got {len(hashes)}")
    out = list(hashes)  # a repeated field builds a new bytes object at every access: walked once
    if out and (min(map(len, out)) == 0 or max(map(len, out)) > MAX_HASH_BYTES):
        i = next(i for i, h in enumerate(out) if not 0 < len(h) <= MAX_HASH_BYTES)
        raise InvalidArgument(f"{field}[{i}] must be 1..{MAX_HASH_BYTES} bytes, got {len(out[i])}")
    return out


def _check_namespace(field: str, namespace: str) -> None:
    if len(namespace) > MAX_NAMESPACE_FINAL_CHARS or not _NAMESPACE_RE.match(namespace):
        raise InvalidArgument(f"{field} must be a final namespace (namespace.fingerprint), got {quote(namespace)}")


class MetaService(pb_grpc.MetaServerServicer):
    rpc_where = "the MetaServer"

    def __init__(self, cfg: MetaConfig, store: MetaStore, clock: Callable[[], float], registry: CollectorRegistry):
        self.cfg = cfg
        self.store = store
        self.clock = clock
        self.rpc_seconds = Histogram(
            "kvseal_meta_rpc_seconds", "MetaServer RPC latency", ["method", "code"], registry=registry
        )
        holds = Histogram(
            "kvseal_meta_lock_hold_seconds",
            "How long one step held the memory store's lock",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=registry,
        )
        # one request (or one step of a large one) at a time on a MemoryStore: its multi-step changes stay whole.
        # A RedisStore's calls are atomic scripts already: replicas on other machines do not share a lock anyway.
        self._fair = FairLock(holds.observe)
        self.lock: contextlib.AbstractContextManager[Any] = contextlib.nullcontext() if store.threadsafe else self._fair
        longest = Gauge(
            "kvseal_meta_lock_hold_max_seconds", "The longest hold of the memory store's lock", registry=registry
        )
        longest.set_function(lambda: self._fair.longest_s)
        # requests of more than a step (validated and applied in Python, the GIL held) go one at a time: more of them
        # at once would not finish sooner, and would take the GIL from the small ones (heartbeats, lookups)
        self._bulk = threading.Semaphore(1)
        self.port = 0  # the TCP port gRPC listens on (set by MetaServer.start)
        self.trusted = cfg.token is not None or cfg.listen.startswith("unix:")  # token checked, or a 0600 socket
        self.wake = threading.Event()  # set when a dropped node's blocks wait for collect()
        self._store_down: str | None = None
        self._store_lock = threading.Lock()

    # ---------------------------------------------------------------- who calls, and the store's health

    def observe_rpc(self, method: str, status: str, seconds: float) -> None:
        self.rpc_seconds.labels(method, status).observe(seconds)

    def _check_caller(self, context: grpc.ServicerContext) -> None:
        if self.trusted:
            return
        address = parse_grpc_peer(context.peer())
        uid = tcp_peer_uid(address[0], address[1], self.port) if address else None
        if not local_uid_allowed(uid):
            who = "a client whose uid could not be found" if uid is None else f"uid {uid}"
            raise PermissionDenied(
                f"without a token the MetaServer serves only its own user (uid {os.getuid()}) and root, and this "
                f"caller is {who}: run the engines as one of those, or start the MetaServer and every engine with "
                "the same --token"
            )

    def store_failed(self, e: BaseException) -> None:
        """Notes that the store is unreachable; logs once per outage."""
        with self._store_lock:
            first = self._store_down is None
            self._store_down = _reason(e)
        if first:
            log.warning(
                "store %s unreachable (%s): RPCs answer UNAVAILABLE and /health 503 until it is back",
                redacted(self.cfg.store),
                _reason(e),
            )

    def store_reached(self) -> None:
        if self._store_down is None:
            return
        with self._store_lock:
            was, self._store_down = self._store_down, None
        if was is not None:
            log.warning("store %s reachable again", redacted(self.cfg.store))

    def store_error(self) -> str | None:
        """Why the store cannot be reached now (asked of it), or None when it answers."""
        try:
            self.store.ping()
        except ConnectionError as e:
            self.store_failed(e)
            return f"the store {redacted(self.cfg.store)} is unreachable: {_reason(e)}"
        self.store_reached()
        return None

    # ---------------------------------------------------------------- requests

    def _blocks(self, request: pb.BlocksRequest) -> list[Block]:
        _check_node(request.node_id, request.session)
        groups = request.blocks
        if len(groups) > MAX_NAMESPACES_PER_REQUEST:
            raise InvalidArgument(
                f"blocks: at most {MAX_NAMESPACES_PER_REQUEST} namespaces per request, got {len(groups)}"
            )
        total = sum(len(group.block_hashes) for group in groups)
        if total > MAX_BLOCKS_PER_REQUEST:
            raise InvalidArgument(f"blocks: at most {MAX_BLOCKS_PER_REQUEST} hashes per request, got {total}")
        out: list[Block] = []
        for i, group in enumerate(groups):
            ns = group.namespace_final
            _check_namespace(f"blocks[{i}].namespace_final", ns)
            out += [(ns, h) for h in _check_hashes(f"blocks[{i}].block_hashes", group.block_hashes)]
        return out

    def _in_steps(self, request: pb.BlocksRequest, apply: Callable[[list[Block]], int]) -> pb.BlocksResponse:
        """Applies the request's blocks STEP_BLOCKS at a time, the lock handed over between steps."""
        blocks = self._blocks(request)
        changed = 0
        for i in range(0, max(len(blocks), 1), STEP_BLOCKS):
            try:
                with self.lock:
                    n = apply(blocks[i : i + STEP_BLOCKS])
            except StoreFull as e:
                raise ResourceExhausted(self._full(e, request.node_id, i)) from None
            if n < 0:
                raise FailedPrecondition(
                    f"session {quote(request.session)} of node {quote(request.node_id)} is not known here (the "
                    "MetaServer restarted, or the node went stale): heartbeat, then announce every resident block "
                    "again"
                )
            changed += n
        return pb.BlocksResponse(changed=changed)

    def _full(self, e: StoreFull, node_id: str, applied: int) -> str:
        done = f" ({applied} of this request's blocks were recorded before)" if applied else ""
        if e.cap == "nodes":
            return (
                f"the MetaServer knows --max-nodes {e.limit} nodes already: node {quote(node_id)} is refused until one "
                "unregisters or is forgotten (--forget-after), or the MetaServer runs with a larger --max-nodes"
            )
        if e.cap == "blocks_per_node":
            return (
                f"node {quote(node_id)} would hold more than --max-blocks-per-node {e.limit} blocks: refused{done}; "
                "withdraw some, or run the MetaServer with a larger --max-blocks-per-node"
            )
        return (
            f"the MetaServer would hold more than --max-blocks {e.limit} blocks of all nodes together: refused{done}; "
            "run it with a larger --max-blocks (a memory store needs ~0.6 KB per block)"
        )

    @_rpc
    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        _check_node(request.node_id, request.session)
        _check_address(request.address)
        now = self.clock()
        try:
            with self.lock:
                new = self.store.heartbeat(
                    request.node_id,
                    request.session,
                    request.address,
                    now,
                    self.cfg.stale_after_s,
                    max_nodes=self.cfg.max_nodes,
                )
                epoch = self.store.epoch
        except NodeHeld as e:
            raise AlreadyExists(
                f"node_id {quote(request.node_id)} is held by another live session (at {quote(e.address)}, stale in "
                f"{max(0.0, e.expires - now):.1f} s unless it heartbeats again): two engines share this node id "
                "(give each its own --node-id), or a restarted engine's predecessor has not gone stale yet (it does "
                f"after {self.cfg.stale_after_s:g} s without a heartbeat, the MetaServer's --stale-after)"
            ) from None
        except StoreFull as e:
            raise ResourceExhausted(self._full(e, request.node_id, 0)) from None
        if new:
            self.wake.set()  # an old session of the node may have left blocks to clean up
            log.info("node %s (session %s) at %s", request.node_id, request.session, request.address)
        return pb.HeartbeatResponse(epoch=epoch, stale_after_ms=int(self.cfg.stale_after_s * 1000), new_session=new)

    def _one_bulk_at_a_time(self, size: int) -> contextlib.AbstractContextManager[Any]:
        return self._bulk if size > STEP_BLOCKS else contextlib.nullcontext()

    @_rpc
    def Announce(self, request: pb.BlocksRequest, context: grpc.ServicerContext) -> pb.BlocksResponse:
        node_id, session, cfg = request.node_id, request.session, self.cfg
        with self._one_bulk_at_a_time(sum(len(group.block_hashes) for group in request.blocks)):
            return self._in_steps(
                request,
                lambda blocks: self.store.announce(
                    node_id, session, blocks, max_node=cfg.max_blocks_per_node, max_total=cfg.max_blocks
                ),
            )

    @_rpc
    def Withdraw(self, request: pb.BlocksRequest, context: grpc.ServicerContext) -> pb.BlocksResponse:
        node_id, session = request.node_id, request.session
        with self._one_bulk_at_a_time(sum(len(group.block_hashes) for group in request.blocks)):
            return self._in_steps(request, lambda blocks: self.store.withdraw(node_id, session, blocks))

    @_rpc
    def QueryPrefix(self, request: pb.QueryPrefixRequest, context: grpc.ServicerContext) -> pb.QueryPrefixResponse:
        _check_namespace("namespace_final", request.namespace_final)
        with self._one_bulk_at_a_time(len(request.block_hashes)):
            hashes = _check_hashes("block_hashes", request.block_hashes)
            hits = self._query(request.namespace_final, hashes, self.clock())
        return pb.QueryPrefixResponse(
            nodes=[pb.NodePrefix(node_id=h.node_id, address=h.address, prefix=h.prefix) for h in hits]
        )

    def _query(self, namespace_final: str, hashes: list[bytes], now: float) -> list[NodeHit]:
        """query_prefix QUERY_STEP hashes at a time: a node's prefix goes on into the next step only while it held
        the whole of the previous one."""
        found: dict[str, NodeHit] = {}
        going: set[str] | None = None  # nodes that held every hash so far (None: all, at the first step)
        for i in range(0, len(hashes), QUERY_STEP):
            step = hashes[i : i + QUERY_STEP]
            with self.lock:
                hits = self.store.query_prefix(namespace_final, step, now)
            still: set[str] = set()
            for hit in hits:
                if going is not None and hit.node_id not in going:
                    continue
                before = found[hit.node_id].prefix if hit.node_id in found else 0
                found[hit.node_id] = NodeHit(hit.node_id, hit.address, before + hit.prefix)
                if hit.prefix == len(step):
                    still.add(hit.node_id)
            going = still
            if not going:
                break
        return sorted(found.values(), key=lambda hit: (-hit.prefix, hit.node_id))

    @_rpc
    def Unregister(self, request: pb.UnregisterNodeRequest, context: grpc.ServicerContext) -> pb.UnregisterNodeResponse:
        _check_node(request.node_id, request.session)
        with self.lock:
            removed = self.store.unregister(request.node_id, request.session)
        if removed:
            self.wake.set()
        return pb.UnregisterNodeResponse(removed=removed)

    @_rpc
    def ListNodes(self, request: pb.ListNodesRequest, context: grpc.ServicerContext) -> pb.ListNodesResponse:
        now = self.clock()
        with self.lock:
            nodes = self.store.nodes(now)
        return pb.ListNodesResponse(
            nodes=[
                pb.NodeStatus(
                    node_id=n.node_id,
                    address=n.address,
                    expires_in_ms=max(0, int((n.expires - now) * 1000)),
                    blocks=n.blocks,
                )
                for n in nodes
            ]
        )

    # ---------------------------------------------------------------- maintenance

    def purge(self) -> None:
        with self.lock:
            forgotten = self.store.purge(self.clock(), self.cfg.forget_after_s)
        if forgotten:
            self.wake.set()
            log.info("forgot %d nodes silent for %.0f s past their staleness", forgotten, self.cfg.forget_after_s)

    def collect(self) -> None:
        """Cleans up dropped nodes' blocks, STEP_BLOCKS per hold of the lock."""
        more = True
        while more:
            with self.lock:
                more = self.store.collect(STEP_BLOCKS)


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

        self._grpc = grpc.server(
            futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="kvseal-meta"),
            interceptors=[token_interceptor(cfg.token)] if cfg.token else [],
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
        unix = self.cfg.listen.startswith("unix:")
        old_umask = os.umask(0o177) if unix else None  # the socket is this user's only (it is trusted, no token)
        try:
            self.port = self._grpc.add_insecure_port(self.cfg.listen)
        except RuntimeError:
            self.port = 0
        finally:
            if old_umask is not None:
                os.umask(old_umask)
        if self.port == 0:
            raise Unavailable(f"cannot listen on {quote(self.cfg.listen)} (--listen): in use? pass another --listen")
        self.service.port = self.port
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
        threading.Thread(target=self._maintain, name="kvseal-meta-maintain", daemon=True).start()

    def _maintain(self) -> None:
        """Every second: forget nodes silent past --forget-after; and, whenever woken, clean up dropped nodes'
        blocks in steps."""
        next_purge = time.monotonic() + 1.0
        while not self._stop.is_set():
            self.service.wake.wait(max(0.0, next_purge - time.monotonic()))
            self.service.wake.clear()
            if self._stop.is_set():
                return
            try:
                if time.monotonic() >= next_purge:
                    next_purge = time.monotonic() + 1.0
                    self.service.purge()
                    self.service.store_reached()
                self.service.collect()
            except ConnectionError as e:
                self.service.store_failed(e)

    @property
    def http_port(self) -> int:
        return self._http.server_address[1] if self._http else 0

    def wait(self) -> None:
        self._stop.wait()

    def request_stop(self) -> None:
        self._stop.set()

    def stop(self) -> None:
        self._stop.set()
        self.service.wake.set()
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
        if path != "/health" and not self._allowed(path):
            return
        if path == "/health":
            error = self.server_ref.service.store_error()
            if error is None:
                self._send(200, "application/json", b'{"status":"ok"}')
            else:
                self._send(503, "application/json", json.dumps({"status": "unavailable", "error": error}).encode())
        elif path == "/metrics":
            self._send(200, CONTENT_TYPE_LATEST, generate_latest(self.server_ref.registry))
        else:
            self._send(404, "application/json", b'{"error":"no such path"}')

    def _allowed(self, path: str) -> bool:
        """With a token: the token. Without: the MetaServer's user and root only (as gRPC)."""
        token = self.server_ref.cfg.token
        if token is not None:
            given = self.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                self._send(401, "application/json", b'{"error":"missing or wrong bearer token"}')
                return False
            return True
        host, port = self.client_address[:2]
        server_host, server_port = self.connection.getsockname()[:2]
        uid = tcp_peer_uid(host, port, server_port, server_host=server_host)
        if local_uid_allowed(uid):
            return True
        who = "this client's uid could not be found" if uid is None else f"this client is uid {uid}"
        message = (
            f"without a token, {path} is only for the MetaServer's user (uid {os.getuid()}) and root, and {who}: run "
            "the client as one of those, or start the MetaServer with --token and send 'Authorization: Bearer <token>'"
        )
        self._send(403, "application/json", json.dumps({"error": message}).encode())
        return False

    def _send(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
