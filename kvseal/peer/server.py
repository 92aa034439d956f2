"""The serving side of peer fetch: other nodes' engines connect here and read this node's pages.

Who may connect, and the bounds on connections that have not authenticated yet: kvseal.peer.handshake. Only the
engine's own user's blocks are offered, the same ones its announcer tells the MetaServer about.

A fetch names namespace_final and the full layout digest: a digest or page size other than this node's for that
namespace is refused (counted by reason). What is sent is pinned under a lease that expires after the fetch's
timeout (capped by --peer-timeout), and unpinned as soon as it is sent (tcp) or the fetcher says DONE (pull planes):
a fetcher that stalls or dies costs a lease until its timeout, never a leaked pin. Every page goes with its XXH3-64,
computed while pinned (on another thread, while the pages are sent), so the fetcher can refuse a page that changed
or arrived damaged.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvseal.copy.kernel import checksums
from kvseal.engine.engine import Engine
from kvseal.errors import InvalidArgument
from kvseal.peer.handshake import HANDSHAKE_TIMEOUT_S, MAX_HANDSHAKES, Handshakes
from kvseal.peer.tcp import recv_frame
from kvseal.sockets import recv_exact
from kvseal.wire import peer as wire

log = logging.getLogger("kvseal.peer")
IDLE_TIMEOUT_S = 120.0


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
class _Session:
    """An authenticated connection, served by a thread of its own."""

    sock: socket.socket
    owner: str
    busy: bool = False  # in a fetch
    closing: bool = False  # asked to close to make room
    last_active: float = 0.0


class PeerServer:
    """Listens on (host, port) and serves fetches.

    Handshakes run on one thread, without blocking, for every connection at once (kvseal.peer.handshake: at most
    `max_handshakes` unauthenticated connections, each for at most `handshake_timeout_s`): a connection costs a
    thread only once it has authenticated (READY), and at most `max_connections` authenticated ones are open (at the
    cap, the longest-idle one is closed for a newcomer; with none idle, the newcomer is refused "busy").
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
        self._next_id = 0
        self._hasher = ThreadPoolExecutor(2, thread_name_prefix="kvseal-peer-hash")
        self._handshakes = Handshakes(
            self._sock,
            plane,
            token,
            max_handshakes=self.max_handshakes,
            timeout_s=handshake_timeout_s,
            refuse=self._refuse,
            count=self._count_handshaking,
            admit=self._admit,
        )

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def start(self) -> None:
        self._handshakes.start()

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._handshakes.stop()
        with self._lock:
            for session in list(self._sessions.values()):
                _shutdown(session.sock)
        self._hasher.shutdown(wait=False)

    # ---------------------------------------------------------------- from the handshake thread

    def _refuse(self, reason: str) -> None:
        with self._lock:
            self.counters.refusals[reason] += 1

    def _count_handshaking(self, n: int) -> None:
        with self._lock:
            self.counters.handshaking = n

    def _admit(self, sock: socket.socket, addr: Any, node_id: str) -> str | None:
        """An authenticated connection: a place among the sessions (the longest-idle one's at the cap), READY, and
        a thread of its own; None, or why it is refused "busy" (counted: the handshake thread says so)."""
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
                    return f"this engine serves {self.max_connections} peer connections, all busy: retry later"
            self._next_id += 1
            session = _Session(sock, f"peer:{self._next_id}", last_active=now)
            self._sessions[sock] = session
            self.counters.connections = sum(1 for s in self._sessions.values() if not s.closing)
        ready = wire.encode_ready(wire.OK)
        try:
            if sock.send(ready) != len(ready):  # 3 bytes to a socket with nothing queued: never partial in practice
                raise ConnectionError("READY sent in part")
            sock.setblocking(True)
        except OSError as e:
            log.debug("peer %s (%s) went away at READY: %s", addr, node_id, e)
            self._end(session)
            return None
        threading.Thread(target=self._serve, args=(session, addr), name="kvseal-peer", daemon=True).start()
        return None

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


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
