"""The engine's side of the MetaServer: one thread that heartbeats, announces the blocks that became resident and
withdraws those that went, in batches — never on a Save's or Load's path (it reads the engine's change log).

When a heartbeat's answer starts a new session or carries a new epoch (the MetaServer restarted, or forgot this
node), or an announce is refused for an unknown session, the node announces every resident block again (backfill),
so discovery recovers without restarting engines. A MetaServer that does not answer costs a logged warning and a
retry with backoff; changes pile up meanwhile (up to MAX_PENDING, past which the next contact backfills instead).

A node id belongs to one live session at the MetaServer. `claim()`, before the engine serves, makes the first
heartbeat: when another session holds the id, it waits until that session would go stale (the predecessor of a
restarted engine that could not unregister), and refuses (ClaimRefused) when it is still held then (another engine
heartbeats with this id). A MetaServer at its block cap (RESOURCE_EXHAUSTED) costs one warning: the blocks it refused
are not offered to other nodes, and are not sent again until the next backfill.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

from kvseal.engine.engine import Engine
from kvseal.errors import (
    AlreadyExists,
    FailedPrecondition,
    KvsealError,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    error_for_status,
)
from kvseal.proto import kvseal_pb2 as pb
from kvseal.proto import kvseal_pb2_grpc as pb_grpc

log = logging.getLogger("kvseal.meta")
BATCH = 8192  # blocks per Announce / Withdraw
MAX_PENDING = 1 << 20
TICK_S = 0.05
CLAIM_WAIT_S = 30.0  # at most, for a node id's previous session to go stale at start
CLAIM_POLL_S = 0.25


class ClaimRefused(FailedPrecondition):
    """The MetaServer will not take this node at start: its node id is held live by another session, or the
    MetaServer refuses this engine (its user, its token). The message is one line saying what to do."""


class Announcer:
    def __init__(
        self,
        engine: Engine,
        target: str,
        node_id: str,
        address: str,
        *,
        token: str | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self.engine = engine
        self.node_id = node_id
        self.address = address
        self.session = os.urandom(8).hex()  # new at every start: what an earlier run announced is not ours
        self.timeout_s = timeout_s
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel = grpc.insecure_channel(target)
        self._stub = pb_grpc.MetaServerStub(self._channel)
        self._target = target
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvseal-announce", daemon=True)
        self._pending: dict[tuple[str, bytes], bool] = {}
        self._epoch = ""
        self._backfill = True
        self._beat_every = 1.0
        self._next_beat = 0.0
        self._retry_at = 0.0
        self._backoff = 0.5
        self._down = False
        self._calling = ""
        self._full = False  # the MetaServer refused blocks at its cap (warned once)
        self.announced = 0  # blocks announced since start (for tests and /metrics)
        self.withdrawn = 0

    def claim(self, wait_s: float = CLAIM_WAIT_S) -> None:
        """The first heartbeat, before the engine serves (see the module's docstring). A MetaServer that does not
        answer is left to the thread, which retries; one that refuses this node raises ClaimRefused."""
        deadline = None
        while True:
            try:
                self._heartbeat(time.monotonic())
                return
            except (PermissionDenied, Unauthenticated) as e:
                raise ClaimRefused(f"the MetaServer {self._target} refuses this engine: {e}") from None
            except AlreadyExists:
                pass  # held: wait below for the holder to go stale
            except KvsealError:
                return
            now = time.monotonic()
            holder = self._holder()
            if deadline is None:
                deadline = now + min(wait_s, (holder[1] if holder else 0.0) + 2 * CLAIM_POLL_S)
                log.warning(
                    "node id %r is held at the MetaServer %s by another session (at %s): waiting up to %.1f s for it "
                    "to go stale",
                    self.node_id,
                    self._target,
                    holder[0] if holder else "?",
                    deadline - now,
                )
            elif now >= deadline:
                raise ClaimRefused(
                    f"--node-id {self.node_id!r} is held by another live engine at the MetaServer {self._target} (it "
                    f"serves at {holder[0] if holder else '?'} and heartbeats): give each engine its own --node-id, "
                    "or stop the other engine"
                )
            time.sleep(CLAIM_POLL_S)

    def _holder(self) -> tuple[str, float] | None:
        """(address, seconds until stale) of the session holding this node id, as ListNodes says (None: not listed,
        or no answer)."""
        try:
            nodes = self._call("ListNodes", pb.ListNodesRequest()).nodes
        except KvsealError:
            return None
        return next(((n.address, n.expires_in_ms / 1000) for n in nodes if n.node_id == self.node_id), None)

    def start(self) -> None:
        self.engine.track_blocks()
        self._thread.start()

    def close(self) -> None:
        """Closes the channel of an announcer that was never started."""
        self._channel.close()

    def stop(self) -> None:
        """Stops, and tells the MetaServer this node is gone (its blocks are not offered to anyone any more)."""
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 1)  # at most one call in flight
        if not self._down:  # a MetaServer that does not answer forgets this node when its heartbeats stop
            try:
                self._call("Unregister", pb.UnregisterNodeRequest(node_id=self.node_id, session=self.session))
            except KvsealError:
                pass
        self._channel.close()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _call(self, method: str, request: object) -> Any:
        """The MetaServer's answer; its errors raised as kvseal.errors' classes."""
        self._calling = method
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            raise error_for_status(e.code().name, e.details() or "") from None

    def _run(self) -> None:
        while not self._stop.wait(TICK_S):
            changes = self.engine.block_changes()
            if not self._backfill:
                self._pending.update(changes)
                if len(self._pending) > MAX_PENDING:
                    self._pending.clear()
                    self._backfill = True
            now = time.monotonic()
            if now < self._retry_at:
                continue
            try:
                if now >= self._next_beat:
                    self._heartbeat(now)
                if self._backfill:
                    self._pending.clear()
                    self._announce_all()
                    self._backfill = False
                self._flush()
                if self._down:
                    log.warning("MetaServer %s is back", self._target)
                    self._down = False
                self._backoff = 0.5
            except FailedPrecondition:  # it does not know our session: start over
                self._next_beat = 0.0
                self._backfill = True
            except KvsealError as e:
                if isinstance(e, ResourceExhausted) and self._calling == "Announce":
                    if not self._full:
                        log.warning(
                            "MetaServer %s takes no more of this node's blocks (%s): those are not offered to other "
                            "nodes",
                            self._target,
                            e,
                        )
                        self._full = True
                    self._pending = {b: resident for b, resident in self._pending.items() if not resident}
                    self._backfill = False
                    continue
                if not self._down:
                    if isinstance(e, AlreadyExists | PermissionDenied):
                        log.error("MetaServer %s refuses this node: %s: retrying", self._target, e)
                    else:
                        log.warning(
                            "MetaServer %s unavailable (%s): retrying", self._target, _unreachable(self._target, e)
                        )
                    self._down = True
                self._retry_at = now + self._backoff
                self._backoff = min(self._backoff * 2, 10.0)
                self._next_beat = 0.0

    def _heartbeat(self, now: float) -> None:
        r = self._call(
            "Heartbeat", pb.HeartbeatRequest(node_id=self.node_id, session=self.session, address=self.address)
        )
        if r.new_session or r.epoch != self._epoch:
            if self._epoch:
                log.info("MetaServer epoch %s (was %s): announcing every resident block again", r.epoch, self._epoch)
            self._backfill = True
        self._epoch = r.epoch
        self._beat_every = max(r.stale_after_ms / 3000, 0.05)
        self._next_beat = now + self._beat_every

    def _announce_all(self) -> None:
        for ns, hashes in self.engine.resident_blocks().items():
            for i in range(0, len(hashes), BATCH):
                self._send("Announce", [(ns, h) for h in hashes[i : i + BATCH]])

    def _flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        try:
            for method, want in (("Withdraw", False), ("Announce", True)):
                blocks = [b for b, resident in pending.items() if resident is want]
                for i in range(0, len(blocks), BATCH):
                    self._send(method, blocks[i : i + BATCH])
        except KvsealError:
            pending.update(self._pending)
            self._pending = pending  # resend it all: announcing twice is harmless
            raise

    def _send(self, method: str, blocks: list[tuple[str, bytes]]) -> None:
        request = pb.BlocksRequest(node_id=self.node_id, session=self.session, blocks=list(_grouped(blocks)))
        self._call(method, request)
        if method == "Announce":
            self.announced += len(blocks)
            if self._full:
                log.warning("MetaServer %s takes this node's blocks again", self._target)
                self._full = False
        else:
            self.withdrawn += len(blocks)


def _grouped(blocks: list[tuple[str, bytes]]) -> Iterator[pb.NamespaceBlocks]:
    by_ns: dict[str, list[bytes]] = {}
    for ns, h in blocks:
        by_ns.setdefault(ns, []).append(h)
    for ns, hashes in by_ns.items():
        yield pb.NamespaceBlocks(namespace_final=ns, block_hashes=hashes)


def _unreachable(target: str, e: KvsealError) -> str:
    """Why the MetaServer at `target` (HOST:PORT) did not answer: its name does not resolve, or `e`'s status."""
    host = target.rsplit(":", 1)[0].strip("[]")
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as g:
        return f"{e.status}: the name {host!r} does not resolve: {g}"
    return e.status
