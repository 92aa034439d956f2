"""The serving side of peer fetch: other nodes' engines connect here and read this node's pages.

Who may connect: with a token, whoever proves it in the handshake; without one (loopback only), a process of the
engine's own user or root, as the kernel's socket table says (kvseal.server.peers). Only the engine's own user's
blocks are offered, the same ones its announcer tells the MetaServer about.

A fetch names namespace_final and the full layout digest: a digest or page size other than this node's for that
namespace is refused (counted by reason). What is sent is pinned under a lease that expires after the fetch's
timeout (capped by --peer-timeout), and unpinned as soon as it is sent (tcp) or the fetcher says DONE (pull planes):
a fetcher that stalls or dies costs a lease until its timeout, never a leaked pin. Every page goes with its XXH3-64,
computed while pinned (on another thread, while the pages are sent), so the fetcher can refuse a page that changed
or arrived damaged.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvseal.engine.engine import Engine
from kvseal.errors import InvalidArgument
from kvseal.peer import wire
from kvseal.peer.tcp import checksums, recv_exact, recv_frame
from kvseal.server.peers import local_uid_allowed, tcp_peer_uid

log = logging.getLogger("kvseal.peer")
HANDSHAKE_TIMEOUT_S = 5.0
IDLE_TIMEOUT_S = 120.0


@dataclass(slots=True)
class ServeCounters:
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    fetches: int = 0
    refusals: Counter[str] = field(default_factory=Counter)
    connections: int = 0  # open now


class PeerServer:
    """Listens on (host, port) and serves fetches, one thread per connection (at most `max_connections`)."""

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
    ) -> None:
        self.engine = engine
        self.plane = plane
        self.token = token
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self.counters = ServeCounters()
        self._lock = threading.Lock()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(128)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._next_id = 0
        self._hasher = ThreadPoolExecutor(2, thread_name_prefix="kvseal-peer-hash")

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def start(self) -> None:
        threading.Thread(target=self._accept, name="kvseal-peer-accept", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            for conn in list(self._conns):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._hasher.shutdown(wait=False)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return
            with self._lock:
                if len(self._conns) >= self.max_connections:
                    self.counters.refusals["busy"] += 1
                    conn.close()
                    continue
                self._conns.add(conn)
                self.counters.connections = len(self._conns)
                self._next_id += 1
                owner = f"peer:{self._next_id}"
            threading.Thread(target=self._serve, args=(conn, addr, owner), name="kvseal-peer", daemon=True).start()

    def _refuse(self, reason: str) -> None:
        with self._lock:
            self.counters.refusals[reason] += 1

    def _serve(self, conn: socket.socket, addr: Any, owner: str) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            if self._handshake(conn, addr):
                conn.settimeout(IDLE_TIMEOUT_S)
                while self._serve_fetch(conn, owner):
                    pass
        except (OSError, wire.ProtocolError) as e:  # the fetcher went away or spoke nonsense: its loss only
            log.debug("peer connection %s ended: %s", addr, e)
        finally:
            conn.close()
            with self._lock:
                self._conns.discard(conn)
                self.counters.connections = len(self._conns)

    def _handshake(self, conn: socket.socket, addr: Any) -> bool:
        version, plane, client_nonce, n = wire.decode_hello_fixed(recv_exact(conn, wire.HELLO_FIXED))
        node_id = recv_exact(conn, n).decode(errors="replace")
        nonce = os.urandom(wire.NONCE_BYTES)
        refusal = ""
        if version != wire.VERSION:
            refusal, message = "version", f"peer protocol version {version}; this engine speaks {wire.VERSION}"
        elif plane != wire.PLANES[self.plane.name]:
            refusal, message = "plane", f"this engine's --peer-transport is {self.plane.name}"
        elif self.token is None and not local_uid_allowed(self._uid_of(addr)):
            refusal, message = "auth", "no token: only the engine's own user may fetch (or pass --token on both)"
        if refusal:
            self._refuse(refusal)
            log.warning("peer %s (%s) refused: %s", addr, node_id, message)
            conn.sendall(wire.encode_welcome(wire.refusal_code(refusal), nonce, bytes(wire.PROOF_BYTES), b"", message))
            return False
        server_proof = wire.proof(self.token, b"server", client_nonce, nonce) if self.token else bytes(wire.PROOF_BYTES)
        conn.sendall(wire.encode_welcome(wire.OK, nonce, server_proof, self.plane.offer()))
        got = recv_exact(conn, wire.PROOF_BYTES)
        if not wire.proofs_match(self.token, b"client", client_nonce, nonce, got):
            self._refuse("auth")
            log.warning("peer %s (%s) refused: wrong token", addr, node_id)
            conn.sendall(wire.encode_ready(wire.refusal_code("auth"), "missing or wrong token"))
            return False
        conn.sendall(wire.encode_ready(wire.OK))
        return True

    def _uid_of(self, addr: Any) -> int | None:
        host, port = addr[0], addr[1]
        return tcp_peer_uid(host, port, self.port, server_host=self.host)

    def _serve_fetch(self, conn: socket.socket, owner: str) -> bool:
        try:
            body = recv_frame(conn, wire.MAX_FETCH_BODY)
        except ConnectionError:
            return False  # the fetcher is done with this connection
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
