"""Hit ratios of the eviction policies (kvseal.core.policies) on replayed workloads: offline by the simulator
(kvseal.bench.hitsim), next to Belady's optimum with and without admission, and the engine's own policies replayed
against a real engine, checked against their simulation request by request.

    kvseal bench hitrate [--quick]

Workloads: kvseal.bench.workload's multi-turn chats (`Workload()`) and its mix of chats, agent loops, RAG and
one-off prompts (`MixedWorkload()`), each at 16- and 512-token blocks, and its chat service's hour calibrated to a
production trace (`ChatTrace()`, 512-token blocks). Capacities: 1, 2, 5, 10, 20 and 50 % of the
workload's distinct blocks. For each, the hit ratio (blocks found / blocks asked) of every policy of POLICIES, of
Belady (`belady`) and of Belady with admission (`belady+adm`); then each policy over LRU, over prefix-LRU (the
floor) and over Belady; for the mixed workloads, the hit ratio of each kind of request at 5 %. Then a real
`kvseal serve --eviction NAME` per engine policy (kvseal.core.eviction), a pool of exactly 5 % and 15 % of the mixed
512-token workload's distinct blocks in 4 KiB pages, replays it over the lane as vLLM's connector would (Query,
Load the hit, Save the prompt: the hit named, the rest copied): its hit ratio, its simulation's, the requests
whose hit differs, requests/s.

Last line: RESULT default_vs_prefixlru_min=… default_vs_prefixlru_max=… (the engine's default policy, the first of
kvseal.core.eviction.EVICTION_POLICIES, over prefix-LRU: the least and the most over every workload and capacity)
default_vs_prefixlru_5pct=… (the least over the workloads at 5 %) best_vs_prefixlru_5pct=… (the best policy other
than lru and prefix-lru, on the mixed 16-token workload at 5 %) belady_vs_prefixlru_5pct=… (Belady without admission
there: what any policy could win) prefixlru_vs_lru_1pct=… (the least over the workloads at 1 %) ssd_vs_lru_min=…
(the SSD tier's order, ssd-log, over LRU at the same size: the least over every workload and capacity)
engine_matches_sim=… (the least share of requests whose engine hit equals the simulation's: 1 when the engine is its
policy) engine_replay_rps=… (the default policy at 5 %). `--quick` replays smaller workloads (smoke figures).
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from kvseal.bench.harness import START_TIMEOUT_S, SharedKV, register, start_engine
from kvseal.bench.hitsim import SimResult, belady, simulate
from kvseal.bench.ops import LAYER, PAGE
from kvseal.bench.workload import ChatTrace, MixedWorkload, Workload
from kvseal.client import EngineClient
from kvseal.core.eviction import EVICTION_POLICIES
from kvseal.core.policies import POLICIES

PERCENTS = (1, 2, 5, 10, 20, 50)
ENGINE_SHARES = (0.05, 0.15)  # of the distinct blocks, for the real engine's replay (at least 2 prompts' worth)
BLOCK_TOKENS = (16, 512)
FLOORS = ("lru", "prefix-lru")  # recency only: the policies the others are measured against
MODELS = ("ssd-log",)  # the SSD tier's order, measured against LRU at its own size, not a candidate
BELADY = ("belady", "belady+adm")


def ratio(a: float, b: float) -> float:
    """a / b; 1.0 when both are 0, inf when only b is."""
    if b:
        return a / b
    return 1.0 if not a else math.inf


def run_case(requests: Sequence[Sequence[bytes]], capacity: int) -> dict[str, SimResult]:
    """Every policy's, Belady's and Belady-with-admission's result on `requests` with room for `capacity` blocks."""
    out = {name: simulate(requests, capacity, make(capacity)) for name, make in POLICIES.items()}
    out["belady"] = belady(requests, capacity, admission=False)
    out["belady+adm"] = belady(requests, capacity, admission=True)
    return out


def best_other(results: dict[str, SimResult]) -> tuple[str, float]:
    """The policy (not a floor, not Belady) with the highest hit ratio, and that ratio over prefix-LRU's."""
    name = max((n for n in POLICIES if n not in FLOORS + MODELS), key=lambda n: results[n].ratio)
    return name, ratio(results[name].ratio, results["prefix-lru"].ratio)


def report(label: str, kinds: list[str] | None, requests: list[list[bytes]]) -> dict[int, dict[str, SimResult]]:
    """Runs every capacity of one workload and prints its tables; returns the results by capacity percent."""
    distinct = len({key for request in requests for key in request})
    asked = sum(map(len, requests))
    print(f"\n{label}: {len(requests)} requests, {asked} blocks asked, {distinct} distinct")
    names = [*POLICIES, *BELADY]
    print(f"{'cap %':>5} {'blocks':>7} " + " ".join(f"{n:>11}" for n in names))
    by_pct: dict[int, dict[str, SimResult]] = {}
    for pct in PERCENTS:
        capacity = max(1, round(distinct * pct / 100))
        results = by_pct[pct] = run_case(requests, capacity)
        print(f"{pct:>5} {capacity:>7} " + " ".join(f"{results[n].ratio:>11.4f}" for n in names))
    print("over LRU / over prefix-LRU / over Belady:")
    print(f"{'cap %':>5} " + " ".join(f"{n:>20}" for n in POLICIES))
    for pct, results in by_pct.items():
        cells = []
        for n in POLICIES:
            r = results[n].ratio
            lru, plru, bel = (results[x].ratio for x in ("lru", "prefix-lru", "belady"))
            cells.append(f"{ratio(r, lru):.3f}/{ratio(r, plru):.3f}/{ratio(r, bel):.3f}")
        print(f"{pct:>5} " + " ".join(f"{c:>20}" for c in cells))
    if kinds is not None:
        print("hit ratio by kind of request at 5 %:")
        print(f"{'kind':>8} {'asked':>8} " + " ".join(f"{n:>11}" for n in names))
        for kind in MixedWorkload.KINDS:
            mine = [i for i, k in enumerate(kinds) if k == kind]
            n_asked = sum(len(requests[i]) for i in mine)
            found = {n: sum(by_pct[5][n].per_request[i] for i in mine) for n in names}
            print(f"{kind:>8} {n_asked:>8} " + " ".join(f"{ratio(found[n], n_asked):>11.4f}" for n in names))
    return by_pct


def engine_replay(
    workdir: Path, requests: Sequence[Sequence[bytes]], capacity: int, eviction: str
) -> tuple[list[int], float]:
    """Replays `requests` against a real engine (`kvseal serve --eviction EVICTION`, a pool of exactly `capacity`
    4 KiB pages) as vLLM's connector drives it over the lane: Query the prompt, Load the hit under the query's
    lease, Save the prompt (the hit prefix named, as the connector's first save of a request names it; the engine
    copies only the rest). Returns each request's hit and the seconds the replay took."""
    import numpy as np

    from kvseal.wire import lane

    pool = capacity * PAGE
    extra = ["--slab-size", str(pool), "--eviction", eviction]
    engine = start_engine(workdir, f"engine-{eviction}-{capacity}", pool, extra=extra)
    try:
        engine.wait_ready(START_TIMEOUT_S)
        longest = max(map(len, requests))
        kv = SharedKV(1, longest, PAGE, np.random.default_rng(0))
        client = EngineClient(engine.target, timeout=120)
        try:
            key = register(client, "replay", kv, 512, [LAYER]).key
            call, ids = client.lane_call, list(range(longest))
            hits: list[int] = []
            start = time.perf_counter()
            for hashes in requests:
                hit, lease, *_ = lane.decode_query_ok(call(lane.encode_query(key[0], hashes)))
                if hit:
                    call(lane.encode_load(key, hashes[:hit], ids[:hit], lease))
                if hashes:  # the whole prompt: the engine copies the blocks it lacks and refreshes the others
                    call(lane.encode_save(key, hashes, ids[: len(hashes)]))
                hits.append(hit)
            return hits, time.perf_counter() - start
        finally:
            client.close()
            kv.close()
    finally:
        engine.stop()


def engine_check(requests: Sequence[Sequence[bytes]], shares: Sequence[float]) -> tuple[float, float]:
    """The engine replay of each policy at each share of the distinct blocks, next to its simulation: prints the
    hit ratios, the requests whose hit differs and requests/s; returns (the least share of requests whose hit
    equals the simulation's, requests/s of the default policy at the first share)."""
    distinct = len({key for request in requests for key in request})
    asked = sum(map(len, requests))
    print("\nreal engine (kvseal serve --eviction NAME, 4 KiB pages) replaying the mixed 512-token workload:")
    print(f"{'policy':>12} {'cap %':>5} {'blocks':>7} {'engine':>8} {'simulated':>10} {'differ':>7} {'requests/s':>11}")
    matches, rps = 1.0, 0.0
    with tempfile.TemporaryDirectory(prefix="kvseal-bench-hitrate-") as tmp:
        for share in shares:
            capacity = round(distinct * share)
            for eviction in EVICTION_POLICIES:
                got, seconds = engine_replay(Path(tmp), requests, capacity, eviction)
                expected = simulate(requests, capacity, POLICIES[eviction](capacity)).per_request
                differ = sum(a != b for a, b in zip(got, expected, strict=True))
                matches = min(matches, 1 - differ / len(requests))
                if eviction == EVICTION_POLICIES[0] and share == shares[0]:
                    rps = len(requests) / seconds
                print(
                    f"{eviction:>12} {share * 100:>5.0f} {capacity:>7} {sum(got) / asked:>8.4f} "
                    f"{sum(expected) / asked:>10.4f} {differ:>7} {len(requests) / seconds:>11,.0f}"
                )
    return matches, rps


def main(quick: bool = False) -> int:
    start = time.perf_counter()
    print(f"kvseal bench hitrate ({'quick' if quick else 'full'}): policies {', '.join(POLICIES)}; Belady")
    chat = Workload(conversations=50) if quick else Workload()
    mixed = (
        MixedWorkload(chat=Workload(seed=1, conversations=50), agents=10, rag=150, documents=40, one_offs=60)
        if quick
        else MixedWorkload()
    )
    runs: dict[str, dict[int, dict[str, SimResult]]] = {}
    for bt in BLOCK_TOKENS:
        runs[f"chat{bt}"] = report(f"chat, {bt}-token blocks", None, chat.requests(bt))
        labelled = mixed.labelled(bt)
        kinds = [kind for kind, _ in labelled]
        runs[f"mixed{bt}"] = report(f"mixed, {bt}-token blocks", kinds, [hashes for _, hashes in labelled])
    trace = ChatTrace(sessions=800) if quick else ChatTrace()
    runs["trace512"] = report(
        "chat trace (calibrated to a production chat service), 512-token blocks", None, trace.requests(512)
    )
    mixed512 = mixed.requests(512)
    engine_matches, engine_rps = engine_check(mixed512, ENGINE_SHARES)
    at5 = runs["mixed16"][5]
    best, best_vs_floor = best_other(at5)
    print(f"\nbest policy over prefix-LRU at 5 % on mixed 16-token blocks: {best}")
    default = EVICTION_POLICIES[0]
    over_floor = {
        (label, pct): ratio(r[default].ratio, r["prefix-lru"].ratio)
        for label, by_pct in runs.items()
        for pct, r in by_pct.items()
    }
    result = {
        "default_vs_prefixlru_min": min(over_floor.values()),
        "default_vs_prefixlru_max": max(over_floor.values()),
        "default_vs_prefixlru_5pct": min(v for (_, pct), v in over_floor.items() if pct == 5),
        "best_vs_prefixlru_5pct": best_vs_floor,
        "belady_vs_prefixlru_5pct": ratio(at5["belady"].ratio, at5["prefix-lru"].ratio),
        "prefixlru_vs_lru_1pct": min(ratio(r[1]["prefix-lru"].ratio, r[1]["lru"].ratio) for r in runs.values()),
        "ssd_vs_lru_min": min(ratio(r["ssd-log"].ratio, r["lru"].ratio) for by in runs.values() for r in by.values()),
        "engine_matches_sim": engine_matches,
        "engine_replay_rps": engine_rps,
    }
    print(f"{time.perf_counter() - start:.1f} s")
    if quick:
        print("quick: smoke figures on small sizes, not the targets' measurement")
    print("RESULT " + " ".join(f"{k}={v:.4f}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
