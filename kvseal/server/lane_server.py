"""Serves the local lane (kvseal.wire.lane) on a unix socket: every call a worker makes, one session per connection.

Theory of operation. A small pool of threads shares one epoll set. Every connection is registered with
EPOLLONESHOT, so a ready connection wakes exactly one thread, which reads what has arrived without blocking,
answers every complete frame, and re-arms the connection; the thread that woke is the one that answers (one
wake-up per request, as with a thread per connection), but an idle connection costs no thread, so thousands of
workers' sessions cost a file descriptor and a few hundred bytes each. Frames are assembled incrementally against
their op's limit (kvseal.wire.lane.FrameBuffer): a header announcing 64 MiB allocates nothing.

Limits: at most `max_connections` connections. A connection that holds no registration and stays silent past
`idle_timeout_s` is closed; when the cap is reached or accept fails for lack of file descriptors (EMFILE), the
longest-idle such connections are closed to make room (an error is logged), and if none can be, the newcomer gets
an error frame and is closed (through a reserved descriptor), so the listener never stops. Connections are closed
only by the thread that holds them; others ask for it with shutdown(), which wakes the holder.

Who: the kernel names each peer (SO_PEERCRED). The engine's own user and root are privileged (they may query any
instance); other users act on their own instances only (kvseal.engine.engine). With a token, the first frame must
be a HELLO carrying it.
"""

from __future__ import annotations

import errno
import grp
import hmac
import logging
import os
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

from kvseal.core.layout import (
    MAX_GROUPS,
    MAX_NAME_CHARS,
    KvGroup,
    LayerGeometry,
    LayerRegistration,
    WorkerRegistration,
    normalize_dtype,
)
from kvseal.engine.engine import Caller, Engine, InstanceStatus, Session
from kvseal.engine.memory import CudaSpec, ShmSpec
from kvseal.errors import InvalidArgument, KvsealError, Unauthenticated, translate
from kvseal.limits import MAX_CUDA_HANDLE_BYTES, MAX_INSTANCE_ID_CHARS, MAX_STRIDES, check_length
from kvseal.proto import kvseal_pb2 as pb
from kvseal.server.metrics import Metrics
from kvseal.wire import lane

log = logging.getLogger("kvseal.server")
_READ_CHUNK = 1 << 20
_SEND_TIMEOUT_S = 10.0  # a peer that does not read its answers for this long is dropped
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_ERROR_LOG_INTERVAL_S = 10.0


class _ThreadBuffers(threading.local):
    """One receive buffer per lane thread (a fresh 1 MiB bytes per recv would be mmap'd and faulted each time)."""

    def get(self) -> memoryview:
        view = getattr(self, "view", None)
        if view is None:
            view = self.view = memoryview(bytearray(_READ_CHUNK))
        return view


_buffers = _ThreadBuffers()


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    session: Session
    frames: lane.FrameBuffer = field(default_factory=lane.FrameBuffer)
    fds: list[int] = field(default_factory=list)  # descriptors received for the frame being assembled
    authed: bool = False
    last_active: float = 0.0
    closing: bool = False  # shutdown() was asked for; the holder closes it


class LaneServer:
    def __init__(
        self,
        path: str,
        engine: Engine,
        metrics: Metrics,
        *,
        token: str | None = None,
        group: str | None = None,
        max_connections: int = 4096,
        idle_timeout_s: float = 60.0,
        threads: int = 16,
    ) -> None:
        self.path = path
        self.engine = engine
        self.metrics = metrics
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self._token = token
        self._threads = threads
        self._sock = _bind(path, group)
        self._inode = os.stat(path).st_ino
        self._sock.setblocking(False)
        self._ep = select.epoll()
        self._ep.register(self._sock.fileno(), select.EPOLLIN | select.EPOLLONESHOT)
        self._conns: dict[int, _Conn] = {}
        self._lock = threading.Lock()
        self._closing = False
        self._reserve_fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        self._last_error_log = 0.0
        self._workers: list[threading.Thread] = []

    def start(self) -> None:
        for i in range(self._threads):
            t = threading.Thread(target=self._loop, name=f"kvseal-lane-{i}", daemon=True)
            t.start()
            self._workers.append(t)

    def stop(self) -> None:
        self._closing = True
        with self._lock:
            for conn in self._conns.values():
                _shutdown(conn.sock)
        for t in self._workers:
            t.join(timeout=2.0)
        with self._lock:
            left = list(self._conns.values())
        for conn in left:
            self._close(conn)
        self._sock.close()
        self._ep.close()
        os.close(self._reserve_fd)
        try:
            if os.stat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        except OSError:
            pass

    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def sweep(self) -> None:
        """Closes connections that hold no registration and were silent past the idle timeout (called every
        second by the server)."""
        cutoff = time.monotonic() - self.idle_timeout_s
        with self._lock:
            for conn in self._conns.values():
                if not conn.session.workers and conn.last_active < cutoff and not conn.closing:
                    conn.closing = True
                    _shutdown(conn.sock)

    # ------------------------------------------------------------------ event loop

    def _loop(self) -> None:
        listen_fd = self._sock.fileno()
        while not self._closing:
            try:
                events = self._ep.poll(0.5, 1)
            except OSError:
                return  # the epoll set was closed (stop)
            for fd, _ in events:
                if self._closing:
                    return
                if fd == listen_fd:
                    self._accept()
                    continue
                with self._lock:
                    conn = self._conns.get(fd)
                if conn is not None:
                    self._service(conn)

    def _accept(self) -> None:
        try:
            while True:
                try:
                    sock, _ = self._sock.accept()
                except BlockingIOError:
                    break
                except OSError as e:
                    if e.errno not in (errno.EMFILE, errno.ENFILE):
                        raise
                    self._no_room("no file descriptors left (EMFILE)", "the engine is out of file descriptors")
                    break
                if self._staying() >= self.max_connections and not self._make_room("the connection cap", more=True):
                    with sock:  # nothing can make room: the newcomer gets an answer, not a hang
                        sock.setblocking(False)
                        try:
                            sock.send(lane.encode_error("RESOURCE_EXHAUSTED", "the engine's lane is at its cap"))
                        except OSError:
                            pass
                    continue
                self._add(sock)
        finally:
            if not self._closing:
                self._ep.modify(self._sock.fileno(), select.EPOLLIN | select.EPOLLONESHOT)

    def _no_room(self, why: str, answer: str) -> None:
        """Makes room for the connections waiting in the backlog, or refuses one of them."""
        if self._make_room(why):
            time.sleep(0.005)  # let the threads holding the closing connections close them; then accept again
        else:
            self._refuse_one("RESOURCE_EXHAUSTED", answer)

    def _add(self, sock: socket.socket) -> None:
        pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
        sock.setblocking(False)
        caller = Caller(uid=uid, pid=pid, privileged=uid in (os.getuid(), 0))
        conn = _Conn(sock, Session(caller), authed=self._token is None, last_active=time.monotonic())
        with self._lock:
            self._conns[sock.fileno()] = conn
        self._ep.register(sock.fileno(), select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLONESHOT)

    def _staying(self) -> int:
        """Connections open and not asked to close (each closing one is room for one newcomer, counted once)."""
        with self._lock:
            return sum(not c.closing for c in self._conns.values())

    def _make_room(self, why: str, more: bool = False) -> bool:
        """Asks the longest-idle connections without a registration to close. True if some are closing (`more`:
        if some were asked now; those already closing are room already counted)."""
        self._log_error(f"lane: {why}; closing idle connections that hold no registration")
        with self._lock:
            if not more and any(c.closing for c in self._conns.values()):
                return True  # room is on its way
            idle = sorted(
                (c for c in self._conns.values() if not c.session.workers and not c.closing),
                key=lambda c: c.last_active,
            )
            for conn in idle[: max(1, len(idle) // 8)]:
                conn.closing = True
                _shutdown(conn.sock)
            return bool(idle)

    def _refuse_one(self, status: str, message: str) -> None:
        """Accepts one pending connection through the reserved descriptor, answers it with an error, closes it."""
        os.close(self._reserve_fd)
        try:
            sock, _ = self._sock.accept()
            with sock:
                sock.setblocking(False)
                try:
                    sock.send(lane.encode_error(status, message))
                except OSError:
                    pass
        except OSError:
            pass
        finally:
            self._reserve_fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)

    def _log_error(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_error_log > _ERROR_LOG_INTERVAL_S:
            self._last_error_log = now
            log.error(message)

    def _service(self, conn: _Conn) -> None:
        """Reads what arrived, answers complete frames, re-arms (or closes) the connection. The caller holds it."""
        keep = False
        try:
            keep = self._read_and_answer(conn)
        except OSError:
            keep = False  # the peer went away or stopped reading
        except Exception:
            log.exception("lane connection failed")
        if keep and not self._closing:
            self._ep.modify(conn.sock.fileno(), select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLONESHOT)
        else:
            self._close(conn)

    def _read_and_answer(self, conn: _Conn) -> bool:
        buf = _buffers.get()
        while True:
            try:
                n, ancdata, flags, _ = conn.sock.recvmsg_into(
                    [buf], socket.CMSG_SPACE(lane.MAX_FDS * 4), socket.MSG_CMSG_CLOEXEC
                )
            except BlockingIOError:
                return not conn.closing
            data = buf[:n]
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    count = len(payload) // 4
                    conn.fds.extend(struct.unpack(f"{count}i", payload[: 4 * count]))
            if flags & socket.MSG_CTRUNC or len(conn.fds) > lane.MAX_FDS:
                _send(conn.sock, lane.encode_error("INVALID_ARGUMENT", f"more than {lane.MAX_FDS} descriptors"))
                return False
            if not data:
                return False  # end of stream (or shutdown asked for)
            conn.last_active = time.monotonic()
            conn.frames.feed(data)  # copies: the buffer is this thread's
            while True:
                try:
                    frame = conn.frames.next_frame()
                except KvsealError as e:  # an unknown op or an oversized frame: answer, then hang up
                    status, message = translate(e, "the lane")
                    _send(conn.sock, lane.encode_error(status.name, message))
                    return False
                if frame is None:
                    break
                fds, conn.fds = conn.fds, []
                try:
                    reply = self._handle(conn, *frame, fds)
                finally:
                    for fd in fds:
                        os.close(fd)
                _send(conn.sock, reply)
                if not conn.authed:
                    return False
            if n < _READ_CHUNK:
                return not conn.closing

    def _close(self, conn: _Conn) -> None:
        """Ends a connection and its session. The caller holds the connection (or the server is stopping)."""
        with self._lock:
            fd = conn.sock.fileno()
            if fd < 0 or self._conns.get(fd) is not conn:
                return
            del self._conns[fd]
        if conn.session.workers:
            self.engine.close_session(conn.session)  # before the socket closes: a reconnect finds the key free
        for extra in conn.fds:
            os.close(extra)
        conn.fds = []
        conn.sock.close()

    # ------------------------------------------------------------------ requests

    def _handle(self, conn: _Conn, op: int, body: bytes, fds: list[int]) -> bytes:
        start = time.perf_counter()
        method, code = lane.OP_NAMES.get(op, "Unknown"), "OK"
        try:
            request = lane.decode_request(op, body)
            if isinstance(request, lane.HelloRequest):
                if self._token is not None and not hmac.compare_digest(request.token.encode(), self._token.encode()):
                    raise Unauthenticated("wrong token")
                conn.authed = True
                return lane.encode_ok()
            if not conn.authed:
                raise Unauthenticated("this engine needs a token: send HELLO with it first (EngineClient(token=...))")
            if request is lane.PING:
                return lane.encode_ok()
            engine, session = self.engine, conn.session
            if isinstance(request, lane.QueryRequest):
                q = engine.query(
                    request.instance_id,
                    request.hashes,
                    session.caller,
                    request.lease_ttl_ms,
                    request.request_id,
                    request.limit_tokens,
                )
                return lane.encode_query_ok(q.hits, q.lease_id, q.lease_ttl_ms, q.namespace_final, q.loading)
            if isinstance(request, lane.ReleaseRequest):
                engine.release(request.instance_id, request.lease_id, session.caller)
                return lane.encode_ok()
            if isinstance(request, lane.SaveRequest):
                s = engine.save(request.worker, request.hashes, request.block_ids, session)
                return lane.encode_save_ok(s.written, s.skipped, s.not_stored, s.completed, s.namespace_final)
            if isinstance(request, lane.LoadRequest):
                r = engine.load(request.worker, request.hashes, request.block_ids, session, request.lease_id)
                return lane.encode_load_ok(r.outcome, r.loaded, r.reason, r.message)
            if isinstance(request, lane.SaveGroupsRequest):
                runs = [(run.group, run.hashes, run.block_ids) for run in request.runs]
                s = engine.save_groups(request.worker, runs, session)
                return lane.encode_save_ok(s.written, s.skipped, s.not_stored, s.completed, s.namespace_final)
            if isinstance(request, lane.LoadGroupsRequest):
                runs = [(run.group, run.hashes, run.block_ids) for run in request.runs]
                r = engine.load_groups(request.worker, runs, session, request.lease_id)
                return lane.encode_load_ok(r.outcome, r.loaded, r.reason, r.message)
            if isinstance(request, lane.UnregisterRequest):
                return lane.encode_unregister_ok(engine.unregister(request.worker, session))
            assert isinstance(request, lane.RegisterRequest)
            status = engine.register(decode_registration(request.body), session, fds)
            if status.sealed and status.registered == status.world_size:
                log.info("instance %s sealed: %s", status.instance_id, status.namespace_final)
            return lane.encode_ok(encode_status(status).SerializeToString())
        except Exception as e:
            if not isinstance(e, KvsealError):  # a bug, not bad input: answer and keep serving
                log.exception("lane %s failed", method)
            status, message = translate(e, f"{method} failed inside the engine")
            code = status.name
            return lane.encode_error(status.name, message)
        finally:
            self.metrics.observe_rpc(f"lane.{method}", code, time.perf_counter() - start)


def _bind(path: str, group: str | None) -> socket.socket:
    """Binds the lane's socket with mode 0600 (0660 and `group` when given), replacing only a *stale* socket: a
    path where an engine still answers is left alone and the start fails."""
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody listens: a stale socket of an earlier engine
        else:
            raise SystemExit(f"another engine serves the lane socket {path!r}: stop it or pass another --lane-socket")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(path)
    except OSError as e:
        sock.close()
        raise SystemExit(f"cannot create the lane socket {path!r}: {e.strerror}") from None
    finally:
        os.umask(old_umask)
    if group is not None:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            sock.close()
            os.unlink(path)
            raise SystemExit(f"--lane-group {group!r}: no such group") from None
        os.chown(path, -1, gid)
        os.chmod(path, 0o660)
    sock.listen(1024)
    return sock


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _send(sock: socket.socket, data: bytes) -> None:
    """Sends all of `data` on a non-blocking socket, waiting at most _SEND_TIMEOUT_S for room."""
    view = memoryview(data)
    deadline = time.monotonic() + _SEND_TIMEOUT_S
    while view:
        try:
            n = sock.send(view)
            view = view[n:]
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [sock], [], left)[1]:
                raise TimeoutError("the peer does not read its answers") from None


def decode_registration(body: bytes) -> WorkerRegistration:
    request = pb.RegisterRequest()
    try:
        request.ParseFromString(body)
    except Exception as e:  # protobuf's DecodeError
        raise InvalidArgument(f"RegisterRequest does not parse: {e}") from None
    check_length("instance_id", request.instance_id, MAX_INSTANCE_ID_CHARS)
    check_length("namespace", request.namespace, MAX_NAME_CHARS)
    check_length("groups", request.groups, MAX_GROUPS)
    check_length("eagle_groups", request.eagle_groups, MAX_GROUPS)
    layers = []
    for i, spec in enumerate(request.layers):
        for name in ("name", "dtype", "layout_tag"):
            check_length(f"layers[{i}].{name}", getattr(spec, name), MAX_NAME_CHARS)
        check_length(f"layers[{i}].strides", spec.strides, MAX_STRIDES)
        kind = spec.memory.WhichOneof("kind")
        memory: ShmSpec | CudaSpec
        if kind == "shm":
            m = spec.memory.shm
            memory = ShmSpec(m.fd, m.offset, m.size)
        elif kind == "cuda":
            c = spec.memory.cuda
            for name in ("handle", "ref_counter_handle", "event_handle"):
                check_length(f"layers[{i}].memory.cuda.{name}", getattr(c, name), MAX_CUDA_HANDLE_BYTES)
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
                table=spec.table,
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
        groups=tuple(_group(i, g) for i, g in enumerate(request.groups)),
        eagle_groups=tuple(request.eagle_groups),
    )


def _group(i: int, group: pb.KvGroup) -> KvGroup:
    check_length(f"groups[{i}].kind", group.kind, MAX_NAME_CHARS)
    return KvGroup(group.kind, group.block_size, group.span)


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
        descriptor=s.descriptor,
    )
