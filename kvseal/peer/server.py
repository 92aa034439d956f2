"""The serving side of peer fetch: other nodes' engines connect here and read this node's pages.

Who may connect: with a token, whoever proves it in the handshake; without one (loopback only), a process of the
engine's own user or root, as the kernel's socket table says (kvseal.auth). Only the engine's own user's
blocks are offered, the same ones its announcer tells the MetaServer about.

A fetch names namespace_final and the full layout digest: a digest or page size other than this node's for that
namespace is refused (counted by reason). What is sent is pinned under a lease that expires after the fetch's
timeout (capped by --peer-timeout), and unpinned as soon as it is sent (tcp) or the fetcher says DONE (pull planes):
a fetcher that stalls or dies costs a lease until its timeout, never a leaked pin. Every page goes with its XXH3-64,
computed while pinned (on another thread, while the pages are sent), so the fetcher can refuse a page that changed
or arrived damaged.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import selectors
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvseal.auth import local_uid_allowed, tcp_peer_uid
from kvseal.engine.engine import Engine
from kvseal.errors import InvalidArgument
from kvseal.peer.tcp import checksums, recv_frame
from kvseal.sockets import recv_exact
from kvseal.wire import peer as wire

log = logging.getLogger("kvseal.peer")
HANDSHAKE_TIMEOUT_S = 2.0  # from accept to READY: a node on the network needs a few round trips
IDLE_TIMEOUT_S = 120.0
MAX_HANDSHAKES = 128  # unauthenticated connections held at once
_ACCEPT_BURST = 256  # connections accepted per wake-up of the handshake thread
_DROP_LOG_INTERVAL_S = 10.0


@dataclass(slots=True)
class ServeCounters:
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    fetches: int = 0
    refusals: Counter[str] = field(default_factory=Counter)
    connections: int = 0  # authenticated, open now
    handshaking: int = 0  # accepted, not authenticated yet


@dataclass(slots=True, eq=False)
class _Pending:
    """A connection in its handshake, driven by the handshake thread without blocking."""

    sock: socket.socket
    addr: Any
    deadline: float
    step: str = "hello"  # hello -> node_id -> welcome (sending) -> proof
    want: int = wire.HELLO_FIXED
    buf: bytearray = field(default_factory=bytearray)
    out: bytes = b""
    version: int = 0
    plane: int = 0
    client_nonce: bytes = b""
    nonce: bytes = b""
    node_id: str = ""
    source: Any = None  # who it is, once its HELLO was read: (host, uid or None)


@dataclass(slots=True, eq=False)
class _Session:
    """An authenticated connection, served by a thread of its own."""

    sock: socket.socket
    owner: str
    busy: bool = False  # in a fetch
    closing: bool = False  # asked to close to make room
    last_active: float = 0.0


class PeerServer:
    """Listens on (host, port) and serves fetches.

    Handshakes run on one thread, without blocking, for every connection at once: a connection costs a thread only
    once it has authenticated (READY), and at most `max_connections` authenticated ones are open (at the cap, the
    longest-idle one is closed for a newcomer; with none idle, the newcomer is refused "busy"). Unauthenticated
    connections cost a descriptor each, at most `max_handshakes` of them, for at most `handshake_timeout_s`: when
    they are all taken, a newcomer takes the place of a connection that has not sent its whole HELLO yet (the
    oldest), else of the oldest one of the source (address, and uid on loopback) holding the most places. A known
    node sends its HELLO at once and answers the challenge within a round trip, so connections that stay silent,
    however many, never keep it out.
    """

    def __init__(
        self,
        engine: Engine,
        host: str,
        port: int,
        plane: Any,
        *,
        token: str | None = None,
        timeout_s: float = 10.0,
        max_connections: int = 64,
        max_handshakes: int = MAX_HANDSHAKES,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        self.engine = engine
        self.plane = plane
        self.token = token
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self.max_handshakes = max(1, max_handshakes)
        self.handshake_timeout_s = handshake_timeout_s
        self.counters = ServeCounters()
        self._lock = threading.Lock()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(1024)
        self._sock.setblocking(False)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._sessions: dict[socket.socket, _Session] = {}
        self._pending: dict[socket.socket, _Pending] = {}  # oldest first
        self._next_id = 0
        self._hasher = ThreadPoolExecutor(2, thread_name_prefix="kvseal-peer-hash")
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._reserve_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)  # to refuse a connection at EMFILE
        self._dropped: Counter[str] = Counter()  # since the last log line
        self._dropped_logged = -_DROP_LOG_INTERVAL_S
        self._refusal_logged = -_DROP_LOG_INTERVAL_S
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._handshakes, name="kvseal-peer-accept", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # the handshake thread has ended (and closed it) already
            pass
        if self._thread is not None:
            self._thread.join(5)
        else:
            self._close_listener()
            self._selector.close()
            self._close_fds()
        with self._lock:
            for session in list(self._sessions.values()):
                _shutdown(session.sock)
        self._hasher.shutdown(wait=False)

    # ---------------------------------------------------------------- handshakes (one thread)

    def _handshakes(self) -> None:
        sel = self._selector
        sel.register(self._sock, selectors.EVENT_READ, None)
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        try:
            while not self._stop.is_set():
                try:
                    self._handshakes_once(sel)
                except Exception:  # a bug here must not close the port to every node: say so, go on
                    log.exception("peer handshake thread")
                    time.sleep(0.1)
        finally:
            for p in list(self._pending.values()):
                self._forget(p)
                p.sock.close()
            self._close_listener()
            sel.close()
            self._close_fds()

    def _handshakes_once(self, sel: selectors.BaseSelector) -> None:
        timeout = None
        if self._pending:  # the oldest has the nearest deadline
            timeout = max(0.0, next(iter(self._pending.values())).deadline - time.monotonic())
        for key, _ in sel.select(timeout):
            if key.data is None:
                self._accept()
            elif isinstance(key.data, _Pending):
                self._advance(key.data)
        now = time.monotonic()
        while self._pending:
            oldest = next(iter(self._pending.values()))
            if oldest.deadline > now:
                break
            self._drop(oldest, "handshake_timeout")
        self._log_drops(now)

    def _close_fds(self) -> None:
        fds = (self._wake_r, self._wake_w, self._reserve_fd)
        self._wake_r = self._wake_w = self._reserve_fd = -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    def _close_listener(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _accept(self) -> None:
        for _ in range(_ACCEPT_BURST):
            try:
                conn, addr = self._sock.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    if self._stop.is_set():
                        return
                    log.debug("peer accept failed: %s", e)
                    continue  # ECONNABORTED and the like: that connection's loss
                self._out_of_descriptors()
                return
            conn.setblocking(False)
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                conn.close()
                continue
            p = _Pending(conn, addr, time.monotonic() + self.handshake_timeout_s)
            self._pending[conn] = p
            self._selector.register(conn, selectors.EVENT_READ, p)
            self._advance(p)  # a node's HELLO is usually there already
            while len(self._pending) > self.max_handshakes:
                self._drop(self._victim(), "handshake_full")
            self._count_pending()

    def _out_of_descriptors(self) -> None:
        """accept() failed for lack of descriptors: makes room by dropping an unauthenticated connection, or refuses
        the next one through the reserved descriptor, so the listener never spins or stalls."""
        if self._pending:
            self._drop(self._victim(), "no_descriptors")
            return
        try:
            if self._reserve_fd >= 0:
                os.close(self._reserve_fd)
                self._reserve_fd = -1
            conn, _ = self._sock.accept()
            conn.close()
            self._dropped["no_descriptors"] += 1
            self._refuse("no_descriptors")
        except OSError:
            time.sleep(0.01)  # nothing to accept after all, or still no descriptor: do not spin
        try:
            self._reserve_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            pass  # another thread took it: next time, then

    def _victim(self) -> _Pending:
        """The connection whose place a newcomer takes: the oldest that has not sent its whole HELLO, else the
        oldest of the source holding the most places."""
        silent = next((p for p in self._pending.values() if p.source is None), None)
        if silent is not None:
            return silent
        per_source = Counter(p.source for p in self._pending.values())
        crowd = per_source.most_common(1)[0][0]
        return next(p for p in self._pending.values() if p.source == crowd)

    def _count_pending(self) -> None:
        with self._lock:
            self.counters.handshaking = len(self._pending)

    def _forget(self, p: _Pending) -> None:
        self._pending.pop(p.sock, None)
        try:
            self._selector.unregister(p.sock)
        except (KeyError, ValueError):
            pass
        self._count_pending()

    def _drop(self, p: _Pending, reason: str = "") -> None:
        """Closes an unauthenticated connection, counted as a refusal under `reason` (none: it went away)."""
        if reason:
            self._refuse(reason)
            self._dropped[reason] += 1
        self._forget(p)
        p.sock.close()

    def _log_drops(self, now: float) -> None:
        if self._dropped and now - self._dropped_logged >= _DROP_LOG_INTERVAL_S:
            self._dropped_logged = now
            what = ", ".join(f"{n} ({reason})" for reason, n in sorted(self._dropped.items()))
            log.warning("peer port: refused or closed before authentication: %s", what)
            self._dropped.clear()

    def _log_refusal(self, line: str, reason: str) -> None:
        """Logs a handshake's refusal; when they come in a flood, the next ones are summed up every few seconds
        (by _log_drops), so a stranger cannot fill the log."""
        now = time.monotonic()
        if now - self._refusal_logged >= _DROP_LOG_INTERVAL_S:
            self._refusal_logged = now
            log.warning("%s", line)
        else:
            self._dropped[reason] += 1

    def _advance(self, p: _Pending) -> None:
        """Moves one handshake on as far as what has arrived allows, without blocking."""
        try:
            while True:
                if p.step == "welcome":
                    sent = p.sock.send(p.out)
                    p.out = p.out[sent:]
                    if p.out:
                        return  # the selector says when it can take more
                    p.step, p.want = "proof", wire.PROOF_BYTES
                    self._selector.modify(p.sock, selectors.EVENT_READ, p)
                    continue
                chunk = p.sock.recv(p.want - len(p.buf))
                if not chunk:
                    self._drop(p)  # it went away
                    return
                p.buf += chunk
                if len(p.buf) < p.want:
                    return
                raw, p.buf = bytes(p.buf), bytearray()
                if not self._step(p, raw):
                    return
        except BlockingIOError:
            return
        except wire.ProtocolError as e:
            log.debug("peer connection %s refused in its handshake: %s", p.addr, e)
            self._drop(p, "bad_request")
        except OSError as e:
            log.debug("peer connection %s ended in its handshake: %s", p.addr, e)
            self._drop(p)
        except Exception:  # one connection's surprise must not end the thread every handshake runs on
            log.exception("peer connection %s: handshake failed", p.addr)
            self._drop(p, "bad_request")

    def _step(self, p: _Pending, raw: bytes) -> bool:
        """Takes one complete frame of the handshake; False when the connection left the handshake."""
        if p.step == "hello":
            p.version, p.plane, p.client_nonce, n = wire.decode_hello_fixed(raw)
            p.nonce = os.urandom(wire.NONCE_BYTES)
            if n:
                p.step, p.want = "node_id", n
                return True
            return self._hello(p)
        if p.step == "node_id":
            p.node_id = raw.decode(errors="replace")
            return self._hello(p)
        # the proof
        if not wire.proofs_match(self.token, b"client", p.client_nonce, p.nonce, raw):
            self._refuse("auth")
            self._log_refusal(f"peer {p.addr} ({p.node_id}) refused: wrong token", "auth")
            self._finish(p, wire.encode_ready(wire.refusal_code("auth"), "missing or wrong token"))
            return False
        self._admit(p)
        return False

    def _hello(self, p: _Pending) -> bool:
        """The whole HELLO is here: refused, or challenged (WELCOME)."""
        host = p.addr[0]
        uid = self._uid_of(p.sock, p.addr) if _is_loopback(host) else None
        p.source = (host, uid)
        refusal = ""
        if p.version != wire.VERSION:
            refusal, message = "version", f"peer protocol version {p.version}; this engine speaks {wire.VERSION}"
        elif p.plane != wire.PLANES[self.plane.name]:
            refusal, message = "plane", f"this engine's --peer-transport is {self.plane.name}"
        elif self.token is None and not local_uid_allowed(uid):
            refusal, message = "auth", "no token: only the engine's own user may fetch (or pass --token on both)"
        if refusal:
            self._refuse(refusal)
            self._log_refusal(f"peer {p.addr} ({p.node_id}) refused: {message}", refusal)
            welcome = wire.encode_welcome(wire.refusal_code(refusal), p.nonce, bytes(wire.PROOF_BYTES), b"", message)
            self._finish(p, welcome)
            return False
        server_proof = (
            wire.proof(self.token, b"server", p.client_nonce, p.nonce) if self.token else bytes(wire.PROOF_BYTES)
        )
        p.out = wire.encode_welcome(wire.OK, p.nonce, server_proof, self.plane.offer())
        p.step = "welcome"
        self._selector.modify(p.sock, selectors.EVENT_WRITE, p)
        return True

    def _finish(self, p: _Pending, last: bytes) -> None:
        self._forget(p)
        _send_and_close(p.sock, last)

    def _admit(self, p: _Pending) -> None:
        """An authenticated connection: a place among the sessions (the longest-idle one's at the cap), READY, and
        a thread of its own."""
        self._forget(p)
        now = time.monotonic()
        with self._lock:
            live = [s for s in self._sessions.values() if not s.closing]
            if len(live) >= self.max_connections:
                idle = [s for s in live if not s.busy]
                if idle:
                    victim = min(idle, key=lambda s: s.last_active)
                    victim.closing = True
                    _shutdown(victim.sock)  # its thread wakes up, finds it closing and ends
                    self.counters.refusals["idle_closed"] += 1
                else:
                    self.counters.refusals["busy"] += 1
                    busy = f"this engine serves {self.max_connections} peer connections, all busy: retry later"
                    self._log_refusal(f"peer {p.addr} ({p.node_id}) refused: {busy}", "busy")
                    _send_and_close(p.sock, wire.encode_ready(wire.refusal_code("busy"), busy))
                    return
            self._next_id += 1
            session = _Session(p.sock, f"peer:{self._next_id}", last_active=now)
            self._sessions[p.sock] = session
            self.counters.connections = sum(1 for s in self._sessions.values() if not s.closing)
        ready = wire.encode_ready(wire.OK)
        try:
            if p.sock.send(ready) != len(ready):  # 3 bytes to a socket with nothing queued: never partial in practice
                raise ConnectionError("READY sent in part")
            p.sock.setblocking(True)
        except OSError as e:
            log.debug("peer %s (%s) went away at READY: %s", p.addr, p.node_id, e)
            self._end(session)
            return
        threading.Thread(target=self._serve, args=(session, p.addr), name="kvseal-peer", daemon=True).start()

    def _refuse(self, reason: str) -> None:
        with self._lock:
            self.counters.refusals[reason] += 1

    # ---------------------------------------------------------------- sessions (a thread each)

    def _end(self, session: _Session) -> None:
        session.sock.close()
        with self._lock:
            self._sessions.pop(session.sock, None)
            self.counters.connections = sum(1 for s in self._sessions.values() if not s.closing)

    def _serve(self, session: _Session, addr: Any) -> None:
        conn = session.sock
        try:
            conn.settimeout(IDLE_TIMEOUT_S)
            while self._serve_fetch(session):
                pass
        except (OSError, wire.ProtocolError) as e:  # the fetcher went away or spoke nonsense: its loss only
            log.debug("peer connection %s ended: %s", addr, e)
        finally:
            self._end(session)

    def _uid_of(self, conn: socket.socket, addr: Any) -> int | None:
        try:
            server_host = conn.getsockname()[0]  # the address it reached, also when listening on every interface
        except OSError:
            return None
        return tcp_peer_uid(addr[0], addr[1], self.port, server_host=server_host)

    def _serve_fetch(self, session: _Session) -> bool:
        conn, owner = session.sock, session.owner
        with self._lock:
            session.busy = False
            session.last_active = time.monotonic()
        try:
            body = recv_frame(conn, wire.MAX_FETCH_BODY)
        except ConnectionError:
            return False  # the fetcher is done with this connection
        with self._lock:
            if session.closing:
                return False  # closed to make room while this fetch arrived: the fetcher sees the connection end
            session.busy = True
        try:
            f = wire.decode_fetch(body)
        except wire.ProtocolError as e:
            self._refuse("bad_request")
            conn.sendall(wire.encode_refusal("bad_request", str(e)))
            return False
        ttl_s = min(max(f.timeout_ms, 1) / 1000, self.timeout_s)
        start = time.perf_counter()
        try:
            pin = self.engine.pin_for_peer(f.namespace_final, f.digest, f.page_bytes, f.hashes, owner, ttl_s)
        except InvalidArgument as e:
            self._refuse("bad_request")
            conn.sendall(wire.encode_refusal("bad_request", str(e)))
            return False
        if pin.refusal:
            self._refuse(pin.refusal)
            log.warning("peer fetch of %s refused (%s): %s", f.namespace_final, pin.refusal, pin.message)
            conn.sendall(wire.encode_refusal(pin.refusal, pin.message))
            return True
        try:
            conn.sendall(wire.encode_answer(pin.offsets))
            if pin.views:
                conn.settimeout(ttl_s)
                sums = self._hasher.submit(checksums, pin.views) if f.checksums else None  # while the bytes move
                if not self.plane.pulls:
                    self.plane.send(conn, pin.views)
                if sums is not None:
                    conn.sendall(wire.encode_sums(sums.result()))
                if self.plane.pulls:
                    recv_exact(conn, 1)  # DONE: the fetcher has read the pages
                conn.settimeout(IDLE_TIMEOUT_S)
        finally:
            if pin.lease_id:
                self.engine.unpin_for_peer(pin.lease_id, owner)
        with self._lock:
            c = self.counters
            c.fetches += 1
            c.blocks += len(pin.views)
            c.bytes += f.page_bytes * len(pin.views)
            c.seconds += time.perf_counter() - start
        return True


def _is_loopback(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _send_and_close(sock: socket.socket, last: bytes) -> None:
    """Sends a refusal if the socket takes it now (it is small and nothing else is queued) and closes."""
    try:
        sock.send(last)
    except OSError:
        pass
    sock.close()
