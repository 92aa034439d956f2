"""Control-plane benchmark: what a call costs a real engine when its copies cost nothing (4 KiB pages), next to the
lane's floor measured in the same run, whether a second client process adds throughput, and requests/s on a
replayed workload.

    kvseal bench ops [--quick] [--baseline REV]

latency   one client process (its own instance, one 4 KiB layer), per batch of 1, 64, 1024 and 4096 hashes:
          Save of fresh hashes, Query of the same hashes, Load of them under a query's lease; and the lane's
          floor, PINGs carrying as many bytes as the Query's frame and as the Save's (receive, frame, answer,
          send; the engine reads none of it). Each kind timed in a run of its own, right after another call
          (_latency says why). Median µs per call; frames are encoded before the clock starts.
scaling   1, then 2 client processes at once, each looping Save + Query + Load of `SCALE_BATCH` fresh hashes for
          a few seconds against a fresh engine (the pool fills and evicts): calls/s together, and 2 clients / 1.
replay    kvseal.bench.workload's multi-turn chats over shared system prompts, 16- and 512-token blocks, one
          client driving a fresh engine as vLLM's connector does: Query the prompt's blocks, Load the hit, Save
          the prompt (the hit named: the engine copies the rest). Requests/s, and the engine's CPU per request
          (from /proc).
baseline  --baseline REV: latency, scaling and replay also against the engine of REV, installed into a temporary
          venv (kvseal.bench.baseline says how), in the same run: both engines' latency, then their scaling and
          replays alternating, ROUNDS rounds, each figure's best round per engine (the least disturbed: a shared machine
          only ever slows a run) compared. PING is new: the floor comes from this engine.

Last line: RESULT query_1024_vs_ping=… save_1024_vs_ping=… load_1024_vs_ping=… two_clients_ratio=…
replay16_rps=… replay512_rps=… [loop_vs_baseline=… replay16_vs_baseline=… replay512_vs_baseline=…] (x_vs_ping:
the call's median over the PING of its own frame size; two_clients_ratio at SCALE_BATCH; loop_vs_baseline: 1
client's calls/s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvseal.bench import baseline
from kvseal.bench.harness import START_TIMEOUT_S, CpuWatch, Hashes, MiB, SharedKV, cpu_model, register, start_engine
from kvseal.bench.workload import Workload
from kvseal.client import EngineClient
from kvseal.copy.kernel import COPY_PATH
from kvseal.wire import lane

BATCHES = (1, 64, 1024, 4096)
SCALE_BATCH = 64
PAGE = 4096
NUM_BLOCKS = 4096  # the client's KV blocks (the largest batch)
POOL = 256 * MiB
ROUNDS = 3  # with --baseline: loops and replays of each engine, alternating; each figure's best round counts
LAYER = "model.layers.0.self_attn.attn"


# ------------------------------------------------------------------------------------------ client process


def client_main(spec: dict[str, Any]) -> dict[str, Any]:
    """One client process: registers its instance, says READY, waits for GO on stdin, runs, returns figures."""
    import numpy as np

    kv = SharedKV(1, NUM_BLOCKS, PAGE, np.random.default_rng(0))
    client = EngineClient(spec["target"], timeout=120)
    try:
        w = register(client, spec["instance"], kv, spec.get("block_tokens", 16), [LAYER])
        print("READY", flush=True)
        sys.stdin.readline()
        mode = spec["mode"]
        if mode == "latency":
            return _latency(client, w.key, spec["batches"], spec["reps"], spec["ping"])
        if mode == "loop":
            return _loop(client, w.key, spec["batch"], spec["seconds"])
        return _replay(client, w.key, Workload(**spec["workload"]).requests(spec["block_tokens"]))
    finally:
        client.close()
        kv.close()


def _cycle(client: EngineClient, key: tuple[str, int, int], hashes: list[bytes], ids: list[int]) -> list[float]:
    """Save, Query, Load of fresh hashes: the seconds of each call (frames encoded off the clock)."""
    call = client.lane_call
    save = lane.encode_save(key, hashes, ids)
    query = lane.encode_query(key[0], hashes)
    t0 = time.perf_counter()
    call(save)
    t1 = time.perf_counter()
    hits, lease, *_ = lane.decode_query_ok(call(query))
    t2 = time.perf_counter()
    load = lane.encode_load(key, hashes[:hits], ids[:hits], lease)
    t3 = time.perf_counter()
    call(load)
    t4 = time.perf_counter()
    return [t1 - t0, t2 - t1, t4 - t3]


def _latency(client: EngineClient, key: tuple[str, int, int], batches: list[int], reps: int, ping: bool) -> dict:
    """Per batch, each call timed in a run of its own kind, so that every timed call follows another lane call at
    once (a call after the client slept measured up to 2.5x slower on these machines): `n` Saves of fresh hashes;
    a Query of each saved batch (its lease released, untimed); a Load of each under a fresh lease (the Query that
    gives it untimed); then `n` PINGs of each frame size. Frames are encoded off the clock."""
    hashes = Hashes()
    call = client.lane_call
    out: dict[str, dict[int, float]] = {}
    for b in batches:
        ids = list(range(b))
        n = max(5, min(reps, 40 * reps // b))
        batches_saved = [hashes.take(b) for _ in range(n)]
        frames = {
            "save": [lane.encode_save(key, hs, ids) for hs in batches_saved],
            "query": [lane.encode_query(key[0], hs) for hs in batches_saved],
        }
        samples: dict[str, list[float]] = {name: [] for name in ("save", "query", "load")}
        for frame in frames["save"]:
            samples["save"].append(_timed(call, frame))
        for frame in frames["query"]:
            t0 = time.perf_counter()
            hits, lease, *_ = lane.decode_query_ok(call(frame))
            samples["query"].append(time.perf_counter() - t0)
            call(lane.encode_release(key[0], lease))
        for hs, frame in zip(batches_saved, frames["query"], strict=True):
            hits, lease, *_ = lane.decode_query_ok(call(frame))
            samples["load"].append(_timed(call, lane.encode_load(key, hs[:hits], ids[:hits], lease)))
        if ping:
            for name, frame in (("ping_query", frames["query"][0]), ("ping_save", frames["save"][0])):
                payload = lane.encode_ping(frame[5:])
                samples[name] = [_timed(call, payload) for _ in range(n)]
        for name, s in samples.items():
            out.setdefault(name, {})[b] = statistics.median(s) * 1e6
    return out


def _timed(call: Any, frame: bytes) -> float:
    t0 = time.perf_counter()
    call(frame)
    return time.perf_counter() - t0


def _save(key: tuple[str, int, int], b: int) -> bytes:
    return lane.encode_save(key, [b"\0" * 32] * b, list(range(b)))


def _loop(client: EngineClient, key: tuple[str, int, int], batch: int, seconds: float) -> dict:
    hashes, ids = Hashes(), list(range(batch))
    calls = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        _cycle(client, key, hashes.take(batch), ids)
        calls += 3
    return {"calls": calls, "seconds": time.perf_counter() - start}


def _replay(client: EngineClient, key: tuple[str, int, int], requests: list[list[bytes]]) -> dict:
    call = client.lane_call
    ids = [i % NUM_BLOCKS for i in range(max(map(len, requests)))]
    blocks = hit = 0
    start = time.perf_counter()
    for hashes in requests:
        n = len(hashes)
        hits, lease, *_ = lane.decode_query_ok(call(lane.encode_query(key[0], hashes)))
        if hits:
            call(lane.encode_load(key, hashes[:hits], ids[:hits], lease))
        call(lane.encode_save(key, hashes, ids[:n]))  # the prompt, its hit named (as the connector's first save)
        blocks += n
        hit += hits
    return {"requests": len(requests), "seconds": time.perf_counter() - start, "blocks": blocks, "hits": hit}


# ------------------------------------------------------------------------------------------ the run


class Clients:
    """Client processes (`python -m kvseal.bench.ops --client SPEC`), started together and told GO together."""

    def __init__(self, specs: list[dict[str, Any]]) -> None:
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", "kvseal.bench.ops", "--client", json.dumps(spec)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=dict(os.environ, OMP_NUM_THREADS="1"),
            )
            for spec in specs
        ]

    def run(self) -> list[dict[str, Any]]:
        try:
            for p in self.procs:
                line = p.stdout.readline()  # type: ignore[union-attr]
                if line.strip() != "READY":
                    raise RuntimeError(f"a client did not start: {line!r}")
            for p in self.procs:
                p.stdin.write("GO\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
            results = [json.loads(p.communicate(timeout=1800)[0].strip().splitlines()[-1]) for p in self.procs]
        finally:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
        return results


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_latency(workdir: Path, label: str, python: str, quick: bool, ping: bool, cwd: Path | None) -> dict:
    """Median µs per call of one engine (this one, or a baseline's run by `python` in `cwd`), by kind and batch."""
    engine = start_engine(workdir, f"engine-{label}", POOL, python=python, cwd=cwd)
    try:
        engine.wait_ready(START_TIMEOUT_S)
        reps = 20 if quick else 200
        spec = {"target": engine.target, "mode": "latency", "batches": list(BATCHES), "reps": reps, "ping": ping}
        (latency,) = Clients([dict(spec, instance=f"{label}-lat")]).run()
    finally:
        engine.stop()
    return {op: {int(b): us for b, us in by_batch.items()} for op, by_batch in latency.items()}


def measure_loops(workdir: Path, label: str, python: str, quick: bool, cwd: Path | None) -> dict[str, float]:
    """Calls/s of Save + Query + Load in a loop against a fresh engine, from 1 and from 2 client processes."""
    out: dict[str, float] = {}
    engine = start_engine(workdir, f"engine-{label}", POOL, python=python, cwd=cwd)
    try:
        engine.wait_ready(START_TIMEOUT_S)
        loop = {"target": engine.target, "mode": "loop", "batch": SCALE_BATCH, "seconds": 1.0 if quick else 4.0}
        for n in (1, 2):
            results = Clients([dict(loop, instance=f"{label}-loop{n}-{i}") for i in range(n)]).run()
            out[f"calls_per_s_{n}"] = sum(r["calls"] / r["seconds"] for r in results)
    finally:
        engine.stop()
    return out


def measure_replay(
    workdir: Path, label: str, python: str, cwd: Path | None, block_tokens: int, workload: Workload
) -> dict[str, Any]:
    """One replay of `workload` against a fresh engine (this one, or a baseline's): its figures and the engine's CPU."""
    engine = start_engine(workdir, f"engine-{label}", POOL, python=python, cwd=cwd)
    try:
        engine.wait_ready(START_TIMEOUT_S)
        cpu0 = _cpu_seconds(engine.pid)
        spec = {"target": engine.target, "mode": "replay", "block_tokens": block_tokens, "workload": workload.__dict__}
        (r,) = Clients([dict(spec, instance=label)]).run()
        r["engine_cpu_s"] = _cpu_seconds(engine.pid) - cpu0
        return r
    finally:
        engine.stop()


def _rps(r: dict[str, Any]) -> float:
    return r["requests"] / r["seconds"]


def _score(figure: float | dict[str, Any]) -> float:
    """What makes a round's figure the best: calls/s, or a replay's requests/s."""
    return figure if isinstance(figure, float) else _rps(figure)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvseal bench ops")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and a smaller workload (smoke)")
    parser.add_argument("--baseline", metavar="REV", help="also measure the engine of this git revision, first")
    parser.add_argument("--client", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        print(json.dumps(client_main(json.loads(args.client))), flush=True)
        return 0
    watch = CpuWatch()
    print(f"kvseal bench ops: {cpu_model()}, {os.cpu_count()} CPUs, copy path {COPY_PATH}, 4 KiB pages")
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvseal-bench-ops-") as tmp:
        workdir = Path(tmp)
        engines: dict[str, tuple[str, Path | None]] = {}
        if args.baseline:
            where = workdir / "baseline"
            engines[args.baseline] = (baseline.install(args.baseline, where), where)
        engines["now"] = (sys.executable, None)
        workload = Workload(conversations=60 if args.quick else 300)
        rounds = ROUNDS if args.baseline and not args.quick else 1
        for label, (python, cwd) in engines.items():
            runs[label] = {"latency": measure_latency(workdir, label, python, args.quick, label == "now", cwd)}
        for i in range(rounds):  # the engines alternate, so that a disturbance falls on both
            for label, (python, cwd) in engines.items():
                figures: dict[str, Any] = measure_loops(workdir, f"{label}-{i}", python, args.quick, cwd)
                for bt in (16, 512):
                    figures[f"replay{bt}"] = measure_replay(
                        workdir, f"{label}-replay{bt}-{i}", python, cwd, bt, workload
                    )
                runs[label].setdefault("rounds", []).append(figures)
        for run in runs.values():
            run.update({name: max((f[name] for f in run["rounds"]), key=_score) for name in run["rounds"][0]})
    now = runs["now"]
    report(runs)
    lat = now["latency"]
    result = {
        "query_1024_vs_ping": lat["query"][1024] / lat["ping_query"][1024],
        "save_1024_vs_ping": lat["save"][1024] / lat["ping_save"][1024],
        "load_1024_vs_ping": lat["load"][1024] / lat["ping_save"][1024],
        "two_clients_ratio": now["calls_per_s_2"] / now["calls_per_s_1"],
    }
    for bt in (16, 512):
        r = now[f"replay{bt}"]
        result[f"replay{bt}_rps"] = _rps(r)
    if args.baseline:
        result["loop_vs_baseline"] = now["calls_per_s_1"] / runs[args.baseline]["calls_per_s_1"]
        for bt in (16, 512):
            before = runs[args.baseline][f"replay{bt}"]
            result[f"replay{bt}_vs_baseline"] = result[f"replay{bt}_rps"] / _rps(before)
    print(watch.report())
    if args.quick:
        print("--quick: smoke figures (few repetitions, a small workload), not the targets'")
    print(
        "RESULT "
        + " ".join(f"{k}={v:.3f}" if k.endswith("_ratio") or "_vs_" in k else f"{k}={v:.1f}" for k, v in result.items())
    )
    return 0


def report(runs: dict[str, dict[str, Any]]) -> None:
    now = runs["now"]
    lat = now["latency"]
    print("\nlatency: median µs per call, one client process")
    head = f"{'batch':>6} {'ping(q)':>8} {'ping(s)':>8}"
    for label in runs:
        head += f" | {label[:10]:>10}: {'query':>8} {'save':>8} {'load':>8}"
    print(head + f" | {'now/ping':>9}: {'query':>6} {'save':>6} {'load':>6}")
    for b in BATCHES:
        line = f"{b:>6} {lat['ping_query'][b]:>8.1f} {lat['ping_save'][b]:>8.1f}"
        for r in runs.values():
            x = r["latency"]
            line += f" | {'':>10}  {x['query'][b]:>8.1f} {x['save'][b]:>8.1f} {x['load'][b]:>8.1f}"
        pq, ps = lat["ping_query"][b], lat["ping_save"][b]
        line += f" | {'':>9}  {lat['query'][b] / pq:>6.2f} {lat['save'][b] / ps:>6.2f} {lat['load'][b] / ps:>6.2f}"
        print(line)
    print(f"\nscaling: Save + Query + Load of {SCALE_BATCH} fresh hashes in a loop, calls/s")
    for label, r in runs.items():
        one, two = r["calls_per_s_1"], r["calls_per_s_2"]
        rounds = "; ".join(f"{f['calls_per_s_1']:,.0f}, {f['calls_per_s_2']:,.0f}" for f in r["rounds"])
        print(f"  {label:>12}: 1 client {one:,.0f}   2 clients {two:,.0f}   ratio {two / one:.2f}   (rounds: {rounds})")
    print("\nreplay: multi-turn chats over shared system prompts, one client, a fresh engine each")
    for bt in (16, 512):
        for label, r in runs.items():
            x = r[f"replay{bt}"]
            rounds = ", ".join(f"{_rps(f[f'replay{bt}']):,.0f}" for f in r["rounds"])
            print(
                f"  {bt:>3}-token blocks {label:>12}: {x['requests']} requests, {x['blocks'] / x['requests']:.0f} "
                f"blocks each, hit {x['hits'] / x['blocks']:.3f}: {_rps(x):,.0f} requests/s (rounds: {rounds}), "
                f"engine CPU {x['engine_cpu_s'] / x['requests'] * 1e3:.3f} ms per request"
            )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
