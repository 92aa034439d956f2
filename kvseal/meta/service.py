"""The MetaServer's gRPC service (kvseal.v1.MetaServer): its RPCs over a store (kvseal.meta.store), each request
validated first (kvseal.meta.checks).

Who may call: loopback only unless --allow-remote with a token (like the engine); with a token every RPC needs it
(kvseal.auth.token_interceptor, installed by kvseal.meta.server). Without a token, over TCP only the MetaServer's
own user and root (the socket owner of a loopback client, as the engine identifies its tokenless TCP clients:
kvseal.auth), on a unix socket (mode 0600) its own user. A node id belongs to one live session: another session's
heartbeat is refused (ALREADY_EXISTS) until the current one unregisters or goes stale.

Bounded work: requests are validated before the store is touched; a MemoryStore is used under one lock (a FIFO
lock: a waiting request goes before the holder's next step, kvseal.meta.fairlock), and large batches are applied
in steps of STEP_BLOCKS blocks (a QueryPrefix in steps of QUERY_STEP hashes), the lock handed over between steps; a
dropped node's blocks are cleaned up by the maintenance thread in such steps too. Nodes, blocks per node and blocks
in all are capped (--max-nodes, --max-blocks-per-node, --max-blocks): past a cap the request is
RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from prometheus_client import CollectorRegistry, Gauge, Histogram

from kvseal.auth import local_uid_allowed, parse_grpc_peer, tcp_peer_uid
from kvseal.errors import AlreadyExists, FailedPrecondition, PermissionDenied, ResourceExhausted, Unavailable, quote
from kvseal.meta.checks import check_address, check_blocks, check_hashes, check_namespace, check_node
from kvseal.meta.config import MetaConfig, reason, redacted
from kvseal.meta.fairlock import FairLock
from kvseal.meta.store import Block, MetaStore, NodeHeld, NodeHit, StoreFull
from kvseal.proto import kvseal_pb2 as pb
from kvseal.proto import kvseal_pb2_grpc as pb_grpc
from kvseal.rpc import handler

log = logging.getLogger("kvseal.metaserver")
STEP_BLOCKS = 4096  # blocks applied per hold of the store's lock (about 1-2 ms of a MemoryStore)
QUERY_STEP = 8192  # hashes of a QueryPrefix looked up per hold
F = TypeVar("F", bound=Callable[..., Any])


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
            raise Unavailable(f"the MetaServer's store is unreachable: {reason(e)}") from None
        self.store_reached()
        return answer

    return wrapper  # type: ignore[return-value]


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
            self._store_down = reason(e)
        if first:
            log.warning(
                "store %s unreachable (%s): RPCs answer UNAVAILABLE and /health 503 until it is back",
                redacted(self.cfg.store),
                reason(e),
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
            return f"the store {redacted(self.cfg.store)} is unreachable: {reason(e)}"
        self.store_reached()
        return None

    # ---------------------------------------------------------------- requests

    def _in_steps(self, request: pb.BlocksRequest, apply: Callable[[list[Block]], int]) -> pb.BlocksResponse:
        """Applies the request's blocks STEP_BLOCKS at a time, the lock handed over between steps."""
        blocks = check_blocks(request)
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
        check_node(request.node_id, request.session)
        check_address(request.address)
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
        check_namespace("namespace_final", request.namespace_final)
        with self._one_bulk_at_a_time(len(request.block_hashes)):
            hashes = check_hashes("block_hashes", request.block_hashes)
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
        check_node(request.node_id, request.session)
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
