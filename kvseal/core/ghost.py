"""What-if hit ratios for one namespace: the hit ratio it would have had with 2x and 4x its pool, and with no
eviction at all, estimated online from the requests it sees and the blocks its pool evicts and stores (`WhatIf`),
for /metrics and /v1/namespaces. Pure: no I/O, no locks, not thread-safe (the store feeds each namespace's under
the engine's lock: counted queries, evictions, sealed saves).

The caller calls, per request: `observe(keys, hit)` at lookup (the request's block hashes in prompt order and its
actual hit, the leading resident blocks), then `evicted(victims)` for the blocks the pool evicts (in eviction
order) and `stored(blocks)` for the blocks it stores. `estimates()` reads the ratios.

Larger pools (a ghost index). Under LRU a pool of C blocks holds the C most recently used blocks, a pool of kC the
kC most recent ones (LRU's inclusion property), so a block that misses at C hits at kC when fewer than kC blocks
were used after it: the C resident ones and the blocks evicted after it. `WhatIf` keeps the recently evicted
blocks, newest first, as a ghost of 3 x C entries: `near`, the newest C (resident in a 2C pool), and `far`, the
next 2C (resident in a 4C pool). A ghost block that is stored again leaves the ghost (it is resident again), and
the ghost's next newest block moves up, so ranks count only blocks still evicted, as the LRU stack does. A request
that hit h blocks would have hit, at 2x, h plus the next blocks while each is in `near` or (given `held`) held by
the pool now: a block held now is held by the larger pool too, and a hash chain only hits up to its first miss.
At 4x, `far` counts as well. So hit <= hit_2x <= hit_4x per request: the ratios are monotone by construction.

This is exact for a pool that evicts a pure LRU stack, given `held`. The engine's policies are nearly one: under
"lru" a resident block past a request's first miss is not touched (a skipped re-save), so that block is older at C
than it would be at kC, and "prefix-lru" orders a request's blocks head first, so the larger pools would evict a
little differently; tests/test_ghost.py measures the error against the offline simulator (kvseal.bench.hitsim with LRU
at 2C and 4C), tests/test_eviction_replay.py the store's against each policy's simulation. `resize` keeps the
ghost's order and re-splits it for the new capacity: the blocks the old pool evicted are then ranked against the
new one.

Ghost entries are 8-byte fingerprints of the block hashes (their first 8 bytes as an int): block hashes are
already uniformly random (blake2b / sha256 chains), so no further hashing is needed, and a false match among
3C entries has probability about 3C / 2^64 per lookup. The ghost is a log of fingerprints in eviction order with
a live flag each (a bytearray) and a dict fingerprint -> its latest eviction's sequence; `near` and `far` are
where they begin in the log. An entry that leaves (evicted again, or stored) only has its flag cleared; moving
where near or far begins skips cleared entries (bytearray.find), so an eviction costs a dict insert, a log append
and, per entry moved out of the ghost, a dict delete (0.4 us a block evicted with C = 65,536; two OrderedDicts
took 1 us); the log is cut when more than half of it is older than far.
Memory per ghost entry, measured with tracemalloc (4C evictions into a full ghost, C = 1k..150k): 136 to 142
bytes: the dict's entry and index slot, the int fingerprint and sequence (32-36 bytes each), the log's slot and
flag, and the log's cut-off tail. So 3C entries cost about 430 bytes per pool block, next to the block itself
(KiBs to MiBs).

No eviction (a HyperLogLog). With an unbounded pool every block seen before is resident, so a request misses
exactly its blocks never seen before: in a hash chain a block's hash covers every block before it, so once a
request's block is new every later block of the request is new too, and its hit in the unbounded pool is its
leading blocks seen before. The unbounded pool's misses are then the first sightings, one per distinct block, and
its hit ratio is 1 - distinct / lookups. The blocks counted are those that missed (past the actual hit): a block of
the hit prefix is resident, so it was stored before (the unbounded pool holds it too), and every block that
misses is stored afterwards. They are counted by a HyperLogLog of 2^12 registers (4 KiB; standard error
1.04 / sqrt(4096) = 1.6 %; the plain algorithm's estimate is biased up by about 1.5 % where it switches from
linear counting, around 10k distinct blocks). The ratio is clamped to at least the 4x estimate: an unbounded
pool hits at least as much as a 4x one, but 1 - distinct / lookups can come out lower: the distinct estimate can
be over (HLL error), and blocks that were resident before `WhatIf` started, or stored without a lookup (a peer's,
the SSD tier's), count as first sightings when they are evicted and then miss, though an unbounded pool would
still hold them; and the 4x estimate itself can be slightly over for a pool that is not a pure LRU stack.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


def _digest(key: bytes) -> bytes:
    """At least 16 uniformly random bytes for `key`: the key itself when it is a hash of 16 bytes or more (block
    hashes are 32), else a blake2b of it (short keys, as tests use)."""
    return key if len(key) >= 16 else hashlib.blake2b(key, digest_size=16).digest()


def _fingerprint(key: bytes) -> int:
    """The ghost's 8-byte fingerprint of `key`: its first 8 bytes (the HyperLogLog uses the next 8)."""
    return int.from_bytes(_digest(key)[:8], "little")


def _fingerprints(keys: Sequence[bytes]) -> list[int]:
    """`_fingerprint` of each key: in one numpy pass when the keys are all of one length of at least 16 bytes."""
    sizes = set(map(len, keys))
    if len(sizes) != 1 or (size := sizes.pop()) < 16:
        return list(map(_fingerprint, keys))
    fps: list[int] = np.ndarray((len(keys),), "<u8", b"".join(keys), 0, (size,)).tolist()
    return fps


PENDING_KEYS = 4096  # keys HyperLogLog.add_keys lets wait (hash arrays, hash lists) before counting them in one pass


class HyperLogLog:
    """Counts distinct keys in 2^`precision` one-byte registers (Flajolet, Fusy, Gandouet, Meunier, "HyperLogLog:
    the analysis of a near-optimal cardinality estimation algorithm", 2007), from 64-bit words: a word's low
    `precision` bits pick a register, which keeps the largest rank seen, the rank being the position of the
    first 1 bit in the word's other 64 - precision bits, from the most significant (1 for a leading 1; all zero
    gives 65 - precision). `estimate()` is the bias-corrected raw estimate alpha_m m^2 / sum(2^-register), or
    linear counting m ln(m / zero registers) when the raw estimate is at most 5m/2 and a register is still zero.
    With 64-bit words no large-range correction is needed. Standard error 1.04 / sqrt(m)."""

    def __init__(self, precision: int = 12) -> None:
        if not 7 <= precision <= 16:
            raise ValueError(f"precision must be 7..16 (alpha_m's formula needs m >= 128), not {precision}")
        self._p = precision
        self._m = 1 << precision
        self._mask = self._m - 1
        self._width = 64 - precision  # the bits a rank is read from
        self._registers = bytearray(self._m)
        self._pending: list[tuple[bytes, int]] = []  # hash arrays' bytes not counted yet, and their key size
        self._pending_keys = 0
        # the estimate is biased up by ~1.5 % (mean) just above its switch from linear counting (n ~ 2.5m): the
        # plain algorithm's known weak spot, which HLL++'s empirical tables or Ertl's estimator (2017) remove

    def add_word(self, word: int) -> None:
        """Counts a uniformly random 64-bit word."""
        j = word & self._mask
        rank = self._width - (word >> self._p).bit_length() + 1
        if rank > self._registers[j]:
            self._registers[j] = rank

    def add(self, key: bytes) -> None:
        """Counts `key` (bytes 8..16 of a hash key, the ghost using the first 8; a short key is hashed first)."""
        self.add_word(int.from_bytes(_digest(key)[8:16], "little"))

    def add_keys(self, keys: Sequence[bytes]) -> None:
        """Counts every key as `add` does. A hash array of at least 16 bytes per key (as kvseal.wire.lane.HashArray:
        n keys of `size` bytes back to back in `buffer` from `offset`), or keys all of one length of at least 16
        bytes (a list of block hashes), is copied aside in one piece and counted with others in one numpy pass once
        PENDING_KEYS are waiting (or `estimate` is asked), so that a query's misses cost no Python per block and no
        numpy call per query; other keys (short ones, of mixed lengths) are counted one by one."""
        n = len(keys)
        if not n:
            return
        buffer, size = getattr(keys, "buffer", None), getattr(keys, "size", 0)
        if buffer is not None and isinstance(size, int) and size >= 16:
            offset = int(getattr(keys, "offset", 0))
            self._pending.append((bytes(memoryview(buffer)[offset : offset + n * size]), size))
        elif buffer is None and len(sizes := set(map(len, keys))) == 1 and (size := sizes.pop()) >= 16:
            self._pending.append((b"".join(keys), size))
        else:
            for key in keys:
                self.add(key)
            return
        self._pending_keys += n
        if self._pending_keys >= PENDING_KEYS:
            self._count_pending()

    def _count_pending(self) -> None:
        """Counts the waiting hash arrays' keys, each key's bytes 8..16 as `add` reads them, one pass per key size."""
        by_size: dict[int, list[bytes]] = {}
        for data, size in self._pending:
            by_size.setdefault(size, []).append(data)
        self._pending, self._pending_keys = [], 0
        registers = np.frombuffer(self._registers, np.uint8)
        for size, chunks in by_size.items():
            data = b"".join(chunks)
            words = np.ndarray((len(data) // size,), "<u8", data, 8, (size,))
            high = (words >> np.uint64(self._p)).astype(np.float64)  # below 2^52: exact
            rank = self._width + 1 - np.frexp(high)[1]  # frexp's exponent is the bit length (0 for 0)
            np.maximum.at(registers, (words & np.uint64(self._mask)).astype(np.intp), rank.astype(np.uint8))

    def estimate(self) -> float:
        """The distinct words counted, estimated."""
        if self._pending:
            self._count_pending()
        m = self._m
        registers = self._registers
        alpha = 0.7213 / (1.0 + 1.079 / m)
        harmonic = math.fsum(registers.count(rank) * 2.0**-rank for rank in range(self._width + 2))
        raw = alpha * m * m / harmonic
        if raw <= 2.5 * m:
            zeros = registers.count(0)
            if zeros:
                return m * math.log(m / zeros)
        return raw


@dataclass(frozen=True)
class WhatIfEstimates:
    """`lookups`: blocks asked; `hits`: blocks found (leading resident blocks of each request); `hits_2x`,
    `hits_4x`: those a pool of 2x and 4x the capacity would have found, estimated; `ratio*`: hits / lookups (0.0
    before any lookup), `ratio_unbounded` the estimate for a pool that never evicts; `distinct_estimate`: the
    distinct blocks that missed when asked (the first sightings), estimated."""

    lookups: int
    hits: int
    hits_2x: int
    hits_4x: int
    ratio: float
    ratio_2x: float
    ratio_4x: float
    ratio_unbounded: float
    distinct_estimate: float


class WhatIf:
    """One namespace's what-if hit ratios (the module docstring says how). `capacity`: the blocks the pool holds
    for the namespace now. Memory: up to 3 x capacity ghost entries (136 to 142 bytes each) and 4 KiB."""

    def __init__(self, capacity: int) -> None:
        self._capacity = self._checked(capacity)
        self._log: list[int] = []  # fingerprints in eviction order, oldest first; entry i has sequence _base + i
        self._live = bytearray()  # per log entry, 1 while it is in the ghost (not evicted again since, nor stored)
        self._base = 0
        self._ghost: dict[int, int] = {}  # fingerprint -> the sequence of its latest eviction (the live entries)
        self._near_from = self._far_from = 0  # sequences where near and far begin (live entries below: none)
        self._n_near = self._n_far = 0
        self._distinct = HyperLogLog()
        self._lookups = self._hits = self._hits_2x = self._hits_4x = 0

    @staticmethod
    def _checked(capacity: int) -> int:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, not {capacity}")
        return capacity

    @property
    def capacity(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        """Ghost entries held (at most 3 x capacity)."""
        return self._n_near + self._n_far

    def resize(self, capacity: int) -> None:
        """The pool now holds `capacity` blocks for the namespace: the ghost is re-split (and trimmed, oldest
        first) for it."""
        self._capacity = self._checked(capacity)
        self._balance()

    def tier(self, key: bytes) -> int:
        """Where the ghost has `key`: 2 if among the newest capacity entries (a 2x pool holds it), 4 if among the
        next 2 x capacity (only a 4x pool does), 0 if not in the ghost."""
        seq = self._ghost.get(_fingerprint(key))
        return 0 if seq is None else 2 if seq >= self._near_from else 4

    def observe(self, keys: Sequence[bytes], hit: int, held: Callable[[bytes], bool] | None = None) -> None:
        """A request's block hashes in prompt order and its hit (its leading resident blocks; clamped to
        0..len(keys)). `held` (optional) says whether the pool holds a block now: it is asked only for blocks past
        the first miss; without it a 2x or 4x hit stops at the first block the ghost lacks, which undercounts when
        the pool keeps blocks past a request's evicted ones (LRU evicts a request's first blocks first)."""
        n = len(keys)
        hit = min(max(hit, 0), n)
        self._lookups += n
        self._hits += hit
        self._distinct.add_keys(keys[hit:])
        ghost, near_from = self._ghost, self._near_from
        if held is None and not ghost:  # nothing evicted: a larger pool hits no more
            self._hits_2x += hit
            self._hits_4x += hit
            return
        i = hit
        while i < n:
            key = keys[i]
            if ghost.get(_fingerprint(key), -1) >= near_from or (held is not None and held(key)):
                i += 1
            else:
                break
        self._hits_2x += i
        while i < n:
            key = keys[i]
            if _fingerprint(key) in ghost or (held is not None and held(key)):
                i += 1
            else:
                break
        self._hits_4x += i

    def evicted(self, keys: Sequence[bytes]) -> None:
        """Blocks the pool just evicted, in eviction order: they become the ghost's newest entries (a block
        evicted again without `stored` in between moves to the newest end; one evicted twice in a batch counts
        its last eviction)."""
        if not keys:
            return
        ghost, log = self._ghost, self._log
        fps = _fingerprints(keys)
        if not ghost.keys().isdisjoint(fps):  # evicted again without `stored` in between: it leaves its old place
            for fp in fps:
                if fp in ghost:
                    self._forget(ghost.pop(fp))
        start, held = self._base + len(log), len(ghost)
        ghost.update(zip(fps, range(start, start + len(fps)), strict=True))
        log += fps
        self._n_near += len(ghost) - held
        if len(ghost) - held == len(fps):
            self._live += b"\x01" * len(fps)
        else:  # a fingerprint twice in the batch: its last eviction counts
            self._live += bytes(ghost[fp] == start + k for k, fp in enumerate(fps))
        self._balance()

    def stored(self, keys: Sequence[bytes]) -> None:
        """Blocks the pool just stored: they leave the ghost (they are resident again)."""
        ghost = self._ghost
        if not ghost:  # nothing evicted yet, or all of it stored again
            return
        pop, left = ghost.pop, False
        for fp in _fingerprints(keys):
            seq = pop(fp, None)
            if seq is not None:
                self._forget(seq)
                left = True
        if left:
            self._balance()

    def _forget(self, seq: int) -> None:
        """The entry of sequence `seq` has just left the ghost (its block evicted again, or stored)."""
        self._live[seq - self._base] = 0
        if seq >= self._near_from:
            self._n_near -= 1
        else:
            self._n_far -= 1

    def _balance(self) -> None:
        """Restores near = the newest capacity entries and far = at most the next 2 x capacity, by moving where
        near and far begin over the log, skipping the entries that left."""
        capacity, log, live, base = self._capacity, self._log, self._live, self._base
        n_near, n_far, near = self._n_near, self._n_far, self._near_from - base  # near, far: log indexes
        far = self._far_from - base
        find = live.find
        if n_near > capacity:  # near's oldest become far's newest
            k = n_near - capacity
            if live.count(1, near, near + k) == k:  # none left in between: one step
                near += k
            else:
                for _ in range(k):
                    near = find(1, near) + 1
            n_near, n_far = capacity, n_far + k
        while n_near < capacity and n_far:  # far's newest becomes near's oldest
            near = live.rfind(1, 0, near)
            n_near += 1
            n_far -= 1
        if n_far > 2 * capacity:  # far's oldest leave
            ghost, k = self._ghost, n_far - 2 * capacity
            if live.count(1, far, far + k) == k:  # none left in between: one step
                for fp in log[far : far + k]:
                    del ghost[fp]
                live[far : far + k] = bytes(k)
                far += k
            else:
                for _ in range(k):
                    far = find(1, far)
                    del ghost[log[far]]
                    live[far] = 0
                    far += 1
            n_far = 2 * capacity
        if not n_far:
            far = near
        if not n_near and not n_far:
            far = near = len(log)
        if far > 1024 and far * 2 > len(log):  # no entry older than far is live
            del log[:far], live[:far]
            base += far
            near -= far
            far = 0
        self._base, self._n_near, self._n_far, self._near_from, self._far_from = (
            base,
            n_near,
            n_far,
            near + base,
            far + base,
        )

    def estimates(self) -> WhatIfEstimates:
        """The counts and ratios so far: ratio <= ratio_2x <= ratio_4x <= ratio_unbounded."""
        lookups = self._lookups
        distinct = self._distinct.estimate()
        if not lookups:
            return WhatIfEstimates(0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0, distinct)
        ratio_4x = self._hits_4x / lookups
        unbounded = min(1.0, max(ratio_4x, 1.0 - distinct / lookups))
        return WhatIfEstimates(
            lookups,
            self._hits,
            self._hits_2x,
            self._hits_4x,
            self._hits / lookups,
            self._hits_2x / lookups,
            ratio_4x,
            unbounded,
            distinct,
        )
