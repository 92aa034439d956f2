"""What the engine's calls answer, and its counters: frozen values (the counters are the engine's own, copied out
by statistics())."""

from __future__ import annotations

from dataclasses import dataclass

from kvseal.core.store import StoreStatistics
from kvseal.ssd.tier import TierStatistics


@dataclass(frozen=True, slots=True)
class PeerPin:
    """Pages pinned for another node's fetch: their arena offsets and views, under `lease_id` (0: none held)."""

    lease_id: int
    offsets: list[int]
    views: list[memoryview]
    refusal: str = ""
    message: str = ""


@dataclass(frozen=True, slots=True)
class SaveResult:
    written: int
    skipped: int
    not_stored: int
    completed: int
    namespace_final: str


@dataclass(frozen=True, slots=True)
class LoadResult:
    outcome: str  # loaded | missing | refused
    loaded: int
    reason: str = ""
    message: str = ""


@dataclass(frozen=True, slots=True)
class QueryResult:
    hits: int
    lease_id: int
    lease_ttl_ms: int
    namespace_final: str
    loading: bool = False

    def still_loading(self) -> QueryResult:
        """The answer while blocks are brought into the pool instead: no hits, no lease; the caller asks again."""
        return QueryResult(0, 0, self.lease_ttl_ms, self.namespace_final, loading=True)


@dataclass(slots=True)
class EngineCounters:
    save_bytes: int = 0
    save_seconds: float = 0.0
    saves: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0
    loads: int = 0  # refusals are counted per namespace by the store


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    store: StoreStatistics
    counters: EngineCounters
    instances: int
    workers: int
    ssd: TierStatistics | None = None  # None: no SSD tier
