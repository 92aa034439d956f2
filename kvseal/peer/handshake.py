"""The peer port's handshakes: every connection from accept() to READY, driven on one thread without blocking.

Who may connect: with a token, whoever proves it in the handshake (HELLO, WELCOME with this node's challenge and
proof, the fetcher's proof: kvseal.wire.peer); without one (loopback only), a process of the engine's own user or
root, as the kernel's socket table says (kvseal.auth). A HELLO of another protocol version or data plane is refused
in the WELCOME, a wrong proof in the READY; every refusal is counted by reason.

Bounds: an unauthenticated connection costs a descriptor, never a thread: at most `max_handshakes` of them at once,
each for at most `timeout_s` (HANDSHAKE_TIMEOUT_S: a node on the network needs a few round trips). When they are
all taken, a newcomer takes the place of a connection that has not sent its whole HELLO yet (the oldest), else of
the oldest one of the source (address, and uid on loopback) holding the most places. A known node sends its HELLO
at once and answers the challenge within a round trip, so connections that stay silent, however many, never keep
it out. Out of descriptors, the thread drops an unauthenticated connection, or refuses the next one through a
descriptor it keeps in reserve, so the listener never spins or stalls. Refusals and drops are logged at most every
few seconds, summed up, so a stranger cannot fill the log.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvseal.auth import local_uid_allowed, tcp_peer_uid
from kvseal.wire import peer as wire

log = logging.getLogger("kvseal.peer")
HANDSHAKE_TIMEOUT_S = 2.0  # from accept to READY: a node on the network needs a few round trips
MAX_HANDSHAKES = 128  # unauthenticated connections held at once
_ACCEPT_BURST = 256  # connections accepted per wake-up of the handshake thread
_DROP_LOG_INTERVAL_S = 10.0

# an authenticated connection, off the handshake's books, handed over: (socket, address, node_id) -> None when
# admitted, else why it is refused "busy" (counted already: the handshake thread says so and closes it)
Admit = Callable[[socket.socket, Any, str], str | None]


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


class Handshakes:
    """The handshake thread of a listening socket (non-blocking, owned from here on: closed when the thread ends).
    `refuse(reason)` counts a refusal, `count(n)` is told how many connections are in their handshake, and `admit`
    takes each one that authenticated."""

    def __init__(
        self,
        listener: socket.socket,
        plane: Any,
        token: str | None,
        *,
        max_handshakes: int,
        timeout_s: float,
        refuse: Callable[[str], None],
        count: Callable[[int], None],
        admit: Admit,
    ) -> None:
        self._sock = listener
        self.port = listener.getsockname()[1]
        self.plane = plane
        self.token = token
        self.max_handshakes = max_handshakes
        self.timeout_s = timeout_s
        self._refuse = refuse
        self._count = count
        self._admit = admit
        self._stop = threading.Event()
        self._pending: dict[socket.socket, _Pending] = {}  # oldest first
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._reserve_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)  # to refuse a connection at EMFILE
        self._dropped: Counter[str] = Counter()  # since the last log line
        self._dropped_logged = -_DROP_LOG_INTERVAL_S
        self._refusal_logged = -_DROP_LOG_INTERVAL_S
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvseal-peer-accept", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ends the thread, which closes the listener and every connection still in its handshake."""
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

    # ---------------------------------------------------------------- the thread

    def _run(self) -> None:
        sel = self._selector
        sel.register(self._sock, selectors.EVENT_READ, None)
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        try:
            while not self._stop.is_set():
                try:
                    self._once(sel)
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

    def _once(self, sel: selectors.BaseSelector) -> None:
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

    # ---------------------------------------------------------------- accepting, and the places it has

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
            p = _Pending(conn, addr, time.monotonic() + self.timeout_s)
            self._pending[conn] = p
            self._selector.register(conn, selectors.EVENT_READ, p)
            self._advance(p)  # a node's HELLO is usually there already
            while len(self._pending) > self.max_handshakes:
                self._drop(self._victim(), "handshake_full")
            self._count(len(self._pending))

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

    def _forget(self, p: _Pending) -> None:
        self._pending.pop(p.sock, None)
        try:
            self._selector.unregister(p.sock)
        except (KeyError, ValueError):
            pass
        self._count(len(self._pending))

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

    # ---------------------------------------------------------------- one handshake

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
        self._forget(p)
        busy = self._admit(p.sock, p.addr, p.node_id)
        if busy is not None:
            self._log_refusal(f"peer {p.addr} ({p.node_id}) refused: {busy}", "busy")
            _send_and_close(p.sock, wire.encode_ready(wire.refusal_code("busy"), busy))
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

    def _uid_of(self, conn: socket.socket, addr: Any) -> int | None:
        try:
            server_host = conn.getsockname()[0]  # the address it reached, also when listening on every interface
        except OSError:
            return None
        return tcp_peer_uid(addr[0], addr[1], self.port, server_host=server_host)


def _is_loopback(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def _send_and_close(sock: socket.socket, last: bytes) -> None:
    """Sends a refusal if the socket takes it now (it is small and nothing else is queued) and closes."""
    try:
        sock.send(last)
    except OSError:
        pass
    sock.close()
