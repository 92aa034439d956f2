"""The MetaServer's store: which live node holds which (namespace_final, block hash). Two implementations of one
contract: MemoryStore (embedded, the default) and RedisStore (kvseal.meta.redis_store: a real redis-server, so
several stateless MetaServer replicas agree and a MetaServer restart forgets nothing).

The contract (tests/test_meta_store.py runs it against both):
- A node is (node_id, session, address). `heartbeat` makes it live until `now + stale_after_s`. A node id belongs
  to one session while that session is live: a heartbeat with another session raises NodeHeld while the current one
  is live (not past its staleness); once it is stale (or unregistered, or forgotten) the other session takes the id
  over, and what the old session announced is gone. A new node id past `max_nodes` known ones raises StoreFull.
- `announce` / `withdraw` name blocks of the node's current session; for any other session they change nothing
  and return -1 (the node must heartbeat first: its session is unknown here, e.g. after a MetaServer restart).
  An announce that would take the node past `max_node` blocks, or every node together past `max_total`, raises
  StoreFull and changes nothing (0: no cap). Counts include stale nodes not yet forgotten.
- `query_prefix(namespace_final, hashes, now)`: for every live node (not past its staleness) holding hashes[0],
  the count of leading hashes it holds contiguously, longest first. A node past its staleness is invisible at
  once; `purge(now, forget_after_s)` forgets nodes stale for forget_after_s or longer (and their blocks).
- `unregister(node_id, session)` drops a node and its blocks at once.
- `epoch`: changes when the store forgets everything (a MemoryStore's process restarted). Nodes that see a new
  epoch in a heartbeat's answer announce their resident blocks again (backfill).
- `collect(budget)`: a dropped node's blocks may be cleaned up later, at most `budget` of them per call (True while
  some remain), so that no single call holds the MetaServer long; what is dropped is invisible at once regardless.
- `threadsafe`: whether calls may run at once (RedisStore: every call is one atomic script); a MemoryStore is used
  under the MetaServer's lock.
Time is given by the caller (the server's clock), so the logic is tested without sleeping.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Protocol

from kvseal.errors import AlreadyExists, ResourceExhausted

Block = tuple[str, bytes]  # (namespace_final, block hash)


@dataclass(frozen=True, slots=True)
class NodeHit:
    node_id: str
    address: str
    prefix: int


@dataclass(frozen=True, slots=True)
class NodeInfo:
    node_id: str
    session: str
    address: str
    expires: float  # live until then
    blocks: int


class NodeHeld(AlreadyExists):
    """The node id is held by another session, live at `address` until `expires` unless it heartbeats again."""

    def __init__(self, node_id: str, address: str, expires: float) -> None:
        super().__init__(f"node {node_id!r} is held by another live session at {address}")
        self.node_id = node_id
        self.address = address
        self.expires = expires


class StoreFull(ResourceExhausted):
    """A cap would be passed: `cap` is 'nodes', 'blocks_per_node' or 'blocks'; `limit` its value."""

    def __init__(self, cap: str, limit: int) -> None:
        super().__init__(f"{cap} cap {limit} reached")
        self.cap = cap
        self.limit = limit


class MetaStore(Protocol):
    epoch: str
    threadsafe: bool

    def heartbeat(
        self, node_id: str, session: str, address: str, now: float, stale_after_s: float, *, max_nodes: int = 0
    ) -> bool:
        """Returns True when this starts a new session of the node (first heartbeat, or the node restarted after its
        old session unregistered or went stale). Raises NodeHeld, StoreFull."""
        ...

    def announce(
        self, node_id: str, session: str, blocks: Sequence[Block], *, max_node: int = 0, max_total: int = 0
    ) -> int: ...

    def withdraw(self, node_id: str, session: str, blocks: Sequence[Block]) -> int: ...

    def query_prefix(self, namespace_final: str, hashes: Sequence[bytes], now: float) -> list[NodeHit]: ...

    def unregister(self, node_id: str, session: str) -> bool: ...

    def nodes(self, now: float) -> list[NodeInfo]: ...

    def purge(self, now: float, forget_after_s: float) -> int: ...

    def collect(self, budget: int) -> bool: ...

    def ping(self) -> None:
        """Raises ConnectionError when the store cannot be reached."""
        ...

    def close(self) -> None: ...


@dataclass(eq=False, slots=True)
class _Node:
    """One session of a node id (compared by identity: a block's holders are sessions, so a dropped session's
    leftovers never count for the next session of the same id)."""

    node_id: str
    session: str
    address: str
    expires: float
    blocks: set[Block] = field(default_factory=set)
    current: bool = True  # False once dropped: its blocks wait for collect()


class MemoryStore:
    """Everything in this process: a restart forgets it (a new epoch tells the nodes to announce again)."""

    threadsafe = False

    def __init__(self) -> None:
        self.epoch = os.urandom(8).hex()
        self._nodes: dict[str, _Node] = {}
        # a block's holder, or its set of holders when there are several: most blocks have one, and a set per block
        # would cost ~200 bytes and one more object for the garbage collector to walk (a full collection of millions
        # of them stalls the whole process)
        self._holders: dict[Block, _Node | set[_Node]] = {}
        self._total = 0  # blocks of the nodes in _nodes
        self._garbage: list[_Node] = []  # dropped sessions whose blocks are still in _holders

    def heartbeat(
        self, node_id: str, session: str, address: str, now: float, stale_after_s: float, *, max_nodes: int = 0
    ) -> bool:
        node = self._nodes.get(node_id)
        fresh = node is None or node.session != session
        if node is not None and fresh and node.expires > now:
            raise NodeHeld(node_id, node.address, node.expires)
        if node is None and max_nodes and len(self._nodes) >= max_nodes:
            raise StoreFull("nodes", max_nodes)
        if fresh:
            if node is not None:
                self._drop(node_id)
            node = self._nodes[node_id] = _Node(node_id, session, address, 0.0)
        assert node is not None
        node.address = address
        node.expires = now + stale_after_s
        return fresh

    def _current(self, node_id: str, session: str) -> _Node | None:
        node = self._nodes.get(node_id)
        return node if node is not None and node.session == session else None

    def announce(
        self, node_id: str, session: str, blocks: Sequence[Block], *, max_node: int = 0, max_total: int = 0
    ) -> int:
        node = self._current(node_id, session)
        if node is None:
            return -1
        new = [b for b in dict.fromkeys(blocks) if b not in node.blocks]  # a block twice in a batch counts once
        if new and max_node and len(node.blocks) + len(new) > max_node:
            raise StoreFull("blocks_per_node", max_node)
        if new and max_total and self._total + len(new) > max_total:
            raise StoreFull("blocks", max_total)
        node.blocks.update(new)
        self._total += len(new)
        holders = self._holders
        for b in new:
            h = holders.get(b)
            if h is None:
                holders[b] = node
            elif h.__class__ is set:
                h.add(node)  # type: ignore[union-attr]
            elif h is not node:
                holders[b] = {h, node}  # type: ignore[arg-type]
        return len(new)

    def withdraw(self, node_id: str, session: str, blocks: Sequence[Block]) -> int:
        node = self._current(node_id, session)
        if node is None:
            return -1
        gone = [b for b in dict.fromkeys(blocks) if b in node.blocks]
        node.blocks.difference_update(gone)
        self._total -= len(gone)
        for b in gone:
            self._forget_holder(b, node)
        return len(gone)

    def _forget_holder(self, block: Block, node: _Node) -> None:
        h = self._holders.get(block)
        if h is node:
            del self._holders[block]
        elif h.__class__ is set:
            h.discard(node)  # type: ignore[union-attr]
            if len(h) == 1:  # type: ignore[arg-type]
                self._holders[block] = next(iter(h))  # type: ignore[call-overload]

    def query_prefix(self, namespace_final: str, hashes: Sequence[bytes], now: float) -> list[NodeHit]:
        if not hashes:
            return []
        first = self._holders.get((namespace_final, hashes[0]))
        firsts = first if first.__class__ is set else () if first is None else (first,)
        live = [n for n in firsts if n.current and n.expires > now]  # type: ignore[union-attr]
        if not live:
            return []
        # every hash's holders at once (C-level map/zip), then each node's run: far cheaper than set intersections
        held = list(map(self._holders.get, zip(repeat(namespace_final), hashes)))
        counts = {
            n: next((i for i, h in enumerate(held) if h is not n and (h.__class__ is not set or n not in h)), len(held))
            for n in live
        }
        hits = [NodeHit(n.node_id, n.address, c) for n, c in counts.items()]
        return sorted(hits, key=lambda hit: (-hit.prefix, hit.node_id))

    def unregister(self, node_id: str, session: str) -> bool:
        if self._current(node_id, session) is None:
            return False
        self._drop(node_id)
        return True

    def _drop(self, node_id: str) -> None:
        """Drops the node at once (its blocks stop counting); collect() cleans its blocks from _holders later."""
        node = self._nodes.pop(node_id)
        node.current = False
        self._total -= len(node.blocks)
        if node.blocks:
            self._garbage.append(node)

    def collect(self, budget: int) -> bool:
        while self._garbage and budget > 0:
            node = self._garbage[-1]
            blocks = node.blocks
            for _ in range(min(budget, len(blocks))):
                self._forget_holder(blocks.pop(), node)
                budget -= 1
            if not blocks:
                self._garbage.pop()
        return bool(self._garbage)

    def nodes(self, now: float) -> list[NodeInfo]:
        return [
            NodeInfo(n, node.session, node.address, node.expires, len(node.blocks))
            for n, node in sorted(self._nodes.items())
            if node.expires > now
        ]

    def purge(self, now: float, forget_after_s: float) -> int:
        dead = [n for n, node in self._nodes.items() if node.expires + forget_after_s <= now]
        for n in dead:
            self._drop(n)
        return len(dead)

    def ping(self) -> None:
        pass

    def close(self) -> None:
        pass
