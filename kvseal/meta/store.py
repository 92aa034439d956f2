"""The MetaServer's store: which live node holds which (namespace_final, block hash). Two implementations of one
contract: MemoryStore (embedded, the default) and RedisStore (kvseal.meta.redis_store: a real redis-server, so
several stateless MetaServer replicas agree and a MetaServer restart forgets nothing).

The contract (tests/test_meta_store.py runs it against both):
- A node is (node_id, session, address). `heartbeat` makes it live until `now + stale_after_s`; a heartbeat with
  another session than the node's current one is a restart of that node: what the old session announced is gone.
- `announce` / `withdraw` name blocks of the node's current session; for any other session they change nothing
  and return -1 (the node must heartbeat first: its session is unknown here, e.g. after a MetaServer restart).
- `query_prefix(namespace_final, hashes, now)`: for every live node (not past its staleness) holding hashes[0],
  the count of leading hashes it holds contiguously, longest first. A node past its staleness is invisible at
  once; `purge(now, forget_after_s)` forgets nodes stale for forget_after_s or longer (and their blocks).
- `unregister(node_id, session)` drops a node and its blocks at once.
- `epoch`: changes when the store forgets everything (a MemoryStore's process restarted). Nodes that see a new
  epoch in a heartbeat's answer announce their resident blocks again (backfill).
Time is given by the caller (the server's clock), so the logic is tested without sleeping.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Protocol

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


class MetaStore(Protocol):
    epoch: str

    def heartbeat(self, node_id: str, session: str, address: str, now: float, stale_after_s: float) -> bool:
        """Returns True when this starts a new session of the node (first heartbeat, or the node restarted)."""
        ...

    def announce(self, node_id: str, session: str, blocks: Sequence[Block]) -> int: ...

    def withdraw(self, node_id: str, session: str, blocks: Sequence[Block]) -> int: ...

    def query_prefix(self, namespace_final: str, hashes: Sequence[bytes], now: float) -> list[NodeHit]: ...

    def unregister(self, node_id: str, session: str) -> bool: ...

    def nodes(self, now: float) -> list[NodeInfo]: ...

    def purge(self, now: float, forget_after_s: float) -> int: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class _Node:
    session: str
    address: str
    expires: float
    blocks: set[Block] = field(default_factory=set)


class MemoryStore:
    """Everything in this process: a restart forgets it (a new epoch tells the nodes to announce again)."""

    def __init__(self) -> None:
        self.epoch = os.urandom(8).hex()
        self._nodes: dict[str, _Node] = {}
        self._holders: dict[Block, set[str]] = {}

    def heartbeat(self, node_id: str, session: str, address: str, now: float, stale_after_s: float) -> bool:
        node = self._nodes.get(node_id)
        fresh = node is None or node.session != session
        if fresh:
            if node is not None:
                self._drop(node_id)
            node = self._nodes[node_id] = _Node(session, address, 0.0)
        assert node is not None
        node.address = address
        node.expires = now + stale_after_s
        return fresh

    def _current(self, node_id: str, session: str) -> _Node | None:
        node = self._nodes.get(node_id)
        return node if node is not None and node.session == session else None

    def announce(self, node_id: str, session: str, blocks: Sequence[Block]) -> int:
        node = self._current(node_id, session)
        if node is None:
            return -1
        new = [b for b in dict.fromkeys(blocks) if b not in node.blocks]  # a block twice in a batch counts once
        node.blocks.update(new)
        for b in new:
            self._holders.setdefault(b, set()).add(node_id)
        return len(new)

    def withdraw(self, node_id: str, session: str, blocks: Sequence[Block]) -> int:
        node = self._current(node_id, session)
        if node is None:
            return -1
        gone = [b for b in dict.fromkeys(blocks) if b in node.blocks]
        node.blocks.difference_update(gone)
        for b in gone:
            self._forget_holder(b, node_id)
        return len(gone)

    def _forget_holder(self, block: Block, node_id: str) -> None:
        holders = self._holders.get(block)
        if holders is not None:
            holders.discard(node_id)
            if not holders:
                del self._holders[block]

    def query_prefix(self, namespace_final: str, hashes: Sequence[bytes], now: float) -> list[NodeHit]:
        if not hashes:
            return []
        first = self._holders.get((namespace_final, hashes[0]), ())
        live = [n for n in first if self._nodes[n].expires > now]
        if not live:
            return []
        # every hash's holders at once (C-level map/zip), then each node's run: far cheaper than set intersections
        held = list(map(self._holders.get, zip(repeat(namespace_final), hashes)))
        counts = {
            n: next((i for i, nodes in enumerate(held) if nodes is None or n not in nodes), len(held)) for n in live
        }
        hits = [NodeHit(n, self._nodes[n].address, c) for n, c in counts.items()]
        return sorted(hits, key=lambda hit: (-hit.prefix, hit.node_id))

    def unregister(self, node_id: str, session: str) -> bool:
        if self._current(node_id, session) is None:
            return False
        self._drop(node_id)
        return True

    def _drop(self, node_id: str) -> None:
        node = self._nodes.pop(node_id)
        for b in node.blocks:
            self._forget_holder(b, node_id)

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

    def close(self) -> None:
        pass
