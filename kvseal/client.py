"""Python client of the engine, for connectors and tools.

    client = EngineClient("127.0.0.1:50055")
    status = client.register(instance_id="i0", namespace="llama-8b", tp_rank=0, tp_size=1, pp_rank=0,
                             world_size=1, block_size=16, layers=[layer_from_tensor("model.layers.0.attn", kv0, ...)])
    session = client.open_session(("i0", 0, 0))     # liveness: closing it drops the worker's mappings and leases
    client.save(("i0", 0, 0), hashes, block_ids)
    hits, lease = client.query("i0", hashes)
    client.load(("i0", 0, 0), hashes[:hits], block_ids[:hits], lease_id=lease)

Errors arrive as kvseal.errors exceptions (InvalidArgument, FailedPrecondition, NotFound, Unavailable …) whose
message is the engine's.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from kvseal import lane as ln
from kvseal.errors import KvsealError, error_for_status
from kvseal.proto import kvseal_pb2 as pb
from kvseal.proto import kvseal_pb2_grpc as pb_grpc

WorkerKey = tuple[str, int, int]


class Session:
    """A worker's liveness stream. The engine drops the worker when it ends (close(), crash or lost channel)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        first = next(stream)  # the engine answers at once with the instance's status
        self.status: pb.InstanceStatus = first.status
        self._thread = threading.Thread(target=self._drain, name="kvseal-session", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        try:
            for _ in self._stream:
                pass
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self._stream.cancel()
        self._thread.join(timeout=5)


class EngineClient:
    def __init__(
        self,
        target: str = "127.0.0.1:50055",
        *,
        token: str | None = None,
        timeout: float = 30.0,
        use_lane: bool = True,
        lane_spin_us: int = 1000,
    ) -> None:
        """`lane_spin_us`: Query and Release poll for the engine's answer for up to this long before their thread
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
        self._use_lane = use_lane and not token  # the lane has no token: a token-protected engine is gRPC only
        self._lane: _Lane | None = None
        self._lane_retry_at = 0.0
        self._lane_spin_s = lane_spin_us / 1e6

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
            raise error_for_status("UNAVAILABLE", f"engine at {self.target} not reachable in {timeout}s") from None

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
    ) -> pb.InstanceStatus:
        request = pb.RegisterRequest(
            instance_id=instance_id,
            namespace=namespace,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            world_size=world_size,
            block_size=block_size,
            layers=layers,
        )
        return self._call("Register", request).status

    # Query, Release, Save and Load take the local lane when the engine offers one (kvseal.lane); a request the
    # lane cannot frame, or a lane that broke, goes over gRPC instead.

    def save(self, worker: WorkerKey, hashes: Sequence[bytes], block_ids: Sequence[int]) -> pb.SaveResponse:
        body = self._lane_call(ln.encode_save, worker, hashes, block_ids)
        if body is not None:
            written, skipped, not_stored, completed, ns = ln.decode_save_ok(body)
            return pb.SaveResponse(
                written=written, skipped=skipped, not_stored=not_stored, completed=completed, namespace_final=ns
            )
        return self._call("Save", pb.SaveRequest(worker=_worker(worker), block_hashes=hashes, block_ids=block_ids))

    def load(
        self, worker: WorkerKey, hashes: Sequence[bytes], block_ids: Sequence[int], lease_id: int = 0
    ) -> pb.LoadResponse:
        body = self._lane_call(ln.encode_load, worker, hashes, block_ids, lease_id)
        if body is not None:
            outcome, loaded, reason, message = ln.decode_load_ok(body)
            return pb.LoadResponse(outcome=outcome, loaded=loaded, reason=reason, message=message)  # type: ignore[arg-type]
        request = pb.LoadRequest(worker=_worker(worker), block_hashes=hashes, block_ids=block_ids, lease_id=lease_id)
        return self._call("Load", request)

    def query(
        self, instance_id: str, hashes: Sequence[bytes], *, request_id: str = "", lease_ttl_ms: int = 0
    ) -> pb.QueryResponse:
        """Leading resident hashes and their lease."""
        body = self._lane_call(ln.encode_query, instance_id, hashes, lease_ttl_ms, spin=True)
        if body is not None:
            hits, lease_id, ttl, ns = ln.decode_query_ok(body)
            return pb.QueryResponse(hits=hits, lease_id=lease_id, lease_ttl_ms=ttl, namespace_final=ns)
        request = pb.QueryRequest(
            instance_id=instance_id, block_hashes=hashes, request_id=request_id, lease_ttl_ms=lease_ttl_ms
        )
        return self._call("Query", request)

    def release(self, instance_id: str, lease_id: int) -> None:
        if self._lane_call(ln.encode_release, instance_id, lease_id, spin=True) is None:
            self._call("Release", pb.ReleaseRequest(instance_id=instance_id, lease_id=lease_id))

    def info(self) -> pb.InfoResponse:
        return self._call("Info", pb.InfoRequest())

    def _lane_call(self, encode: Callable[..., bytes], *args: Any, spin: bool = False) -> bytes | None:
        """The OK body of the engine's answer over the lane, or None when the request goes over gRPC instead.
        The engine's errors are raised. With `spin`, the answer is polled for (see lane_spin_us)."""
        lane = self._lane_for_call()
        if lane is None:
            return None
        try:
            frame = encode(*args)
        except ln.Unframeable:
            return None
        return lane.call(frame, self._lane_spin_s if spin else 0.0)

    def _lane_for_call(self) -> _Lane | None:
        if not self._use_lane:
            return None
        if self._lane is None or self._lane.path == "":
            if time.monotonic() < self._lane_retry_at:
                return None
            self._lane_retry_at = time.monotonic() + 5.0
            try:
                path = self.info().lane_socket
            except KvsealError:
                return None
            self._lane = _Lane(path)
        return self._lane if self._lane.path else None

    def unregister(self, worker: WorkerKey) -> int:
        return self._call("Unregister", pb.UnregisterRequest(worker=_worker(worker))).remaining_workers

    def open_session(self, worker: WorkerKey) -> Session:
        try:
            stream = self._stub.Session(pb.SessionRequest(worker=_worker(worker)), metadata=self._metadata)
            return Session(stream)
        except grpc.RpcError as e:
            raise error_for_status(e.code().name, e.details() or "") from None


class _Lane:
    """One connection to the engine's local lane (kvseal.lane). `call` returns the OK body, raises the
    engine's error, or returns None when the lane is unusable (the caller then uses gRPC)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def call(self, frame: bytes, spin_s: float = 0.0) -> bytes | None:
        """Sends a frame and returns the answer, polling for it for up to `spin_s` before sleeping in recv."""
        with self._lock:
            try:
                if self._sock is None:
                    if not self.path or not os.path.exists(self.path):
                        return None
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    self._sock.connect(self.path)
                self._sock.sendall(frame)
                if spin_s > 0:
                    _poll(self._sock, spin_s)
                reply = ln.read_frame(self._sock)
                if reply is None:
                    raise ConnectionError("the engine closed the lane")
            except (OSError, KvsealError):
                self._close_locked()
                return None
        code, body = reply
        if code != 0:
            raise error_for_status(ln.STATUS_NAMES.get(code, "INTERNAL"), body.decode(errors="replace"))
        return body

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def __del__(self) -> None:  # a client dropped without close() must not leak its socket
        if self._sock is not None:
            self._sock.close()

    def _close_locked(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _poll(sock: socket.socket, seconds: float) -> None:
    """Returns when `sock` has bytes to read (or has closed), or after `seconds`."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        try:
            sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            return
        except BlockingIOError:
            continue


def _worker(worker: WorkerKey) -> pb.WorkerId:
    return pb.WorkerId(instance_id=worker[0], tp_rank=worker[1], pp_rank=worker[2])


# -------------------------------------------------------------------- memory handles


def shm_handle(path: str, offset: int, size: int) -> pb.MemoryHandle:
    return pb.MemoryHandle(shm=pb.ShmHandle(path=path, offset=offset, size=size))


def share_tensor(tensor: Any) -> pb.MemoryHandle:
    """Moves a CPU torch tensor's storage to shared memory in place (every view keeps working) and returns the
    handle the engine maps. The tensor must stay alive while the worker is registered."""
    import torch.multiprocessing

    storage = tensor.untyped_storage()
    if not storage.is_shared():
        _check_shm_room(storage.nbytes())
        tensor.share_memory_()
        storage = tensor.untyped_storage()
    offset = tensor.data_ptr() - storage.data_ptr()
    if torch.multiprocessing.get_sharing_strategy() == "file_system":
        _, name, nbytes = storage._share_filename_cpu_()
        path = "/dev/shm/" + name.decode().lstrip("/")
        size = os.stat(path).st_size
        offset += size - nbytes  # torch puts a small header (its reference count) before the data
    else:
        fd, size = storage._share_fd_cpu_()
        path = f"/proc/{os.getpid()}/fd/{fd}"
    return shm_handle(path, offset, size)


def _check_shm_room(nbytes: int) -> None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        raise KvsealError("/dev/shm is missing: the KV cache cannot be shared with the engine") from None
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        raise KvsealError(
            f"/dev/shm has {free} bytes free but the KV cache needs {nbytes}: give the container more shared "
            f"memory (docker run --shm-size={max(1, -(-nbytes * 2 // (1 << 30)))}g) or lower the KV cache size"
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
    """Describes a CPU KV tensor of shape [num_blocks, ...] (one page per block) or, with split_kv,
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
