"""Offline hit-ratio simulation of a prefix cache: replays requests (block-hash lists in prompt order) against a
policy of kvseal.core.policies (`simulate`) or against Belady's offline optimum (`belady`), with room for
`capacity` blocks. A request's hit is its leading resident blocks (hash chains: a block is usable only after its
predecessor); every other block of it is then stored, room made by eviction. Pure: no engine, no I/O.

A request's keys must be distinct, as the blocks of a hash chain are.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from kvseal.core.policies import Policy


@dataclass(frozen=True)
class SimResult:
    """`hits`: blocks found (leading resident blocks of each request), `lookups`: blocks asked, `per_request`:
    each request's hit in blocks, in order."""

    hits: int
    lookups: int
    per_request: list[int]

    @property
    def ratio(self) -> float:
        """hits / lookups (0.0 for no lookups)."""
        return self.hits / self.lookups if self.lookups else 0.0


def simulate(requests: Sequence[Sequence[bytes]], capacity: int, policy: Policy) -> SimResult:
    """Replays `requests` against `policy` (empty, built for `capacity`) with room for `capacity` blocks.

    Per request: hit = its leading held blocks, `policy.hit(hit)`; its later held blocks go to `policy.refresh`;
    `policy.admit(missing)` says how many of its missing blocks, leading, to store; room for them is made by one
    `policy.evict(k, protected=every key of the request)`; `policy.insert` stores them. When fewer than k held
    blocks are unprotected (a request nearly as long as the cache), every unprotected block is evicted and only
    the leading missing blocks that fit are stored. Capacity 0 stores nothing (no admit, evict or insert).
    Raises RuntimeError when the policy breaks evict's contract."""
    hits = lookups = 0
    per_request: list[int] = []
    for request in requests:
        h = 0
        while h < len(request) and request[h] in policy:
            h += 1
        policy.hit(request[:h])
        rest = request[h:]
        held = [key for key in rest if key in policy]
        if held:
            policy.refresh(held)
        missing = [key for key in rest if key not in policy] if held else list(rest)
        if missing and capacity > 0:
            store = missing[: policy.admit(missing)]
            need = len(policy) + len(store) - capacity
            if need > 0:
                evictable = len(policy) - h - len(held)
                if need > evictable:
                    store = store[: capacity - h - len(held)]
                    need = evictable
                if need > 0 and len(policy.evict(need, set(request))) != need:
                    raise RuntimeError(f"{policy.name} did not evict {need} of {evictable} evictable keys")
            if store:
                policy.insert(store)
        hits += h
        lookups += len(request)
        per_request.append(h)
    return SimResult(hits, lookups, per_request)


def belady(requests: Sequence[Sequence[bytes]], capacity: int, admission: bool) -> SimResult:
    """Belady's offline optimum under `simulate`'s rules: room is made by evicting the held unprotected block whose
    next use is farthest (a block's next position in the flattened trace, so only blocks never used again tie).
    With `admission`, a missing block is not stored when the cache is full and its next use is no nearer than
    every evictable block's (nor are the blocks after it in the request, whose next uses are no nearer).

    Next uses are computed in one backward pass over the trace; the farthest
    held block comes from a max-heap with lazy deletion (an entry is stale when its key is no longer held or its
    next use changed), so a block costs O(log n). With hash chains a block whose predecessor is gone cannot hit
    until that predecessor returns; the next-use order never evicts a predecessor before its successor (a
    successor is never used without it), so this is the usual reference, though not provably optimal for
    prefix hits."""
    never = 1 << 62
    positions = [0]
    for request in requests:
        positions.append(positions[-1] + len(request))
    next_use = [never] * positions[-1]
    last: dict[bytes, int] = {}
    for i in range(len(requests) - 1, -1, -1):
        base = positions[i]
        for j, key in enumerate(requests[i]):
            next_use[base + j] = last.get(key, never)
            last[key] = base + j
    held: dict[bytes, int] = {}  # key -> its next use
    heap: list[tuple[int, bytes]] = []  # (-next use, key), stale entries included
    hits = lookups = 0
    per_request: list[int] = []
    for i, request in enumerate(requests):
        base = positions[i]
        h = 0
        while h < len(request) and request[h] in held:
            h += 1
        missing: list[tuple[int, bytes]] = []
        for j, key in enumerate(request):
            use = next_use[base + j]
            if key in held:
                held[key] = use
                heapq.heappush(heap, (-use, key))
            else:
                missing.append((use, key))
        aside: list[tuple[int, bytes]] = []  # valid entries of this request's keys, pushed back after it
        protected = frozenset(request) if missing and len(held) + len(missing) > capacity else frozenset()
        for use, key in missing if capacity > 0 else ():
            if len(held) >= capacity:
                while heap and (held.get(heap[0][1]) != -heap[0][0] or heap[0][1] in protected):
                    entry = heapq.heappop(heap)
                    if held.get(entry[1]) == -entry[0]:
                        aside.append(entry)
                if not heap or (admission and use >= -heap[0][0]):
                    break
                del held[heapq.heappop(heap)[1]]
            held[key] = use
            heapq.heappush(heap, (-use, key))
        for entry in aside:
            heapq.heappush(heap, entry)
        hits += h
        lookups += len(request)
        per_request.append(h)
    return SimResult(hits, lookups, per_request)
