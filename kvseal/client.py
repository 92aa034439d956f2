"""Python client of the engine, for connectors and tools.

    client = EngineClient("127.0.0.1:50055")
    status = client.register(instance_id="i0", namespace="llama-8b", tp_rank=0, tp_size=1, pp_rank=0,
                             world_size=1, block_size=16, layers=[layer_from_tensor("model.layers.0.attn", kv0, ...)])
    client.save(("i0", 0, 0), hashes, block_ids)
    q = client.query("i0", hashes)
    client.load(("i0", 0, 0), hashes[:q.hits], block_ids[:q.hits], lease_id=q.lease_id)

A hybrid model (several KV cache groups) saves and loads its groups' blocks in one call each, a BlockRun per group
(its hashes, and the block ids of each of its block tables):

    client.save_groups(("i0", 0, 0), [BlockRun(0, full_hashes, [full_ids]), BlockRun(1, swa_hashes, [swa_ids])])

A worker's calls go over the engine's local lane (kvseal.wire.lane), a unix socket whose path the `Info` RPC names:
the KV memory travels there as file descriptors, and the lane connection is the worker's session — what this client
registered lives exactly as long as that connection (`session_alive()`; closing the client ends it). Queries and
releases fall back to gRPC when the lane cannot carry them. The lane's server must run as root, as this process's
user or as `engine_uid` (the kernel names it, SO_PEERCRED): anyone else who took the engine's port or socket path
while it was down would be handed this worker's KV memory, so the client refuses (PermissionDenied). Every call has
a deadline (`timeout`): an engine that does not answer in time raises DeadlineExceeded, never hangs the caller.

Errors arrive as kvseal.errors exceptions (InvalidArgument, FailedPrecondition, NotFound, PermissionDenied,
Unavailable, DeadlineExceeded …) whose message is the engine's.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np

from kvseal.errors import (
    DeadlineExceeded,
    InvalidArgument,
    KvsealError,
    PermissionDenied,
    Unavailable,
    error_for_code,
    error_for_status,
)
from kvseal.memfd import SharedArray, SharedRegion, share_storage
from kvseal.proto import kvseal_pb2 as pb
from kvseal.proto import kvseal_pb2_grpc as pb_grpc
from kvseal.wire import lane as ln
from kvseal.wire.lane import BlockRun

__all__ = [
    "BlockRun",
    "EngineClient",
    "cuda_handle",
    "layer_from_array",
    "layer_from_tensor",
    "share_tensor",
    "shm_handle",
]

WorkerKey = tuple[str, int, int]


class EngineClient:
    def __init__(
        self,
        target: str = "127.0.0.1:50055",
        *,
        token: str | None = None,
        timeout: float = 30.0,
        lane_spin_us: int = 1000,
        engine_uid: int | None = None,
    ) -> None:
        """`engine_uid`: the user the engine runs as, when neither root nor this process's user.

        `lane_spin_us`: Query and Release poll for the engine's answer for up to this long before their thread
        sleeps in recv. A sleeping thread costs a wake-up when the answer comes (~0.1 ms on these VMs, most of a
        query); polling costs the caller's CPU while it waits anyway. Save and Load (milliseconds) sleep. 0 = off."""
        self.target = target
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel = grpc.insecure_channel(
            target,
            options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)],
        )
        self._stub = pb_grpc.EngineStub(self._channel)
        self._token = token
        self._lane: _LaneConnection | None = None
        self._session_lane: _LaneConnection | None = None  # the connection that carried the last registration
        self._lane_lock = threading.Lock()
        self._lane_spin_s = lane_spin_us / 1e6
        self._engine_uids = {0, os.getuid()} | ({engine_uid} if engine_uid is not None else set())

    def close(self) -> None:
        if self._lane is not None:
            self._lane.close()
        self._channel.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Blocks until the engine accepts connections, or raises Unavailable."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise Unavailable(f"engine at {self.target} not reachable in {timeout}s") from None

    def _call(self, method: str, request: Any) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise error_for_status(e.code().name, e.details() or "") from None

    # ---------------------------------------------------------------- RPCs

    def register(
        self,
        *,
        instance_id: str,
        namespace: str,
        tp_rank: int,
        tp_size: int,
        pp_rank: int,
        world_size: int,
        block_size: int,
        layers: Sequence[pb.LayerSpec],
        groups: Sequence[tuple[str, int, int]] = (),
        eagle_groups: Sequence[int] = (),
    ) -> pb.InstanceStatus:
        """Registers this worker's layers. `groups`: the KV cache groups as (kind, block_size, span) (kind full,
        sliding, chunked or mamba; span the window or chunk in tokens), indexed by the layers' group_id; none is
        one full-attention group of block_size; each layer's `table` picks which of its group's block tables a Save
        or Load addresses it through (save_groups). `eagle_groups`: the groups a drafter reads (a hit also needs the
        block after it)."""
        request = pb.RegisterRequest(
            instance_id=instance_id,
            namespace=namespace,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            world_size=world_size,
            block_size=block_size,
            layers=layers,
            groups=[pb.KvGroup(kind=k, block_size=b, span=n) for k, b, n in groups],
            eagle_groups=eagle_groups,
        )
        wire, fds = _fds_as_indexes(request)
        lane = self._lane_required()
        body = lane.call(ln.encode_register(wire.SerializeToString()), fds=fds)
        self._session_lane = lane
        return pb.InstanceStatus.FromString(body)

    def unregister(self, worker: WorkerKey) -> int:
        body = self._lane_required().call(ln.encode_unregister(worker))
        return int.from_bytes(body[:4], "little")

    def session_alive(self) -> bool:
        """Whether the lane connection that carried this client's registrations is still open (False before any
        registration, and once the engine restarted or that connection dropped: register again)."""
        lane = self._session_lane
        return lane is not None and lane is self._lane and lane.alive()

    def save(self, worker: WorkerKey, hashes: Sequence[bytes], block_ids: Sequence[int]) -> pb.SaveResponse:
        body = self._lane_required().call(_encode(ln.encode_save, worker, hashes, block_ids))
        return _save_response(body)

    def load(
        self, worker: WorkerKey, hashes: Sequence[bytes], block_ids: Sequence[int], lease_id: int = 0
    ) -> pb.LoadResponse:
        body = self._lane_required().call(_encode(ln.encode_load, worker, hashes, block_ids, lease_id))
        return _load_response(body)

    def save_groups(self, worker: WorkerKey, runs: Sequence[BlockRun]) -> pb.SaveResponse:
        """Saves the blocks of several KV cache groups (a hybrid model's) in one call: one BlockRun per group, with
        the block ids of each of the group's block tables, one id per hash. Answers as `save`."""
        body = self._lane_required().call(_encode(ln.encode_save_groups, worker, runs))
        return _save_response(body)

    def load_groups(self, worker: WorkerKey, runs: Sequence[BlockRun], lease_id: int = 0) -> pb.LoadResponse:
        """Loads the blocks of several KV cache groups in one call (runs as in `save_groups`). Answers as `load`."""
        body = self._lane_required().call(_encode(ln.encode_load_groups, worker, runs, lease_id))
        return _load_response(body)

    def query(
        self,
        instance_id: str,
        hashes: Sequence[bytes],
        *,
        request_id: str = "",
        lease_ttl_ms: int = 0,
        limit_tokens: int = 0,
    ) -> pb.QueryResponse:
        """Leading resident hashes and their lease; or `loading` (hits 0): the engine is reading more of the
        prefix from SSD, ask again (with the same request_id). `limit_tokens`: the longest hit wanted, in tokens
        (0: every hash)."""
        body = self._lane_call(ln.encode_query, instance_id, hashes, lease_ttl_ms, request_id, limit_tokens, spin=True)
        if body is not None:
            hits, lease_id, ttl, ns, loading = ln.decode_query_ok(body)
            return pb.QueryResponse(hits=hits, lease_id=lease_id, lease_ttl_ms=ttl, namespace_final=ns, loading=loading)
        request = pb.QueryRequest(
            instance_id=instance_id,
            block_hashes=hashes,
            request_id=request_id,
            lease_ttl_ms=lease_ttl_ms,
            max_tokens=limit_tokens,
        )
        return self._call("Query", request)

    def release(self, instance_id: str, lease_id: int) -> None:
        if self._lane_call(ln.encode_release, instance_id, lease_id, spin=True) is None:
            self._call("Release", pb.ReleaseRequest(instance_id=instance_id, lease_id=lease_id))

    def lane_call(self, frame: bytes) -> bytes:
        """Sends one frame encoded with kvseal.wire.lane and returns the OK answer's body (the engine's errors are
        raised): for benchmarks and tools that encode a request once and send it many times."""
        return self._lane_required().call(frame)

    def ping(self, payload: bytes = b"") -> None:
        """A no-op round trip over the lane carrying `payload` (the engine reads none of it)."""
        self._lane_required().call(ln.encode_ping(payload))

    def describe(self, instance_id: str) -> pb.InstanceStatus:
        """The instance's registration state and, once sealed, its namespace_final and layout descriptor."""
        return self._call("Describe", pb.DescribeRequest(instance_id=instance_id))

    def compare(self, namespace_final: str, other_descriptor: bytes) -> pb.CompareResponse:
        """How the layout of `namespace_final` (held by the engine) differs from another engine's descriptor."""
        return self._call(
            "Compare", pb.CompareRequest(namespace_final=namespace_final, other_descriptor=other_descriptor)
        )

    def info(self) -> pb.InfoResponse:
        return self._call("Info", pb.InfoRequest())

    def _lane_call(self, encode: Callable[..., bytes], *args: Any, spin: bool = False) -> bytes | None:
        """The OK body of the engine's answer over the lane, or None when the request cannot be framed there (the
        caller then uses gRPC). The engine's errors are raised. With `spin`, the answer is polled for."""
        try:
            frame = encode(*args)
        except ln.Unframeable:
            return None
        return self._lane_required().call(frame, spin_s=self._lane_spin_s if spin else 0.0)

    def _lane_required(self) -> _LaneConnection:
        """The lane connection, opened (and greeted with the token) on first use, or again after it broke or the
        engine closed it (a restarted engine: what it carried is gone, session_alive() says so)."""
        with self._lane_lock:
            if self._lane is None or not self._lane.alive():
                path = self.info().lane_socket
                if not path:
                    raise Unavailable(f"the engine at {self.target} announces no local lane")
                self._lane = _LaneConnection(path, self.timeout, self._token, self._engine_uids)
            return self._lane


class _LaneConnection:
    """One connection to the engine's local lane (kvseal.wire.lane): the session of what it registers. `call` returns
    the OK body or raises the engine's error; a connection that failed (deadline, engine gone) is closed and marked
    broken, and every registration it carried is gone with it."""

    def __init__(self, path: str, timeout: float, token: str | None, engine_uids: set[int]) -> None:
        self.path = path
        self.timeout = timeout
        self.broken = False
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(path)
        except OSError as e:
            self._break()
            if isinstance(e, TimeoutError):
                raise DeadlineExceeded(f"the engine's lane {path!r} did not accept within {timeout}s") from None
            raise Unavailable(f"the engine's lane {path!r} is unreachable: {e.strerror or e}") from None
        _, uid, _ = struct.unpack("3i", self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid not in engine_uids:
            self._break()
            raise PermissionDenied(
                f"the lane {path!r} is served by uid {uid}, not by root, this user or the engine_uid given: "
                "refusing to send KV memory there (if the engine runs as that user, pass engine_uid / "
                "kvseal.engine_uid)"
            )
        if token is not None:
            self.call(ln.encode_hello(token))

    def alive(self) -> bool:
        if self.broken:
            return False
        with self._lock:
            try:
                if not select.select([self._sock], [], [], 0)[0]:
                    return True  # nothing to read: no end of stream either
                return self._sock.recv(1, socket.MSG_PEEK) != b""  # readable, so this does not wait
            except OSError:
                return False

    def call(self, frame: bytes, spin_s: float = 0.0, fds: Sequence[int] = ()) -> bytes:
        """Sends a frame (with `fds` as SCM_RIGHTS) and returns the answer's body, polling for it for up to `spin_s`
        before sleeping in recv. The whole call is bounded by the lane's timeout."""
        with self._lock:
            if self.broken:
                raise Unavailable(f"the connection to the engine's lane {self.path!r} is closed")
            deadline = time.monotonic() + self.timeout
            try:
                if fds:
                    sent = socket.send_fds(self._sock, [frame], list(fds))
                    if sent < len(frame):
                        self._sock.sendall(frame[sent:])
                else:
                    self._sock.sendall(frame)
                if spin_s > 0:
                    _poll(self._sock, spin_s)
                reply = _read_reply(self._sock, deadline)
            except TimeoutError:
                self._break()
                raise DeadlineExceeded(f"no answer within {self.timeout}s on the engine's lane {self.path!r}") from None
            except (OSError, KvsealError) as e:
                self._break()
                raise Unavailable(f"the engine's lane {self.path!r} failed: {e}") from None
        code, body = reply
        if code != 0:
            raise error_for_code(code, body.decode(errors="replace"))
        return body

    def close(self) -> None:
        with self._lock:
            self._break()

    def __del__(self) -> None:  # a client dropped without close() must not leak its socket
        self._sock.close()

    def _break(self) -> None:
        self.broken = True
        self._sock.close()


def _read_reply(sock: socket.socket, deadline: float) -> tuple[int, bytes]:
    """One answer frame: `deadline` bounds the wait for it to start, the socket's timeout every read after."""
    left = deadline - time.monotonic()
    if left <= 0 or not select.select([sock], [], [], left)[0]:
        raise TimeoutError
    reply = ln.read_frame(sock)
    if reply is None:
        raise ConnectionError("the engine closed the lane")
    return reply


def _encode(encode: Callable[..., bytes], *args: Any) -> bytes:
    try:
        return encode(*args)
    except ln.Unframeable as e:  # Save and Load (and their Groups forms) exist on the lane only
        raise InvalidArgument(str(e)) from None


def _save_response(body: bytes) -> pb.SaveResponse:
    written, skipped, not_stored, completed, ns = ln.decode_save_ok(body)
    return pb.SaveResponse(
        written=written, skipped=skipped, not_stored=not_stored, completed=completed, namespace_final=ns
    )


def _load_response(body: bytes) -> pb.LoadResponse:
    outcome, loaded, reason, message = ln.decode_load_ok(body)
    return pb.LoadResponse(outcome=outcome, loaded=loaded, reason=reason, message=message)  # type: ignore[arg-type]


def _fds_as_indexes(request: pb.RegisterRequest) -> tuple[pb.RegisterRequest, list[int]]:
    """A copy of the request whose ShmHandle.fd fields index the list of distinct descriptors it returns."""
    wire = pb.RegisterRequest()
    wire.CopyFrom(request)
    fds: list[int] = []
    for layer in wire.layers:
        if layer.memory.WhichOneof("kind") == "shm":
            fd = layer.memory.shm.fd
            if fd not in fds:
                fds.append(fd)
            layer.memory.shm.fd = fds.index(fd)
    if len(fds) > ln.MAX_FDS:
        raise InvalidArgument(f"layers use {len(fds)} separate memfds; at most {ln.MAX_FDS}")
    return wire, fds


def _poll(sock: socket.socket, seconds: float) -> None:
    """Returns when `sock` has bytes to read (or has closed), or after `seconds`."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        try:
            sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            return
        except BlockingIOError:
            continue


# -------------------------------------------------------------------- memory handles


def shm_handle(region: SharedRegion, offset: int = 0) -> pb.MemoryHandle:
    """The handle of memory at `offset` bytes into a sealed memfd region (kvseal.memfd); the fd is this process's
    own, sent with the registration."""
    return pb.MemoryHandle(shm=pb.ShmHandle(fd=region.fd, offset=region.offset + offset, size=region.size))


def share_tensor(tensor: Any) -> pb.MemoryHandle:
    """The handle the engine maps for a torch tensor: a CPU tensor's storage moves into a sealed memfd in place
    (every view keeps working, kvseal.memfd); a CUDA tensor's allocation is shared by CUDA IPC (torch's own
    reduction of its storage). The tensor must stay alive while the worker is registered."""
    if tensor.is_cuda:
        return cuda_handle(tensor)
    region = share_storage(tensor)
    return shm_handle(region, tensor.data_ptr() - tensor.untyped_storage().data_ptr())


def cuda_handle(tensor: Any) -> pb.MemoryHandle:
    """The CUDA IPC handle of a CUDA tensor's storage (the engine opens it with torch, as a receiving process of
    torch.multiprocessing would), with the tensor's byte offset inside that storage."""
    storage = tensor.untyped_storage()
    device, handle, size, storage_offset, ref_handle, ref_offset, event_handle, event_sync = storage._share_cuda_()
    return pb.MemoryHandle(
        cuda=pb.CudaIpcHandle(
            device=device,
            handle=handle,
            storage_size=size,
            storage_offset=storage_offset,
            ref_counter_handle=ref_handle,
            ref_counter_offset=ref_offset,
            event_handle=event_handle or b"",
            event_sync_required=event_sync,
            offset=tensor.data_ptr() - storage.data_ptr(),
        )
    )


def layer_from_tensor(
    name: str,
    tensor: Any,
    *,
    layout_tag: str,
    group_id: int = 0,
    split_kv: bool = False,
    dtype: str | None = None,
) -> pb.LayerSpec:
    """Describes a KV tensor (CPU or CUDA) of shape [num_blocks, ...] (one page per block) or, with split_kv,
    [2, num_blocks, ...] (K and V as two segments), and shares its memory."""
    elem = tensor.element_size()
    if split_kv:
        if tensor.shape[0] != 2:
            raise ValueError(f"{name}: split_kv tensors are [2, num_blocks, ...], got shape {tuple(tensor.shape)}")
        num_blocks, segments = tensor.shape[1], 2
        strides = [tensor.stride(1) * elem, tensor.stride(0) * elem]
        one_segment = tensor[0, 0]
    else:
        num_blocks, segments = tensor.shape[0], 1
        strides = [tensor.stride(0) * elem]
        one_segment = tensor[0]
    if not one_segment.is_contiguous():
        raise ValueError(f"{name}: the bytes of one block must be contiguous")
    return pb.LayerSpec(
        name=name,
        dtype=dtype or str(tensor.dtype).removeprefix("torch."),
        segment_bytes=one_segment.numel() * elem,
        segments=segments,
        group_id=group_id,
        layout_tag=layout_tag,
        num_blocks=num_blocks,
        strides=strides,
        memory=share_tensor(tensor),
    )


def layer_from_array(
    name: str, array: np.ndarray, shared: SharedArray, *, layout_tag: str, dtype: str, group_id: int = 0
) -> pb.LayerSpec:
    """Describes a numpy KV array of shape [num_blocks, ...] (one page per block), a view into `shared`, for
    workers without torch."""
    offset = array.ctypes.data - shared.array.ctypes.data
    if not 0 <= offset < shared.region.size:
        raise ValueError(f"{name}: the array is not a view into the shared memory given")
    if not array[0].flags.c_contiguous:
        raise ValueError(f"{name}: the bytes of one block must be contiguous")
    return pb.LayerSpec(
        name=name,
        dtype=dtype,
        segment_bytes=array[0].nbytes,
        segments=1,
        group_id=group_id,
        layout_tag=layout_tag,
        num_blocks=array.shape[0],
        strides=[array.strides[0]],
        memory=shm_handle(shared.region, offset),
    )
