"""The gRPC service: decode, call the engine, encode (kvseal.rpc.handler answers errors from kvseal.errors'
table, as the lane does)."""

from __future__ import annotations

import logging

import grpc

from kvseal import __version__, auth
from kvseal.engine.engine import Caller, Engine
from kvseal.errors import PermissionDenied, Unavailable
from kvseal.limits import (
    MAX_BLOCKS_PER_REQUEST,
    MAX_DESCRIPTOR_BYTES,
    MAX_INSTANCE_ID_CHARS,
    MAX_NAMESPACE_FINAL_CHARS,
    MAX_REQUEST_ID_CHARS,
    check_length,
)
from kvseal.proto import kvseal_pb2 as pb
from kvseal.proto import kvseal_pb2_grpc as pb_grpc
from kvseal.rpc import handler
from kvseal.server.lane_server import encode_status
from kvseal.server.metrics import Metrics

log = logging.getLogger("kvseal.server")


class EngineService(pb_grpc.EngineServicer):
    """Info, Query and Release. Who may call: with a token, its holders (checked by the server's interceptor);
    without one, on a unix socket (mode 0600) the engine's user, and over loopback TCP the engine's user and root,
    identified from the kernel's socket table. Info is open: it names the lane, where the kernel names every peer."""

    rpc_where = "the engine"

    def __init__(self, engine: Engine, metrics: Metrics, *, token: bool = False, unix: bool = False) -> None:
        self.engine = engine
        self.metrics = metrics
        self.observe_rpc = metrics.observe_rpc
        self.lane_socket = ""  # set by the server once the local lane listens
        self.port = 0  # set by the server once it listens on TCP
        self.node_id = ""  # set by the server when it has a MetaServer
        self._trusted = token or unix

    def _caller(self, context: grpc.ServicerContext) -> Caller:
        if self._trusted:
            return Caller(uid=None, privileged=True)
        address = auth.parse_grpc_peer(context.peer())
        uid = auth.tcp_peer_uid(address[0], address[1], self.port) if address else None
        if not auth.local_uid_allowed(uid):
            raise PermissionDenied(
                f"tokenless TCP serves only the engine's user and root (this peer: uid {uid}): workers use the local "
                "lane (its socket is in Info), other clients the token (kvseal serve --token)"
            )
        return Caller(uid=uid, privileged=True)

    @handler
    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        if not self.lane_socket:  # the server listens only once the lane serves: this is a bug, not a race
            raise Unavailable("the engine is starting: its lane does not serve yet; ask again")
        return pb.InfoResponse(
            version=__version__,
            pool_bytes=self.engine.pool_bytes,
            lane_socket=self.lane_socket,
            node_id=self.node_id,
        )

    @handler
    def Describe(self, request: pb.DescribeRequest, context: grpc.ServicerContext) -> pb.InstanceStatus:
        check_length("instance_id", request.instance_id, MAX_INSTANCE_ID_CHARS)
        self._caller(context)
        return encode_status(self.engine.status(request.instance_id))

    @handler
    def Query(self, request: pb.QueryRequest, context: grpc.ServicerContext) -> pb.QueryResponse:
        check_length("instance_id", request.instance_id, MAX_INSTANCE_ID_CHARS)
        check_length("request_id", request.request_id, MAX_REQUEST_ID_CHARS)
        check_length("block_hashes", request.block_hashes, MAX_BLOCKS_PER_REQUEST)  # each hash: the engine
        r = self.engine.query(
            request.instance_id,
            request.block_hashes,
            self._caller(context),
            request.lease_ttl_ms,
            request.request_id,
            request.max_tokens,
        )
        return pb.QueryResponse(
            hits=r.hits,
            lease_id=r.lease_id,
            loading=r.loading,
            namespace_final=r.namespace_final,
            lease_ttl_ms=r.lease_ttl_ms,
        )

    @handler
    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        check_length("instance_id", request.instance_id, MAX_INSTANCE_ID_CHARS)
        self.engine.release(request.instance_id, request.lease_id, self._caller(context))
        return pb.ReleaseResponse()

    @handler
    def Compare(self, request: pb.CompareRequest, context: grpc.ServicerContext) -> pb.CompareResponse:
        check_length("namespace_final", request.namespace_final, MAX_NAMESPACE_FINAL_CHARS)
        check_length("other_namespace_final", request.other_namespace_final, MAX_NAMESPACE_FINAL_CHARS)
        check_length("other_descriptor", request.other_descriptor, MAX_DESCRIPTOR_BYTES)
        self._caller(context)  # layouts name every tenant's models: privileged callers only, as /v1/namespaces
        diffs, message = self.engine.compare(
            request.namespace_final, request.other_namespace_final, request.other_descriptor
        )
        return pb.CompareResponse(
            compatible=not diffs,
            message=message,
            differences=[
                pb.LayoutDifference(field=d.field, layer=d.layer, left=_text(d.left), right=_text(d.right))
                for d in diffs
            ],
        )


def _text(value: object) -> str:
    return "" if value is None else str(value)
