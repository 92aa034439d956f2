"""The engine's own latency histogram (kvseal.server.metrics._Latencies, cheaper per call than prometheus_client's
labelled Histogram) against prometheus_client's Histogram: the same observations give the same exposition, every
bucket, count and sum, for any values and labels (values on a bucket's bound included: `le` is inclusive)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from kvseal.server.metrics import _RPC_BUCKETS, _Latencies

values = st.one_of(st.sampled_from(_RPC_BUCKETS), st.floats(0, 10, allow_nan=False))
calls = st.lists(
    st.tuples(st.sampled_from(["lane.Query", "Save", "lane.Ping"]), st.sampled_from(["OK", "NOT_FOUND"]), values)
)


@given(calls)
def test_latencies_expose_what_prometheus_client_would(observed: list[tuple[str, str, float]]) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    latencies = _Latencies("kvseal_rpc_seconds", "latency", _RPC_BUCKETS)
    ours.register(latencies)
    reference = Histogram("kvseal_rpc_seconds", "latency", ["method", "code"], buckets=_RPC_BUCKETS, registry=theirs)
    for method, code, seconds in observed:
        latencies.observe(method, code, seconds)
        reference.labels(method, code).observe(seconds)

    def lines(registry: CollectorRegistry) -> list[str]:
        text = generate_latest(registry).decode()
        return sorted(line for line in text.splitlines() if "_created" not in line)

    assert lines(ours) == lines(theirs)
