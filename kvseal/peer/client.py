"""The fetching side of peer fetch: which peer holds a prefix (the MetaServer's QueryPrefix), and pulling its pages
straight into this node's pool pages.

The fetcher checks the serving end as the server checks it: with a token, the server must prove it knows the token;
without one, the server's socket must belong to this engine's user or root (so a local user who announced a forged
address to a tokenless MetaServer cannot plant blocks), and only loopback peers are tried. Every page must arrive
whole and match the XXH3-64 the server computed while it was pinned; the leading pages that do are sealed, the rest
are a miss. A peer that refuses, stalls past the timeout or dies costs the fetch, never a partial page.

A lookup remembers every holder the MetaServer named, longest prefix first (holders that failed a fetch lately
last): when the chosen one refuses or fails before giving a page, the fetch moves on to the next, within the one
--peer-timeout the fetch has (a connection and its handshake may take a quarter of it at most), so a forged or
dead holder costs a moment, not the blocks.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvseal.auth import is_loopback, local_uid_allowed, tcp_peer_uid
from kvseal.copy.kernel import checksums
from kvseal.core.layout import Layout
from kvseal.errors import FailedPrecondition
from kvseal.peer.tcp import recv_frame
from kvseal.proto import kvseal_pb2 as pb
from kvseal.proto import kvseal_pb2_grpc as pb_grpc
from kvseal.sockets import recv_exact
from kvseal.wire import peer as wire

log = logging.getLogger("kvseal.peer")
CHUNK_BYTES = 64 << 20  # pages pinned on the serving node per fetch frame
HASH_GROUP_BYTES = 8 << 20  # pages received before they are handed to the hashing thread
MAX_IDLE = 4  # idle connections kept per peer
META_RETRY_S = 2.0  # after a failed lookup, queries do not ask the MetaServer for this long
ALTERNATES_KEPT = 1024  # lookups whose other holders are kept for their fetch
FAILED_HOLDER_S = 10.0  # a holder that refused or failed a fetch is tried after the others for this long


class PeerRefused(FailedPrecondition):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(slots=True)
class FetchCounters:
    blocks: int = 0  # pages fetched and verified (peer hits)
    bytes: int = 0
    seconds: float = 0.0
    fetches: int = 0
    lookups: int = 0
    offered: int = 0  # lookups that found a peer with more of the prefix
    fallbacks: int = 0  # fetches moved on to another holder after one refused or failed
    refusals: Counter[str] = field(default_factory=Counter)  # by reason: the server's, or ours (checksum, auth)
    failures: Counter[str] = field(default_factory=Counter)  # unreachable, closed, timeout, protocol, metaserver


@dataclass(slots=True)
class _Connection:
    sock: socket.socket
    offer: bytes


class PeerFetcher:
    """Implements kvseal.engine.engine.PeerSource for an engine whose node is `node_id` at the MetaServer."""

    def __init__(
        self,
        metaserver: str,
        node_id: str,
        plane: Any,
        *,
        token: str | None = None,
        timeout_s: float = 10.0,
        meta_timeout_s: float = 0.25,
        checksums: bool = True,
        on_meta_rpc: Callable[[str, str, float], None] = lambda method, code, seconds: None,
    ) -> None:
        self.node_id = node_id
        self.plane = plane
        self.token = token
        self.timeout_s = timeout_s
        self.meta_timeout_s = meta_timeout_s
        self.checksums = checksums
        self.counters = FetchCounters()
        self._on_meta_rpc = on_meta_rpc
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel = grpc.insecure_channel(metaserver)
        self._meta = pb_grpc.MetaServerStub(self._channel)
        self._lock = threading.Lock()
        self._idle: dict[str, list[_Connection]] = {}
        self._meta_down_until = 0.0
        self._alternates: OrderedDict[tuple[str, bytes], list[str]] = OrderedDict()  # (ns, first hash) -> addresses
        self._failed_until: dict[str, float] = {}  # holder address -> until when it is tried last
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="kvseal-fetch-hash")

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for c in conns:
                c.sock.close()
        self._channel.close()
        self._hasher.shutdown(wait=False)

    # ---------------------------------------------------------------- the MetaServer

    def _meta_call(self, method: str, request: Any) -> Any:
        start = time.perf_counter()
        code = "OK"
        try:
            return getattr(self._meta, method)(request, timeout=self.meta_timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            code = e.code().name
            raise
        finally:
            self._on_meta_rpc(method, code, time.perf_counter() - start)

    def lookup(self, namespace_final: str, hashes: list[bytes]) -> tuple[str, int] | None:
        """(address, count) of the live peer other than this node holding the longest prefix of `hashes`."""
        if time.monotonic() < self._meta_down_until:
            return None  # it failed moments ago: a miss now beats a stalled query
        self.counters.lookups += 1
        try:
            request = pb.QueryPrefixRequest(namespace_final=namespace_final, block_hashes=hashes)
            r = self._meta_call("QueryPrefix", request)
        except grpc.RpcError as e:
            self.counters.failures["metaserver"] += 1
            self._meta_down_until = time.monotonic() + META_RETRY_S
            log.warning("MetaServer QueryPrefix failed (%s): misses for %.0f s", e.code().name, META_RETRY_S)
            return None
        holders = [(n.address, n.prefix) for n in r.nodes if n.node_id != self.node_id and n.prefix > 0]
        if not holders:
            return None
        now = time.monotonic()
        holders.sort(key=lambda holder: self._failed_until.get(holder[0], 0.0) > now)  # stable: longest first still
        with self._lock:
            key = (namespace_final, hashes[0])
            self._alternates.pop(key, None)
            self._alternates[key] = [address for address, _ in holders[1:]]
            while len(self._alternates) > ALTERNATES_KEPT:
                self._alternates.popitem(last=False)
        self.counters.offered += 1
        return holders[0]

    def nodes(self) -> list[dict[str, Any]]:
        """Live nodes as the MetaServer lists them (for /v1/peers); raises grpc.RpcError when it is unreachable."""
        r = self._meta_call("ListNodes", pb.ListNodesRequest())
        return [
            {
                "node_id": n.node_id,
                "address": n.address,
                "self": n.node_id == self.node_id,
                "expires_in_ms": n.expires_in_ms,
                "blocks": n.blocks,
            }
            for n in r.nodes
        ]

    # ---------------------------------------------------------------- fetching

    def fetch(
        self,
        address: str,
        namespace_final: str,
        layout: Layout,
        hashes: list[bytes],
        offsets: list[int],
        destinations: list[memoryview],
    ) -> tuple[int, bool]:
        """Fetches from `address`, then, while nothing arrived, from the other holders its lookup named."""
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            others = self._alternates.pop((namespace_final, hashes[0]), []) if hashes else []
        got, unsettled = self._fetch_from(address, namespace_final, layout, hashes, offsets, destinations, deadline)
        for other in others:
            if got or unsettled or time.monotonic() >= deadline:
                break
            log.info("fetch of %s from %s gave nothing: trying %s, another holder", namespace_final, address, other)
            self.counters.fallbacks += 1
            address = other
            got, unsettled = self._fetch_from(address, namespace_final, layout, hashes, offsets, destinations, deadline)
        return got, unsettled

    def _fetch_from(
        self,
        address: str,
        namespace_final: str,
        layout: Layout,
        hashes: list[bytes],
        offsets: list[int],
        destinations: list[memoryview],
        deadline: float,
    ) -> tuple[int, bool]:
        start = time.perf_counter()
        got = 0
        unsettled = False
        failed = True  # until the fetch ends without an error
        conn = None
        try:
            conn = self._connection(address, deadline)
            per_chunk = max(1, CHUNK_BYTES // layout.page_bytes)
            while got < len(hashes):
                n = self._fetch_chunk(conn, namespace_final, layout, hashes, offsets, destinations, got, per_chunk)
                got += n
                if n < min(per_chunk, len(hashes) - (got - n)):
                    break  # the peer holds less than it announced (evicted since)
            self._put_back(address, conn)
            conn = None
            failed = False
        except PeerRefused as e:
            self.counters.refusals[e.reason] += 1
            log.warning("peer %s refused a fetch of %s: %s", address, namespace_final, e)
        except wire.ProtocolError as e:
            self.counters.failures["protocol"] += 1
            log.warning("peer %s: %s", address, e)
        except OSError as e:  # ConnectionError and the data plane's TransferFailed included
            unsettled = bool(getattr(e, "pending", False))
            self.counters.failures[_failure_reason(e)] += 1
            log.warning("peer %s: fetch failed: %s", address, e)
        finally:
            if conn is not None:
                conn.sock.close()
            if failed and got == 0:
                self._holder_failed(address)
            c = self.counters
            c.fetches += 1
            c.blocks += got
            c.bytes += got * layout.page_bytes
            c.seconds += time.perf_counter() - start
        return got, unsettled

    def _holder_failed(self, address: str) -> None:
        """`address` refused or failed a fetch: later lookups try it after the other holders for a while."""
        now = time.monotonic()
        with self._lock:
            if len(self._failed_until) >= ALTERNATES_KEPT:
                self._failed_until = {a: t for a, t in self._failed_until.items() if t > now}
            self._failed_until[address] = now + FAILED_HOLDER_S

    def wait_settled(self, timeout_s: float) -> bool:
        wait = getattr(self.plane, "wait_settled", None)
        return True if wait is None else bool(wait(timeout_s))

    def _fetch_chunk(
        self,
        conn: _Connection,
        namespace_final: str,
        layout: Layout,
        hashes: list[bytes],
        offsets: list[int],
        destinations: list[memoryview],
        at: int,
        count: int,
    ) -> int:
        """Fetches hashes[at : at + count]; returns how many leading pages arrived whole and verified."""
        wanted = hashes[at : at + count]
        request = wire.Fetch(
            namespace_final, layout.digest, layout.page_bytes, int(self.timeout_s * 1000), self.checksums, wanted
        )
        conn.sock.sendall(wire.encode_fetch(request))
        answer = wire.decode_answer(recv_frame(conn.sock, wire.MAX_ANSWER_BODY), len(wanted))
        if isinstance(answer, tuple):
            raise PeerRefused(*answer)
        n = len(answer)
        if n == 0:
            return 0
        views = destinations[at : at + n]
        hashing: list[Future[list[int]]] = []
        if self.plane.pulls:
            lengths = [layout.page_bytes] * n
            self.plane.receive(conn.offer, answer, offsets[at : at + n], lengths, self.timeout_s)
            if self.checksums:
                hashing.append(self._hasher.submit(checksums, views))
        else:  # received in groups, each hashed on another thread while the next one arrives
            group = max(1, HASH_GROUP_BYTES // layout.page_bytes)
            for i in range(0, n, group):
                self.plane.receive_inline(conn.sock, views[i : i + group])
                if self.checksums:
                    hashing.append(self._hasher.submit(checksums, views[i : i + group]))
        if self.checksums:
            want = wire.decode_sums(recv_frame(conn.sock, 8 * n), n)
            got = [s for f in hashing for s in f.result()]
            if got != want:
                self.counters.refusals["checksum"] += 1
                log.warning("a page fetched for %s failed its checksum: dropped with what follows", namespace_final)
                n = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
        if self.plane.pulls:
            conn.sock.sendall(b"\x01")  # DONE: the server unpins
        return n

    def _put_back(self, address: str, conn: _Connection) -> None:
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if len(idle) < MAX_IDLE:
                idle.append(conn)
                return
        conn.sock.close()

    def _connection(self, address: str, deadline: float) -> _Connection:
        """A pooled connection to `address` that is still open, else a new one (connected and authenticated). The
        serving node closes idle connections (after its idle timeout, or for a newcomer at its cap): reusing one
        would fail the fetch and put a good holder last."""
        while True:
            with self._lock:
                idle = self._idle.get(address)
                conn = idle.pop() if idle else None
            if conn is None:
                break
            if _still_open(conn.sock):
                return conn
            conn.sock.close()
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        if self.token is None and not is_loopback(f"[{host}]:{port}"):
            raise PeerRefused("auth", f"{address} is not on loopback and this engine has no token to prove")
        # connecting and the handshake take a quarter of the fetch's time at most: a holder that stalls there
        # leaves the rest to the next holder
        timeout = max(0.05, min(deadline - time.monotonic(), max(1.0, self.timeout_s / 4)))
        sock = socket.create_connection((host, int(port)), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            offer = self._handshake(sock, host, int(port))
            sock.settimeout(self.timeout_s)
        except BaseException:
            sock.close()
            raise
        return _Connection(sock, offer)

    def _handshake(self, sock: socket.socket, host: str, port: int) -> bytes:
        nonce = os.urandom(wire.NONCE_BYTES)
        sock.sendall(wire.encode_hello(self.plane.name, nonce, self.node_id))
        code, server_nonce, server_proof, offer_len = wire.decode_welcome_fixed(recv_exact(sock, wire.WELCOME_FIXED))
        offer = recv_exact(sock, offer_len)
        message = recv_exact(sock, int.from_bytes(recv_exact(sock, 2), "little")).decode(errors="replace")
        if code != wire.OK:
            raise PeerRefused(wire.refusal_reason(code), message)
        if self.token is None:
            local_host, local_port = sock.getsockname()[:2]
            uid = tcp_peer_uid(host, port, local_port, server_host=local_host)
            if not local_uid_allowed(uid):
                raise PeerRefused("auth", f"the process at {host}:{port} is not this engine's user (uid {uid})")
        elif not wire.proofs_match(self.token, b"server", nonce, server_nonce, server_proof):
            raise PeerRefused("auth", f"{host}:{port} does not know this engine's token")
        client_proof = wire.proof(self.token, b"client", nonce, server_nonce) if self.token else bytes(32)
        sock.sendall(client_proof)
        ready = recv_exact(sock, 3)
        message = recv_exact(sock, int.from_bytes(ready[1:3], "little")).decode(errors="replace")
        if ready[0] != wire.OK:
            raise PeerRefused(wire.refusal_reason(ready[0]), message)
        return offer


def _still_open(sock: socket.socket) -> bool:
    """Whether an idle connection can carry a fetch: nothing to read. A closed one reads EOF, and a serving node says
    nothing unasked, so a byte means the stream is out of step. (Non-blocking for the check: a socket with a
    timeout would wait for readiness first.)"""
    timeout = sock.gettimeout()
    sock.settimeout(0.0)
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.settimeout(timeout)
    return False


def _failure_reason(e: OSError) -> str:
    if isinstance(e, TimeoutError) or e.errno == errno.ETIMEDOUT:
        return "timeout"
    if isinstance(e, ConnectionRefusedError) or e.errno == errno.ECONNREFUSED:
        return "unreachable"
    return "closed"  # reset, closed mid-page, the data plane's transfer aborted
