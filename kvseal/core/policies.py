"""Cache eviction and admission policies over opaque keys (block hashes), behind one contract (`Policy`).

A prefix cache holds blocks whose keys form hash chains: a request can use only the leading blocks of its prompt
that are resident. A policy only orders the keys it holds; the caller (kvseal.bench.hitsim, later the engine)
decides what is looked up and calls, per request:

1. `hit(prefix)`: the request's resident leading blocks, in prompt order (possibly none). It opens the request:
   the `refresh`, `admit` and `insert` calls up to the next `hit` belong to it.
2. `refresh(keys)`: blocks of the request held beyond its first miss (a re-save of resident blocks).
3. `admit(missing)`: every block the request would store, in prompt order; the policy answers how many of them,
   leading, to store (and may count them as seen).
4. `evict(n, protected)` as many times as needed to make room, `protected` being every key of the request.
5. `insert(stored)`: the blocks just stored, in prompt order (none of them held before).

Every operation is O(1) amortized per key of the request (evict: O(n + len(protected)); PrefixLRU re-touches the
request's earlier keys on each of its calls). `protected` is used as is when a set, else copied into one. Nothing
here is thread-safe.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence
from itertools import chain
from typing import Protocol

from kvseal.core.eviction import PROTECTED_SHARE, SSD_AGING_SHARE

Key = bytes  # opaque: only hashed and compared for equality (TinyLFU also fingerprints it)


class Policy(Protocol):
    """What a policy does; the module docstring says in which order a caller calls it."""

    name: str

    def __len__(self) -> int:
        """How many keys the policy holds."""
        ...

    def __contains__(self, key: object) -> bool:
        """Whether the policy holds `key`."""
        ...

    def hit(self, keys: Sequence[Key]) -> None:
        """A request's hit prefix, in prompt order; every key is held. Opens the request."""
        ...

    def refresh(self, keys: Sequence[Key]) -> None:
        """Held keys of the current request beyond its first miss, in prompt order."""
        ...

    def admit(self, candidates: Sequence[Key]) -> int:
        """How many of `candidates` (keys not held, in prompt order), leading, to store: 0..len(candidates)."""
        ...

    def insert(self, keys: Sequence[Key]) -> None:
        """Keys just stored, in prompt order: none held before; the caller made room first."""
        ...

    def evict(self, n: int, protected: Collection[Key]) -> list[Key]:
        """Removes exactly n held keys that are not in `protected` and returns them, or returns [] and changes
        nothing when fewer than n held keys are unprotected (or n <= 0)."""
        ...


def _as_set(keys: Collection[Key]) -> Collection[Key]:
    return keys if isinstance(keys, set | frozenset) else set(keys)


def _pick(order: Iterator[Key], n: int, protected: Collection[Key]) -> list[Key]:
    """The first n keys of `order` not in `protected` (the caller checked there are that many)."""
    out: list[Key] = []
    for key in order:
        if key not in protected:
            out.append(key)
            if len(out) == n:
                break
    return out


class LRU:
    """Least recently used (`kvseal serve --eviction lru`): `hit` and `insert` make their keys the most recent in
    prompt order (a request's last block ends most recent, its first the least recent of them); `refresh`
    touches nothing; `admit` takes all. Evicts the least recent unprotected keys, least recent first.
    Memory: one OrderedDict entry per key (~100 bytes)."""

    name = "lru"

    def __init__(self, capacity: int = 0) -> None:
        """`capacity` is unused (every policy takes one)."""
        self._order: OrderedDict[Key, None] = OrderedDict()  # least recent first

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def hit(self, keys: Sequence[Key]) -> None:
        move = self._order.move_to_end
        for key in keys:
            move(key)

    def refresh(self, keys: Sequence[Key]) -> None:
        pass

    def admit(self, candidates: Sequence[Key]) -> int:
        return len(candidates)

    def insert(self, keys: Sequence[Key]) -> None:
        self._order.update(dict.fromkeys(keys))

    def evict(self, n: int, protected: Collection[Key]) -> list[Key]:
        protected = _as_set(protected)
        if n <= 0 or len(self._order) - sum(key in self._order for key in protected) < n:
            return []
        victims = _pick(iter(self._order), n, protected)
        for key in victims:
            del self._order[key]
        return victims


class PrefixLRU(LRU):
    """Prefix-aware LRU (the floor the other policies must beat; the engine's default, kvseal.core.eviction,
    `kvseal serve --eviction prefix-lru`, with a client naming the request's hit prefix in its save): a request's
    blocks are touched so that its tail is evicted before its head. Each call touches its keys in reverse prompt
    order (its first key ends most recent) and then re-touches the keys earlier calls of the same request touched,
    so that after a request its hit prefix is the most recent, then its refreshed keys, then its inserted ones
    (positions are not known across calls, so refreshed and inserted keys are not interleaved by position).
    `refresh` does touch. Memory: one OrderedDict entry per key (~100 bytes), and the current request's keys
    (references)."""

    name = "prefix-lru"

    def __init__(self, capacity: int = 0) -> None:
        super().__init__(capacity)
        self._request: list[Sequence[Key]] = []  # the keys the current request's calls touched, call by call

    def _touch(self, keys: Sequence[Key]) -> None:
        order = self._order
        for key in reversed(keys):
            order.move_to_end(key)
        for earlier in reversed(self._request):
            for key in reversed(earlier):
                if key in order:
                    order.move_to_end(key)
        if keys:
            self._request.append(keys)

    def hit(self, keys: Sequence[Key]) -> None:
        self._request = []
        self._touch(keys)

    def refresh(self, keys: Sequence[Key]) -> None:
        self._touch(keys)

    def insert(self, keys: Sequence[Key]) -> None:
        self._order.update(dict.fromkeys(keys))
        self._touch(keys)


class PrefixSLRU(PrefixLRU):
    """Segmented prefix-LRU (`kvseal serve --eviction prefix-slru`, the engine's default): PrefixLRU's order in
    two segments. Stored blocks enter `probation`; a block a request hits moves to `protected`, which holds at
    most `share` x capacity blocks (its least recent ones go back to probation's most recent end). Eviction takes
    probation's least recent blocks first, then protected's. So a block hit once outlives any number of blocks
    never hit (a flood of one-off prompts or finished conversations cannot push out the shared system prompts and
    documents), and the segments keep PrefixLRU's order: a request's head outlives its tail in each.

    Exactly as the engine does it (kvseal.core.pages: one ring per size class, a second sentinel between the
    segments): `hit` promotes, in reverse prompt order, then sends protected's overflow back; `refresh` and
    `insert` touch each key within its own segment (a re-save is not a hit), re-touching the request's earlier
    calls as PrefixLRU does. Memory: PrefixLRU's, and one flag per key (a second OrderedDict)."""

    name = "prefix-slru"

    def __init__(self, capacity: int = 0, share: float = PROTECTED_SHARE) -> None:
        super().__init__(capacity)
        self._hot: OrderedDict[Key, None] = OrderedDict()  # protected, least recent first; _order is probation
        self._hot_cap = int(share * capacity)

    def __len__(self) -> int:
        return len(self._order) + len(self._hot)

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self._hot

    def _touch(self, keys: Sequence[Key]) -> None:
        cold, hot = self._order, self._hot
        for call in (keys, *reversed(self._request)):
            for key in reversed(call):
                if key in hot:
                    hot.move_to_end(key)
                elif key in cold:
                    cold.move_to_end(key)
        if keys:
            self._request.append(keys)

    def hit(self, keys: Sequence[Key]) -> None:
        self._request = [keys] if keys else []
        cold, hot = self._order, self._hot
        for key in reversed(keys):
            if key in cold:
                del cold[key]
                hot[key] = None
            else:
                hot.move_to_end(key)
        while len(hot) > self._hot_cap:
            cold[hot.popitem(last=False)[0]] = None

    def evict(self, n: int, protected: Collection[Key]) -> list[Key]:
        protected = _as_set(protected)
        if n <= 0 or len(self) - sum(key in self for key in protected) < n:
            return []
        victims = _pick(chain(self._order, self._hot), n, protected)
        for key in victims:
            if key in self._order:
                del self._order[key]
            else:
                del self._hot[key]
        return victims


class AdaptiveSLRU(PrefixSLRU):
    """PrefixSLRU whose protected share moves online, as ARC moves its target (Megiddo and Modha): the keys it
    evicts are remembered in two ghosts, `recency` (evicted never hit) and `frequency` (evicted after a hit). A
    request whose missing blocks lead with ghost keys says what a different split would have hit: each leading
    missing key found in `recency` shrinks the protected target by max(1, |frequency| / |recency|) (probation
    would have kept it), each found in `frequency` grows it by max(1, |recency| / |frequency|); the run ends at the
    first missing key in neither ghost (the blocks after it could not have hit). The target stays in
    [0, `max_share` x capacity]; protected's overflow goes back to probation's most recent end at once. Where
    frequency does not pay the target falls to 0 and the policy is PrefixLRU exactly; where it does it is a
    segmented LRU. Each ghost holds at most `capacity` keys (oldest forgotten first). O(1) per key and event.
    Memory: PrefixSLRU's, one flag per key hit, and up to 2 x capacity ghost keys."""

    name = "prefix-arc"

    def __init__(self, capacity: int = 0, max_share: float = 1.0, start: float = 0.0) -> None:
        super().__init__(capacity, share=start)
        self._target = float(self._hot_cap)
        self._max = max_share * capacity
        self._ghost_cap = max(capacity, 1)
        self._was_hit: set[Key] = set()  # held keys a request hit (protected, or demoted back to probation)
        self._recency: OrderedDict[Key, None] = OrderedDict()  # evicted never hit, oldest first
        self._frequency: OrderedDict[Key, None] = OrderedDict()  # evicted after a hit, oldest first
        self._returning: list[Key] = []  # the current request's leading missing keys found in a ghost
        self.moves = 0  # adaptations (for reports)

    def hit(self, keys: Sequence[Key]) -> None:
        self._was_hit.update(keys)
        super().hit(keys)

    def admit(self, candidates: Sequence[Key]) -> int:
        recency, frequency = self._recency, self._frequency
        self._returning = []
        for key in candidates:
            if key in recency:
                del recency[key]
                self._target = max(0.0, self._target - max(1.0, len(frequency) / max(len(recency), 1)))
            elif key in frequency:
                del frequency[key]
                self._target = min(self._max, self._target + max(1.0, len(recency) / max(len(frequency), 1)))
            else:
                break
            self._returning.append(key)
            self.moves += 1
        self._hot_cap = int(self._target)
        self._demote()
        return len(candidates)

    def insert(self, keys: Sequence[Key]) -> None:
        """Stores as PrefixSLRU does, except that keys `admit` found in a ghost were asked for twice: they enter
        protected (as ARC's ghost hits enter its frequency list), in reverse prompt order, then overflow."""
        returning = [key for key in self._returning if key in set(keys)]
        self._returning = []
        cold, hot = self._order, self._hot
        cold.update(dict.fromkeys(keys))
        for key in reversed(returning):
            del cold[key]
            hot[key] = None
            self._was_hit.add(key)
        self._demote()
        self._touch(keys)

    def _demote(self) -> None:
        cold, hot = self._order, self._hot
        while len(hot) > self._hot_cap:
            cold[hot.popitem(last=False)[0]] = None

    def evict(self, n: int, protected: Collection[Key]) -> list[Key]:
        victims = super().evict(n, protected)
        for key in victims:
            if key in self._was_hit:
                self._was_hit.discard(key)
                ghost = self._frequency
            else:
                ghost = self._recency
            ghost[key] = None
            if len(ghost) > self._ghost_cap:
                ghost.popitem(last=False)
        return victims


class ColdStartLRU(PrefixLRU):
    """PrefixLRU that starts never-seen prompts cold (scan resistance from the prefix's shape): when a request
    hit nothing and its first block is not among the first blocks of recent no-hit requests, its blocks are
    inserted as the least recent keys, its last block first to go, so a prompt that is never sent again is the
    next thing evicted instead of pushing out older blocks that are reused. Its first block is remembered, so the
    prompt's second sighting (a new shared prefix) is inserted as PrefixLRU inserts. Everything else is
    PrefixLRU's. Memory: PrefixLRU's, and up to `capacity` remembered first blocks (forgotten all at once when
    full; at least 1024)."""

    name = "prefix-cold"

    def __init__(self, capacity: int = 0) -> None:
        super().__init__(capacity)
        self._seen: set[Key] = set()
        self._seen_cap = max(capacity, 1024)
        self._cold = False
        self._hit_nothing = True

    def hit(self, keys: Sequence[Key]) -> None:
        super().hit(keys)
        self._hit_nothing = not keys
        self._cold = False

    def admit(self, candidates: Sequence[Key]) -> int:
        if self._hit_nothing and candidates:
            self._cold = candidates[0] not in self._seen
            if len(self._seen) >= self._seen_cap:
                self._seen.clear()
            self._seen.add(candidates[0])
        return len(candidates)

    def insert(self, keys: Sequence[Key]) -> None:
        if not self._cold:
            super().insert(keys)
            return
        order = self._order
        for key in keys:
            order[key] = None
            order.move_to_end(key, last=False)


class SSDLog(LRU):
    """The SSD tier's order (kvseal.ssd.tier), block by block: a FIFO log (blocks written go to its head, the oldest
    are reclaimed first), where a block hit while its record is in the oldest SSD_AGING_SHARE of the log is written
    again at its head (second chance). A model for comparing the tier with LRU at its own size: the real log
    reclaims whole segments and sees only the hits memory missed. Memory: LRU's, and a sequence number per key."""

    name = "ssd-log"

    def __init__(self, capacity: int = 0) -> None:
        super().__init__(capacity)
        self._written: dict[Key, int] = {}  # key -> when it was last written (a sequence number)
        self._clock = 0
        self.rewritten = 0  # blocks written again (the second chance's cost in writes)

    def hit(self, keys: Sequence[Key]) -> None:
        young = self._clock - math.ceil(len(self._order) * (1 - SSD_AGING_SHARE))
        for key in keys:
            if self._written[key] < young:
                self._order.move_to_end(key)
                self._written[key] = self._clock
                self._clock += 1
                self.rewritten += 1

    def insert(self, keys: Sequence[Key]) -> None:
        super().insert(keys)
        for key in keys:
            self._written[key] = self._clock
            self._clock += 1

    def evict(self, n: int, protected: Collection[Key]) -> list[Key]:
        victims = super().evict(n, protected)
        for key in victims:
            del self._written[key]
        return victims


class _Sketch:
    """A count-min sketch of 4 rows of 4-bit counters (one byte each, saturating at 15), `width` a power of two
    >= 4 x capacity, with conservative increments, behind a doorkeeper set: a key's first sighting since the last
    aging only enters the doorkeeper. Every 10 x capacity increments all counters are halved and the doorkeeper
    cleared (aging). estimate(key) = min of its 4 counters + 1 if the doorkeeper holds it.
    Memory: 4 x width bytes, and up to 10 x capacity doorkeeper entries."""

    HALVE = bytes(c >> 1 for c in range(256))

    def __init__(self, capacity: int) -> None:
        width = 1
        while width < 4 * max(capacity, 1):
            width *= 2
        self._mask = width - 1
        self._rows = [bytearray(width) for _ in range(4)]
        self._door: set[int] = set()
        self._period = 10 * max(capacity, 1)
        self._count = 0

    def _hash(self, key: Key) -> int:
        return int.from_bytes(hashlib.blake2b(key, digest_size=16).digest(), "little")

    def add(self, key: Key) -> None:
        h = self._hash(key)
        if h not in self._door:
            self._door.add(h)
        else:
            mask, rows = self._mask, self._rows
            slots = [(h >> (32 * r)) & mask for r in range(4)]
            low = min(rows[r][s] for r, s in enumerate(slots))
            if low < 15:
                for r, s in enumerate(slots):
                    if rows[r][s] == low:
                        rows[r][s] = low + 1
        self._count += 1
        if self._count >= self._period:
            self._count = 0
            self._door.clear()
            self._rows = [row.translate(self.HALVE) for row in self._rows]

    def estimate(self, key: Key) -> int:
        h = self._hash(key)
        mask = self._mask
        return min(row[(h >> (32 * r)) & mask] for r, row in enumerate(self._rows)) + (h in self._door)


class TinyLFU:
    """W-TinyLFU: a window LRU of ~`window` x capacity keys in front of a segmented main LRU (probation 20 % /
    protected 80 % of the rest), and a frequency sketch (`_Sketch`) of every key a request asks for (counted in
    `hit`, `refresh` and `admit`) that decides which of two keys stays when one must go.

    - `insert` puts new keys in the window, a request's first key most recent. While the window is over its share
      and main has room (the cache is not full yet, or the last `evict` took keys from main), keys move on to
      probation without a duel: older window keys first, then the request's leading keys. So the head of a
      request longer than the window joins main and its tail waits in the window for the duel: the tail, not the
      blocks a later request can use, is what a lost duel throws away.
    - `hit`: a window key becomes the window's most recent, a probation key moves to protected, a protected key
      becomes protected's most recent (in reverse prompt order: the request's first key ends most recent); keys
      over protected's share go back to probation's most recent end.
    - `refresh` counts its keys and makes them the most recent of their segment.
    - `admit` counts the candidates and takes them all: the duels below decide what is kept.
    - `evict(n, protected)`: the window must shed len(window) + n - its share keys for the insert to come. Each
      of those is a duel of the window's least recent unprotected key (the candidate) with main's least recent
      unprotected key (probation first, then protected): the one the sketch estimates higher stays (a winning
      candidate moves to probation), the other is evicted; a tie evicts the candidate. Once the window has shed
      enough, or has no candidate left, main's keys are evicted without a duel; without main keys candidates go,
      and as a last resort candidates this call promoted.

    Memory: one OrderedDict entry per key (~100 bytes), the sketch's 16 x capacity bytes (rounded up to a power of
    two) and its doorkeeper (up to 10 x capacity ints)."""

    name = "tinylfu"

    def __init__(self, capacity: int, window: float = 0.01) -> None:
        """`capacity`: the most keys the caller will have it hold; `window`: the window's share of them."""
        self._window_cap = min(max(1, round(capacity * window)), max(capacity, 1))
        self._main_cap = max(capacity, 1) - self._window_cap
        self._protected_cap = int(self._main_cap * 0.8)
        self._window: OrderedDict[Key, None] = OrderedDict()  # least recent first, as the two below
        self._probation: OrderedDict[Key, None] = OrderedDict()
        self._protected: OrderedDict[Key, None] = OrderedDict()
        self._sketch = _Sketch(capacity)

    def __len__(self) -> int:
        return len(self._window) + len(self._probation) + len(self._protected)

    def __contains__(self, key: object) -> bool:
        return key in self._window or key in self._probation or key in self._protected

    def hit(self, keys: Sequence[Key]) -> None:
        window, probation, protected = self._window, self._probation, self._protected
        for key in keys:
            self._sketch.add(key)
        for key in reversed(keys):
            if key in window:
                window.move_to_end(key)
            elif key in probation:
                del probation[key]
                protected[key] = None
            else:
                protected.move_to_end(key)
        while len(protected) > self._protected_cap:
            probation[protected.popitem(last=False)[0]] = None

    def refresh(self, keys: Sequence[Key]) -> None:
        for key in keys:
            self._sketch.add(key)
        for key in reversed(keys):
            for segment in (self._window, self._probation, self._protected):
                if key in segment:
                    segment.move_to_end(key)
                    break

    def admit(self, candidates: Sequence[Key]) -> int:
        for key in candidates:
            self._sketch.add(key)
        return len(candidates)

    def insert(self, keys: Sequence[Key]) -> None:
        window, probation = self._window, self._probation
        window.update(dict.fromkeys(reversed(keys)))
        room = self._main_cap - len(probation) - len(self._protected)
        over = min(len(window) - self._window_cap, room)
        older = min(over, len(window) - len(keys))
        for _ in range(older):
            probation[window.popitem(last=False)[0]] = None
        for key in reversed(keys[: over - older] if over > older else ()):
            del window[key]
            probation[key] = None

    def evict(self, n: int, protected: Collection[Key]) -> list[Key]:
        protected = _as_set(protected)
        if n <= 0 or len(self) - sum(key in self for key in protected) < n:
            return []
        estimate = self._sketch.estimate
        candidates = (key for key in self._window if key not in protected)
        mains = (key for segment in (self._probation, self._protected) for key in segment if key not in protected)
        c, v = next(candidates, None), next(mains, None)
        v_estimate = -1
        victims: list[Key] = []
        promoted: list[Key] = []
        shed = len(self._window) + n - self._window_cap  # window keys to leave for the insert to come to fit
        while len(victims) < n:
            if c is not None and (shed > 0 or v is None):
                shed -= 1
                if v is not None:
                    if v_estimate < 0:
                        v_estimate = estimate(v)
                    if estimate(c) > v_estimate:
                        victims.append(v)
                        promoted.append(c)
                        v, v_estimate = next(mains, None), -1
                        c = next(candidates, None)
                        continue
                victims.append(c)
                c = next(candidates, None)
            elif v is not None:
                victims.append(v)
                v, v_estimate = next(mains, None), -1
            else:
                victims.append(promoted.pop())
        for key in victims:
            for segment in (self._window, self._probation, self._protected):
                if key in segment:
                    del segment[key]
                    break
        for key in promoted:
            del self._window[key]
            self._probation[key] = None
        return victims


POLICIES: dict[str, Callable[[int], Policy]] = {
    "lru": LRU,
    "prefix-lru": PrefixLRU,
    "prefix-slru": PrefixSLRU,
    "prefix-arc": AdaptiveSLRU,
    "prefix-cold": ColdStartLRU,
    "tinylfu": TinyLFU,
    "ssd-log": SSDLog,
}
