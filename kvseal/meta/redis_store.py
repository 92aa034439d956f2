"""RedisStore: the MetaStore contract (kvseal.meta.store) on a real redis-server, so that several MetaServer
processes on one Redis database (stateless replicas) see one state, and a MetaServer restart forgets nothing.

Key layout (P = the prefix, "kvseal:meta:" unless told otherwise; every key of the store starts with it):

    P epoch                      string   random hex, SET NX: the same for every RedisStore on the database
    P nodes                      zset     node_id -> expires (score)               which nodes exist, by expiry
    P node:{node_id}             hash     session, address, expires (repr of the float, exact)
    P held:{node_id}             set      block keys the node's current session announced
    P blk:{namespace_final}:{h}  set      node_ids holding that block; h = the hash in lowercase hex

A block key is unambiguous although namespaces and node ids may contain ':' (hex never does, so the last ':'
ends the namespace; node ids only ever end a key). Only the current session's blocks exist: a new session drops
the node's old ones in the same step, so held: needs no session in its name. A member of held: is the full block
key, so dropping a node needs no parsing: SREM node_id from each key it names.

What is atomic: every operation is one Lua script (one round trip, EVALSHA via register_script), and Redis runs a
script with nothing interleaved. So the invariant "node n is in blk:b exactly when b is in held:n and node:n
exists" holds between any two operations of any replicas: heartbeat (set NX the epoch, check the session, refuse
another session while the current one is live, or a new node past the node cap, drop the old session's blocks,
write the node), announce / withdraw of a whole batch (check the session and, for announce, the caps, then both
sides of every block), unregister, purge (find the forgotten nodes and drop them) and the readers query_prefix
(up to any number of hashes, with the staleness of every holder) and nodes, which see one snapshot.

The epoch is written by the constructor and again (SET NX) by every heartbeat, in the heartbeat's script: the
epoch key and the node state are created together, so when Redis loses its data (restarted without persistence,
FLUSHDB) the next heartbeat makes a new epoch and its answer tells the nodes to announce again. `epoch` is what
the last constructor or heartbeat of this object saw.

Time comes only from the arguments (`now`): never Redis' clock or this process'. Floats travel as repr() strings,
which Redis and Lua parse back to the same double, so staleness and purge decide exactly as MemoryStore does.

Requirements on Redis: a standalone server (or one primary): the scripts touch keys they compute, which Redis
Cluster forbids; no key eviction (maxmemory-policy noeviction, the default): an evicted key would break the
invariant above. A connection failure or a timeout raises StoreUnavailable, which is both redis'
ConnectionError and the built-in ConnectionError (what the MetaServer turns into UNAVAILABLE).
"""

from __future__ import annotations

import builtins
import functools
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis

from kvseal.errors import Unavailable
from kvseal.meta.store import Block, NodeHeld, NodeHit, NodeInfo, StoreFull

PREFIX = "kvseal:meta:"
F = TypeVar("F", bound=Callable[..., Any])


class StoreUnavailable(Unavailable, redis.exceptions.ConnectionError, builtins.ConnectionError):
    """Redis cannot be reached (refused, reset, timed out): kvseal's Unavailable, redis' ConnectionError and the
    built-in one."""


def _unavailable(method: F) -> F:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except StoreUnavailable:
            raise
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
            raise StoreUnavailable(f"{type(e).__name__}: {e}") from e

    return wrapper  # type: ignore[return-value]


# Lua helper shared by the scripts that drop a node: ARGV[1] is always the prefix.
_DROP = """
local P = ARGV[1]
local function drop_blocks(id)
  local held = P .. 'held:' .. id
  for _, bk in ipairs(redis.call('SMEMBERS', held)) do
    redis.call('SREM', bk, id)
  end
  redis.call('DEL', held)
end
local function drop(id)
  drop_blocks(id)
  redis.call('DEL', P .. 'node:' .. id)
  redis.call('ZREM', P .. 'nodes', id)
end
"""

# ARGV: prefix, new epoch, node_id, session, address, expires, now, max_nodes -> {fresh, epoch}, or {-1, epoch,
# address, expires} when another session holds the node live, or {-2, epoch} when max_nodes are known already
_HEARTBEAT = (
    _DROP
    + """
redis.call('SET', P .. 'epoch', ARGV[2], 'NX')
local epoch = redis.call('GET', P .. 'epoch')
local id, session = ARGV[3], ARGV[4]
local node = P .. 'node:' .. id
local current = redis.call('HMGET', node, 'session', 'address', 'expires')
local fresh = 0
if current[1] ~= session then
  if current[1] then
    if tonumber(current[3]) > tonumber(ARGV[7]) then
      return {-1, epoch, current[2], current[3]}
    end
  else
    local max = tonumber(ARGV[8])
    if max > 0 and redis.call('ZCARD', P .. 'nodes') >= max then
      return {-2, epoch}
    end
  end
  fresh = 1
  drop_blocks(id)
end
redis.call('HSET', node, 'session', session, 'address', ARGV[5], 'expires', ARGV[6])
redis.call('ZADD', P .. 'nodes', ARGV[6], id)
return {fresh, epoch}
"""
)

# ARGV: prefix, node_id, session, block keys... -> how many changed, -1 for another session
_WITHDRAW = """
local P, id = ARGV[1], ARGV[2]
if redis.call('HGET', P .. 'node:' .. id, 'session') ~= ARGV[3] then
  return -1
end
local held = P .. 'held:' .. id
local n = 0
for i = 4, #ARGV do
  if redis.call('SREM', held, ARGV[i]) == 1 then
    redis.call('SREM', ARGV[i], id)
    n = n + 1
  end
end
return n
"""

# ARGV: prefix, node_id, session, max_node, max_total, block keys... -> how many newly held, -1 for another session,
# -2 past max_node, -3 past max_total (0: no cap; the total is every known node's blocks)
_ANNOUNCE = """
local P, id = ARGV[1], ARGV[2]
if redis.call('HGET', P .. 'node:' .. id, 'session') ~= ARGV[3] then
  return -1
end
local held = P .. 'held:' .. id
local max_node, max_total = tonumber(ARGV[4]), tonumber(ARGV[5])
if max_node > 0 or max_total > 0 then
  local new, seen = 0, {}
  for i = 6, #ARGV do
    if not seen[ARGV[i]] and redis.call('SISMEMBER', held, ARGV[i]) == 0 then
      new = new + 1
    end
    seen[ARGV[i]] = true
  end
  if new > 0 and max_node > 0 and redis.call('SCARD', held) + new > max_node then
    return -2
  end
  if new > 0 and max_total > 0 then
    local total = new
    for _, other in ipairs(redis.call('ZRANGE', P .. 'nodes', 0, -1)) do
      total = total + redis.call('SCARD', P .. 'held:' .. other)
    end
    if total > max_total then
      return -3
    end
  end
end
local n = 0
for i = 6, #ARGV do
  if redis.call('SADD', held, ARGV[i]) == 1 then
    redis.call('SADD', ARGV[i], id)
    n = n + 1
  end
end
return n
"""

# KEYS: block keys in query order; ARGV: prefix, now -> {node_id, prefix, address, ...}
_QUERY = """
local P, now = ARGV[1], tonumber(ARGV[2])
local live, counts = {}, {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local expires = redis.call('ZSCORE', P .. 'nodes', id)
  if expires and tonumber(expires) > now then
    live[#live + 1] = id
    counts[id] = 1
  end
end
local out = {}
for _, id in ipairs(live) do
  out[#out + 1] = id
end
for i = 2, #KEYS do
  if #live == 0 then break end
  local keep = {}
  for _, id in ipairs(live) do
    if redis.call('SISMEMBER', KEYS[i], id) == 1 then
      keep[#keep + 1] = id
      counts[id] = counts[id] + 1
    end
  end
  live = keep
end
local reply = {}
for _, id in ipairs(out) do
  reply[#reply + 1] = id
  reply[#reply + 1] = counts[id]
  reply[#reply + 1] = redis.call('HGET', P .. 'node:' .. id, 'address')
end
return reply
"""

# ARGV: prefix, "(now" -> {node_id, session, address, expires, blocks, ...}
_NODES = """
local P = ARGV[1]
local reply = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', P .. 'nodes', ARGV[2], '+inf')) do
  local h = redis.call('HMGET', P .. 'node:' .. id, 'session', 'address', 'expires')
  reply[#reply + 1] = id
  reply[#reply + 1] = h[1]
  reply[#reply + 1] = h[2]
  reply[#reply + 1] = h[3]
  reply[#reply + 1] = redis.call('SCARD', P .. 'held:' .. id)
end
return reply
"""

# ARGV: prefix, node_id, session -> 1 dropped, 0 not the current session
_UNREGISTER = (
    _DROP
    + """
if redis.call('HGET', P .. 'node:' .. ARGV[2], 'session') ~= ARGV[3] then
  return 0
end
drop(ARGV[2])
return 1
"""
)

# ARGV: prefix, upper bound on expires (a little above now - forget_after_s), now, forget_after_s -> how many
# forgotten. The exact test is MemoryStore's `expires + forget_after_s <= now`, in doubles as in Python.
_PURGE = (
    _DROP
    + """
local now, forget = tonumber(ARGV[3]), tonumber(ARGV[4])
local found = redis.call('ZRANGEBYSCORE', P .. 'nodes', '-inf', ARGV[2], 'WITHSCORES')
local n = 0
for i = 1, #found, 2 do
  if tonumber(found[i + 1]) + forget <= now then
    drop(found[i])
    n = n + 1
  end
end
return n
"""
)


def _num(x: float) -> str:
    """A float as Redis and Lua parse it back to the same double."""
    return repr(float(x))


class RedisStore:
    """The MetaStore contract on redis-server: every replica on the database sees the same nodes, blocks and
    epoch; nothing is kept in this object but the connection pool and the last epoch seen."""

    threadsafe = True  # every call is one script, which Redis runs with nothing interleaved

    @_unavailable
    def __init__(self, url: str, *, prefix: str = PREFIX, timeout_s: float = 5.0) -> None:
        self._prefix = prefix
        # a Redis that stops answering (not only one that refuses) must fail calls, never hang them
        self._r = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._heartbeat = self._r.register_script(_HEARTBEAT)
        self._announce = self._r.register_script(_ANNOUNCE)
        self._withdraw = self._r.register_script(_WITHDRAW)
        self._query = self._r.register_script(_QUERY)
        self._nodes = self._r.register_script(_NODES)
        self._unregister = self._r.register_script(_UNREGISTER)
        self._purge = self._r.register_script(_PURGE)
        key = prefix + "epoch"
        pipe = self._r.pipeline(transaction=True)
        pipe.set(key, os.urandom(8).hex(), nx=True)
        pipe.get(key)
        _, epoch = pipe.execute()
        self.epoch: str = epoch.decode()

    def _block_key(self, block: Block) -> str:
        namespace_final, h = block
        return f"{self._prefix}blk:{namespace_final}:{h.hex()}"

    @_unavailable
    def heartbeat(
        self, node_id: str, session: str, address: str, now: float, stale_after_s: float, *, max_nodes: int = 0
    ) -> bool:
        reply = self._heartbeat(
            args=[self._prefix, os.urandom(8).hex(), node_id, session, address, _num(now + stale_after_s), _num(now)]
            + [max_nodes]
        )
        self.epoch = reply[1].decode()
        if reply[0] == -1:
            raise NodeHeld(node_id, reply[2].decode(), float(reply[3]))
        if reply[0] == -2:
            raise StoreFull("nodes", max_nodes)
        return bool(reply[0])

    @_unavailable
    def announce(
        self, node_id: str, session: str, blocks: Sequence[Block], *, max_node: int = 0, max_total: int = 0
    ) -> int:
        args = [self._prefix, node_id, session, max_node, max_total, *map(self._block_key, blocks)]
        n = int(self._announce(args=args))
        if n == -2:
            raise StoreFull("blocks_per_node", max_node)
        if n == -3:
            raise StoreFull("blocks", max_total)
        return n

    @_unavailable
    def withdraw(self, node_id: str, session: str, blocks: Sequence[Block]) -> int:
        return int(self._withdraw(args=[self._prefix, node_id, session, *map(self._block_key, blocks)]))

    @_unavailable
    def query_prefix(self, namespace_final: str, hashes: Sequence[bytes], now: float) -> list[NodeHit]:
        if not hashes:
            return []
        keys = [self._block_key((namespace_final, h)) for h in hashes]
        reply = self._query(keys=keys, args=[self._prefix, _num(now)])
        hits = [NodeHit(reply[i].decode(), reply[i + 2].decode(), int(reply[i + 1])) for i in range(0, len(reply), 3)]
        return sorted(hits, key=lambda hit: (-hit.prefix, hit.node_id))

    @_unavailable
    def unregister(self, node_id: str, session: str) -> bool:
        return bool(self._unregister(args=[self._prefix, node_id, session]))

    @_unavailable
    def nodes(self, now: float) -> list[NodeInfo]:
        reply = self._nodes(args=[self._prefix, "(" + _num(now)])
        infos = [
            NodeInfo(
                reply[i].decode(), reply[i + 1].decode(), reply[i + 2].decode(), float(reply[i + 3]), int(reply[i + 4])
            )
            for i in range(0, len(reply), 5)
        ]
        return sorted((info for info in infos if info.expires > now), key=lambda info: info.node_id)

    @_unavailable
    def purge(self, now: float, forget_after_s: float) -> int:
        bound = now - forget_after_s
        # widened by a few ulps: the script decides with MemoryStore's exact test, this only narrows the scan
        bound += 4 * math.ulp(max(abs(now), abs(forget_after_s), abs(bound)))
        return int(self._purge(args=[self._prefix, _num(bound), _num(now), _num(forget_after_s)]))

    def collect(self, budget: int) -> bool:
        return False  # a dropped node's blocks go in the script that drops it

    @_unavailable
    def ping(self) -> None:
        self._r.ping()

    def close(self) -> None:
        self._r.close()
