"""Prometheus metrics. Engine state is read from `Engine.statistics()` snapshots at scrape time; RPC latency is
observed as calls finish. Each server has its own registry, so several engines can live in one test process."""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Iterator
from itertools import accumulate
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvseal.engine.engine import Engine
from kvseal.engine.lock import HOLD_BUCKETS, LockStatistics
from kvseal.ssd.tier import TierStatistics

_RPC_BUCKETS = (50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 50e-3, 0.1, 0.5, 1.0, 5.0)


class _EngineCollector(Collector):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        s = self.engine.statistics()
        st, c = s.store, s.counters
        yield GaugeMetricFamily("kvseal_resident_blocks", "Sealed blocks held in the pool", value=st.resident_blocks)
        yield GaugeMetricFamily("kvseal_resident_bytes", "Pool bytes held by sealed blocks", value=st.sealed_bytes)
        yield GaugeMetricFamily("kvseal_pool_bytes", "Pool arena size", value=st.arena_bytes)
        yield GaugeMetricFamily("kvseal_pool_free_bytes", "Pool bytes holding no page", value=st.free_bytes)
        used = GaugeMetricFamily("kvseal_pool_used_bytes", "Pool bytes holding pages, by state", labels=["state"])
        used.add_metric(["inflight"], st.inflight_bytes)
        used.add_metric(["sealed"], st.sealed_bytes)
        used.add_metric(["pinned"], st.pinned_bytes)
        yield used
        yield GaugeMetricFamily("kvseal_leases", "Open leases", value=st.leases)
        yield GaugeMetricFamily("kvseal_instances", "Registered instances", value=s.instances)
        yield GaugeMetricFamily("kvseal_workers", "Registered workers", value=s.workers)
        yield CounterMetricFamily("kvseal_evictions", "Pages evicted from the pool", value=st.evictions)
        yield CounterMetricFamily(
            "kvseal_inflight_reclaimed", "Incomplete pages reclaimed after the timeout", value=st.inflight_reclaimed
        )
        labels = ["namespace", "uid"]  # one final namespace of two users is two namespaces (they share nothing)
        hits = CounterMetricFamily("kvseal_hits", "Blocks found by queries", labels=labels)
        misses = CounterMetricFamily("kvseal_misses", "Blocks queried and not found", labels=labels)
        refusals = CounterMetricFamily("kvseal_refusals", "Loads refused, by reason", labels=[*labels, "reason"])
        what_if = GaugeMetricFamily(
            "kvseal_what_if_hit_ratio",
            "Hit ratio of the namespace's queries in memory since start: as it is (pool=1x) and, estimated, with 2x "
            "and 4x the blocks it holds and with no eviction (pool=unbounded)",
            labels=[*labels, "pool"],
        )
        distinct = GaugeMetricFamily(
            "kvseal_distinct_blocks",
            "Distinct blocks the namespace's queries missed since start, estimated",
            labels=labels,
        )
        for ns in self.engine.namespaces():
            key = [ns["namespace"], str(ns["uid"])]
            hits.add_metric(key, ns["hits"])
            misses.add_metric(key, ns["misses"])
            for reason, n in ns["refused"].items():
                refusals.add_metric([*key, reason], n)
            w = ns["what_if"]
            for pool, field in (("1x", ""), ("2x", "_2x"), ("4x", "_4x"), ("unbounded", "_unbounded")):
                what_if.add_metric([*key, pool], w["hit_ratio" + field])
            distinct.add_metric(key, w["distinct_blocks"])
        yield hits
        yield misses
        yield refusals
        yield what_if
        yield distinct
        yield CounterMetricFamily("kvseal_save_bytes", "Bytes copied into the pool by saves", value=c.save_bytes)
        yield CounterMetricFamily("kvseal_save_seconds", "Seconds spent copying saves", value=c.save_seconds)
        yield CounterMetricFamily("kvseal_load_bytes", "Bytes copied out of the pool by loads", value=c.load_bytes)
        yield CounterMetricFamily("kvseal_load_seconds", "Seconds spent copying loads", value=c.load_seconds)
        if s.ssd is not None:
            yield from _ssd_metrics(s.ssd)
        yield from _lock_metrics(self.engine.lock_statistics())


def _lock_metrics(t: LockStatistics) -> Iterator[Metric]:
    """The engine lock's holds, from the lock's own counts (TimedLock: nothing is observed twice)."""
    buckets, cumulative = [], 0
    for bound, count in zip((*map(floatToGoString, HOLD_BUCKETS), "+Inf"), t.bucket_counts, strict=True):
        cumulative += count
        buckets.append((bound, cumulative))
    yield HistogramMetricFamily(
        "kvseal_engine_lock_hold_seconds",
        "How long each hold of the engine lock lasted (every query, save and load waits while it is held)",
        buckets=buckets,
        sum_value=t.total_seconds,
    )
    yield GaugeMetricFamily(
        "kvseal_engine_lock_max_hold_seconds", "Longest hold of the engine lock since start", value=t.max_seconds
    )
    yield InfoMetricFamily(
        "kvseal_engine_lock_max_hold", "Where the longest hold of the engine lock was", value={"where": t.max_where}
    )


def _ssd_metrics(t: TierStatistics) -> Iterator[Metric]:
    yield GaugeMetricFamily("kvseal_ssd_records", "Blocks held on SSD", value=t.records)
    yield GaugeMetricFamily("kvseal_ssd_bytes", "Page bytes held on SSD", value=t.bytes)
    yield GaugeMetricFamily("kvseal_ssd_segments", "SSD segment files", value=t.segments)
    yield CounterMetricFamily("kvseal_ssd_writes", "Device writes (batches of records)", value=t.writes)
    yield CounterMetricFamily("kvseal_ssd_write_bytes", "Bytes written to SSD", value=t.write_bytes)
    yield CounterMetricFamily("kvseal_ssd_write_seconds", "Seconds in SSD writes", value=t.write_seconds)
    yield CounterMetricFamily("kvseal_ssd_reads", "Device reads (runs of records)", value=t.reads)
    yield CounterMetricFamily("kvseal_ssd_read_bytes", "Bytes read from SSD", value=t.read_bytes)
    yield CounterMetricFamily("kvseal_ssd_read_seconds", "Seconds in SSD reads", value=t.read_seconds)
    yield CounterMetricFamily(
        "kvseal_ssd_skipped", "Sealed blocks not written to SSD (queues full, no device left)", value=t.skipped
    )
    yield CounterMetricFamily(
        "kvseal_ssd_reinserted",
        "Blocks read from SSD in the older part of the log, written again so that they outlive their segment",
        value=t.reinserted,
    )
    failures = CounterMetricFamily(
        "kvseal_ssd_verify_failures", "Records that failed their checks on read, by reason", labels=["reason"]
    )
    for reason in ("checksum", "digest", "truncated", "mismatch"):
        failures.add_metric([reason], t.verify_failures.get(reason, 0))
    yield failures
    capacity = GaugeMetricFamily(
        "kvseal_ssd_capacity_bytes",
        "Bytes a path's log may take: --ssd-capacity in whole segments, or less where a restart found its disk full",
        labels=["path"],
    )
    for path, size in zip(t.devices, t.capacities, strict=True):
        capacity.add_metric([path], size)
    yield capacity
    failed = GaugeMetricFamily("kvseal_ssd_path_failed", "1 when a path stopped taking writes", labels=["path"])
    for path in t.devices:
        failed.add_metric([path], int(path in t.failed_devices))
    yield failed


class _PeersCollector(Collector):
    """The MetaServer announcer (kvseal.meta.announcer), the peer server and the peer fetcher (kvseal.peer)."""

    def __init__(self, announcer: Any, server: Any, fetcher: Any) -> None:
        self.announcer, self.server, self.fetcher = announcer, server, fetcher

    def collect(self) -> Iterator[Metric]:
        a, served, fetched = self.announcer, self.server.counters, self.fetcher.counters
        yield GaugeMetricFamily(
            "kvseal_meta_announce_backlog", "Block changes not yet sent to the MetaServer", value=a.pending
        )
        yield CounterMetricFamily("kvseal_meta_announced", "Blocks announced to the MetaServer", value=a.announced)
        yield CounterMetricFamily("kvseal_meta_withdrawn", "Blocks withdrawn at the MetaServer", value=a.withdrawn)
        yield CounterMetricFamily("kvseal_peer_lookups", "Misses asked of the MetaServer", value=fetched.lookups)
        yield CounterMetricFamily("kvseal_peer_hits", "Blocks fetched from peers and sealed here", value=fetched.blocks)
        yield CounterMetricFamily("kvseal_peer_fetch_bytes", "Bytes fetched from peers", value=fetched.bytes)
        yield CounterMetricFamily("kvseal_peer_fetch_seconds", "Seconds spent fetching", value=fetched.seconds)
        yield CounterMetricFamily("kvseal_peer_served_blocks", "Blocks sent to peers", value=served.blocks)
        yield CounterMetricFamily("kvseal_peer_served_bytes", "Bytes sent to peers", value=served.bytes)
        yield CounterMetricFamily("kvseal_peer_served_seconds", "Seconds spent serving peers", value=served.seconds)
        yield GaugeMetricFamily("kvseal_peer_connections", "Peer connections open now", value=served.connections)
        refusals = CounterMetricFamily(
            "kvseal_peer_refusals",
            "Peer fetches refused, by side (fetch: refused to us or by us; serve: refused by us) and reason",
            labels=["side", "reason"],
        )
        for side, counts in (("fetch", fetched.refusals), ("serve", served.refusals)):
            for reason, n in sorted(counts.items()):
                refusals.add_metric([side, reason], n)
        yield refusals
        failures = CounterMetricFamily("kvseal_peer_fetch_failures", "Fetches that failed, by why", labels=["reason"])
        for reason, n in sorted(fetched.failures.items()):
            failures.add_metric([reason], n)
        yield failures


class _Latencies(Collector):
    """A latency histogram labelled by method and code, observed on every RPC and lane call: a bisect and two list
    updates under one lock (prometheus_client's labelled Histogram looks the child up and takes a lock per value:
    ~6 µs a call, paid by every vLLM scheduler step), exported as a histogram at scrape time."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self._name, self._documentation, self._bounds = name, documentation, buckets
        self._series: dict[tuple[str, str], list[float]] = {}  # per bucket its count, then +Inf's, then the sum
        self._lock = threading.Lock()

    def observe(self, method: str, code: str, seconds: float) -> None:
        i = bisect_left(self._bounds, seconds)  # the first bound >= seconds: the bucket `le` that bound
        with self._lock:
            series = self._series.get((method, code))
            if series is None:
                series = self._series[(method, code)] = [0] * (len(self._bounds) + 2)
            series[i] += 1
            series[-1] += seconds

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=["method", "code"])
        with self._lock:
            snapshot = {labels: list(series) for labels, series in self._series.items()}
        bounds = [*map(floatToGoString, self._bounds), "+Inf"]
        for labels, series in sorted(snapshot.items()):
            buckets = list(zip(bounds, accumulate(series[:-1]), strict=True))
            family.add_metric(list(labels), buckets=buckets, sum_value=series[-1])
        yield family


class Metrics:
    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self._rpc = _Latencies("kvseal_rpc_seconds", "gRPC and lane handler latency", _RPC_BUCKETS)
        self._meta_rpc = _Latencies(
            "kvseal_metaserver_rpc_seconds", "Latency of this engine's calls to the MetaServer", _RPC_BUCKETS
        )
        self.registry.register(self._rpc)
        self.registry.register(self._meta_rpc)

    def watch_peers(self, announcer: Any, server: Any, fetcher: Any) -> None:
        """Exports what this node tells the MetaServer and exchanges with other nodes."""
        self.registry.register(_PeersCollector(announcer, server, fetcher))

    def observe_meta_rpc(self, method: str, code: str, seconds: float) -> None:
        self._meta_rpc.observe(method, code, seconds)

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self._rpc.observe(method, code, seconds)
