"""The instances of one role (prefill or decode) and the policies that pick one. Pure: no I/O.

A policy is one small class behind one contract: `pick(candidates)` returns one of `candidates` (a non-empty
subset of the pool, the whole pool when omitted) and changes nothing but its own cursor. The router counts what is
in flight on each instance; the policies only read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KvLayout:
    """What a kvseal connector says about its KV layout (the `kvseal` part of kv_transfer_params)."""

    namespace_final: str
    descriptor: str  # the canonical layout descriptor, JSON text
    node_id: str = ""  # its engine's name at the MetaServer ('' when not told)


@dataclass(slots=True, eq=False)
class Instance:
    """One vLLM instance behind the router. Mutated only by the router's event loop."""

    url: str
    inflight: int = 0  # requests the router has on it now
    ok: bool | None = None  # whether the last contact worked (None: no contact yet)
    # decode instances: the layout its probe answered, once learned (forgotten after any error from it)
    learned: bool = False
    layout: KvLayout | None = None  # None with learned: it has no kvseal connector

    def forget_layout(self) -> None:
        self.learned, self.layout = False, None

    def health(self) -> dict[str, object]:
        out: dict[str, object] = {"url": self.url, "ok": self.ok, "inflight": self.inflight}
        if self.learned:
            out["namespace_final"] = self.layout.namespace_final if self.layout else None
        return out


class RoundRobin:
    """Each pick takes the next candidate after the last pick, in pool order: with every instance a candidate, the
    instances take turns; with a subset, the turns skip the others without losing the rotation."""

    def __init__(self, pool: Sequence[Instance]) -> None:
        self.pool = tuple(pool)
        self._cursor = 0

    def pick(self, candidates: Sequence[Instance] | None = None) -> Instance:
        wanted = set(self.pool if candidates is None else candidates)
        n = len(self.pool)
        for step in range(n):
            i = (self._cursor + step) % n
            if self.pool[i] in wanted:
                self._cursor = i + 1
                return self.pool[i]
        raise ValueError("no candidate is in the pool")  # the caller guarantees a non-empty subset of the pool


class LeastInflight:
    """The candidate with the fewest requests in flight at the router; ties take turns (round robin among them), so
    idle instances share the load evenly."""

    def __init__(self, pool: Sequence[Instance]) -> None:
        self.pool = tuple(pool)
        self._turns = RoundRobin(pool)

    def pick(self, candidates: Sequence[Instance] | None = None) -> Instance:
        among = self.pool if candidates is None else candidates
        least = min(c.inflight for c in among)
        return self._turns.pick([c for c in among if c.inflight == least])


Policy = RoundRobin | LeastInflight


def make_policy(name: str, pool: Sequence[Instance]) -> Policy:
    return {"round_robin": RoundRobin, "least_inflight": LeastInflight}[name](pool)
