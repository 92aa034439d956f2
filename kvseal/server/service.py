"""The gRPC service: decode, call the engine, encode. Errors become gRPC statuses here and nowhere else."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from kvseal import __version__
from kvseal.core.layout import LayerGeometry, LayerRegistration, WorkerRegistration, normalize_dtype
from kvseal.engine.engine import Engine, InstanceStatus, WorkerKey
from kvseal.engine.memory import CudaSpec, ShmSpec
from kvseal.errors import InvalidArgument, KvsealError
from kvseal.proto import kvseal_pb2 as pb
from kvseal.proto import kvseal_pb2_grpc as pb_grpc
from kvseal.server.metrics import Metrics

log = logging.getLogger("kvseal.server")
F = TypeVar("F", bound=Callable[..., Any])


def _rpc(method: F) -> F:
    """Maps kvseal errors to statuses, never lets another exception escape unlogged, and times the call."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self: EngineService, request: Any, context: grpc.ServicerContext) -> Any:
        start = time.perf_counter()
        code = "OK"
        try:
            return method(self, request, context)
        except KvsealError as e:
            code = e.status
            context.abort(getattr(grpc.StatusCode, e.status), str(e))
        except Exception as e:  # a bug, not bad input: keep serving, say what broke
            code = "INTERNAL"
            log.exception("%s failed", name)
            context.abort(grpc.StatusCode.INTERNAL, f"{name} failed inside the engine: {type(e).__name__}: {e}")
        finally:
            self.metrics.observe_rpc(name, code, time.perf_counter() - start)

    return wrapper  # type: ignore[return-value]


class EngineService(pb_grpc.EngineServicer):
    def __init__(self, engine: Engine, metrics: Metrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.lane_socket = ""  # set by the server once the local lane listens
        self._sessions: set[threading.Event] = set()
        self._sessions_lock = threading.Lock()

    def close(self) -> None:
        """Ends every open Session stream (server shutdown)."""
        with self._sessions_lock:
            for ended in self._sessions:
                ended.set()

    @_rpc
    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        return pb.InfoResponse(
            version=__version__, pool_bytes=self.engine.store.arena_bytes, lane_socket=self.lane_socket
        )

    @_rpc
    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterResponse:
        status = self.engine.register(decode_registration(request))
        if status.sealed and status.registered == status.world_size:
            log.info("instance %s sealed: %s", status.instance_id, status.namespace_final)
        return pb.RegisterResponse(status=encode_status(status))

    @_rpc
    def Save(self, request: pb.SaveRequest, context: grpc.ServicerContext) -> pb.SaveResponse:
        r = self.engine.save(_worker(request), request.block_hashes, request.block_ids)
        return pb.SaveResponse(
            written=r.written,
            skipped=r.skipped,
            not_stored=r.not_stored,
            completed=r.completed,
            namespace_final=r.namespace_final,
        )

    @_rpc
    def Load(self, request: pb.LoadRequest, context: grpc.ServicerContext) -> pb.LoadResponse:
        r = self.engine.load(_worker(request), request.block_hashes, request.block_ids, request.lease_id)
        return pb.LoadResponse(outcome=_OUTCOMES[r.outcome], loaded=r.loaded, reason=r.reason, message=r.message)

    @_rpc
    def Query(self, request: pb.QueryRequest, context: grpc.ServicerContext) -> pb.QueryResponse:
        if len(request.request_id) > 256:
            raise InvalidArgument("request_id must be at most 256 characters")
        r = self.engine.query(request.instance_id, request.block_hashes, request.lease_ttl_ms)
        return pb.QueryResponse(
            hits=r.hits,
            lease_id=r.lease_id,
            loading=r.loading,
            namespace_final=r.namespace_final,
            lease_ttl_ms=r.lease_ttl_ms,
        )

    @_rpc
    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        self.engine.release(request.instance_id, request.lease_id)
        return pb.ReleaseResponse()

    @_rpc
    def Unregister(self, request: pb.UnregisterRequest, context: grpc.ServicerContext) -> pb.UnregisterResponse:
        return pb.UnregisterResponse(remaining_workers=self.engine.unregister(_worker(request)))

    def Session(self, request: pb.SessionRequest, context: grpc.ServicerContext) -> Iterator[pb.SessionEvent]:
        try:
            worker = _worker(request)
            close = self.engine.open_session(worker)
            status = self.engine.status(worker[0])
        except KvsealError as e:
            context.abort(getattr(grpc.StatusCode, e.status), str(e))
        ended = threading.Event()
        context.add_callback(ended.set)  # runs when the client goes away (cancel, crash, closed channel)
        with self._sessions_lock:
            self._sessions.add(ended)
        try:
            yield pb.SessionEvent(status=encode_status(status))
            ended.wait()
        finally:
            with self._sessions_lock:
                self._sessions.discard(ended)
            close()
            log.info("session of %s tp_rank %d pp_rank %d ended", *worker)


_OUTCOMES = {
    "loaded": pb.LoadResponse.LOADED,
    "missing": pb.LoadResponse.MISSING,
    "refused": pb.LoadResponse.REFUSED,
}


def _worker(request: Any) -> WorkerKey:
    if not request.HasField("worker"):
        raise InvalidArgument("worker must be set (instance_id, tp_rank, pp_rank)")
    w = request.worker
    if not w.instance_id:
        raise InvalidArgument("worker.instance_id must not be empty")
    return (w.instance_id, w.tp_rank, w.pp_rank)


def decode_registration(request: pb.RegisterRequest) -> WorkerRegistration:
    layers = []
    for i, spec in enumerate(request.layers):
        kind = spec.memory.WhichOneof("kind")
        memory: ShmSpec | CudaSpec
        if kind == "shm":
            m = spec.memory.shm
            memory = ShmSpec(m.path, m.offset, m.size)
        elif kind == "cuda":
            c = spec.memory.cuda
            memory = CudaSpec(
                c.device,
                c.handle,
                c.storage_size,
                c.storage_offset,
                c.ref_counter_handle,
                c.ref_counter_offset,
                c.event_handle,
                c.event_sync_required,
                c.offset,
            )
        else:
            raise InvalidArgument(f"layers[{i}].memory must be set (shm or cuda)")
        layers.append(
            LayerRegistration(
                geometry=LayerGeometry(
                    name=spec.name,
                    dtype=normalize_dtype(spec.dtype),
                    segment_bytes=spec.segment_bytes,
                    segments=spec.segments,
                    group_id=spec.group_id,
                    layout_tag=spec.layout_tag,
                ),
                num_blocks=spec.num_blocks,
                strides=tuple(spec.strides),
                memory=memory,
            )
        )
    return WorkerRegistration(
        instance_id=request.instance_id,
        namespace=request.namespace,
        tp_rank=request.tp_rank,
        tp_size=request.tp_size,
        pp_rank=request.pp_rank,
        world_size=request.world_size,
        block_size=request.block_size,
        layers=tuple(layers),
    )


def encode_status(s: InstanceStatus) -> pb.InstanceStatus:
    return pb.InstanceStatus(
        sealed=s.sealed,
        registered=s.registered,
        world_size=s.world_size,
        namespace_final=s.namespace_final,
        fingerprint=s.fingerprint,
        digest=s.digest,
        num_layers=s.num_layers,
        page_bytes=s.page_bytes,
    )
