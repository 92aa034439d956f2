"""`kvseal bench peer`: peer fetch between two engines on loopback, against a memcpy of the same bytes and against
Mooncake Transfer Engine's own TCP read of the same bytes, in the same run; and QueryPrefix latency at 1 M
announced blocks.

Processes: a `kvseal metaserver` (memory store), engine A (`kvseal serve --metaserver`) holding the blocks, engine
C fetching them. Cases (each page size: 2 MiB and 128 KiB, 256 MiB of pages):
  engine  C's query answers `loading`, C pulls the prefix from A (MetaServer lookup, handshake, fetch, checksums,
          seal), the poll that answers the whole prefix ends the timing; C's copy is purged between repetitions
  wire    the same bytes through kvseal.peer's fetcher alone (this process into a pre-faulted buffer): the
          transport without the engine around it
  memcpy  np.copyto of the same bytes between two pre-faulted buffers (1 thread)
  mooncake  Mooncake Transfer Engine's batch read of the same bytes between two processes over its TCP transport
  tcp     the bare loopback TCP ceiling: one process sendall()s the bytes, this one recv_into()s them
QueryPrefix: 1 M blocks announced by 8 nodes, then queries of 128 hashes (a 2 k-token prompt of 16-token blocks)
from one gRPC client; p50 and p99 of the call as the client sees it, and the p50 of the same call finding nothing
(the floor: a unary gRPC call between two Python processes).

Last line:
    RESULT peer_gbps=... memcpy_gbps=... mooncake_tcp_gbps=... peer_vs_memcpy=... peer_vs_mooncake=...
           metaquery_p50_us=... metaquery_floor_us=... peer_vs_tcp=...
(peer figures: 2 MiB pages, engine case, best of the repetitions. Targets: >= 0.5 x memcpy, >= 2 x Mooncake TCP,
QueryPrefix p50 <= 300 us.)
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from kvseal.bench.harness import START_TIMEOUT_S, Hashes, Memcpy, SharedKV, layer_names, register, start_engine
from kvseal.client import EngineClient
from kvseal.peer.mooncake import missing as mooncake_missing
from kvseal.proto import kvseal_pb2 as pb
from kvseal.proto import kvseal_pb2_grpc as pb_grpc
from kvseal.testing.process import EngineProcess, free_port, stop_process

MiB = 1 << 20


@dataclass(frozen=True)
class Plan:
    name: str
    bytes_per_case: int
    reps: int
    announced: int
    queries: int


FULL = Plan("full", 256 * MiB, 5, 1_000_000, 2000)
QUICK = Plan("quick: smoke figures on small sizes, not the targets' measurement", 32 * MiB, 2, 20_000, 200)


class MetaProcess:
    def __init__(self, workdir: Path) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.log_path = workdir / "metaserver.log"
        argv = [sys.executable, "-m", "kvseal", "metaserver", "--listen", f"127.0.0.1:{self.port}"]
        argv += ["--http-listen", f"127.0.0.1:{self.http_port}", "--stale-after", "600"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.MetaServerStub(self.channel)
        grpc.channel_ready_future(self.channel).result(timeout=60)

    def stop(self) -> None:
        self.channel.close()
        stop_process(self.proc)


def _engine(workdir: Path, name: str, meta: MetaProcess, pool: int) -> tuple[EngineProcess, EngineClient]:
    extra = ("--metaserver", f"127.0.0.1:{meta.port}", "--node-id", name, "--slab-size", "64MiB")
    engine = start_engine(workdir, name, pool, extra)
    engine.wait_ready(START_TIMEOUT_S)
    return engine, EngineClient(engine.target, timeout=120)


def _http(engine: EngineProcess, path: str, method: str = "GET") -> Any:
    request = urllib.request.Request(f"http://127.0.0.1:{engine.http_port}{path}", method=method)
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())


def _fetch_case(plan: Plan, workdir: Path, meta: MetaProcess, page_bytes: int) -> dict[str, float]:
    """GB/s of C pulling A's pages through the engines, and through the fetcher alone (best of the reps)."""
    from kvseal.peer.client import PeerFetcher
    from kvseal.peer.tcp import TcpDataPlane

    layers = 32 if page_bytes >= 2 * MiB else 4
    n = plan.bytes_per_case // page_bytes
    pool = plan.bytes_per_case + 256 * MiB
    tag = f"{page_bytes >> 10}k"
    a, on_a = _engine(workdir, f"a{tag}", meta, pool)
    c, on_c = _engine(workdir, f"c{tag}", meta, pool)
    kv_a = SharedKV(layers, n, page_bytes // layers, np.random.default_rng(1))
    kv_c = SharedKV(layers, n, page_bytes // layers, np.random.default_rng(2))
    fetcher = None
    try:
        worker_a = register(on_a, "w", kv_a, 16, layer_names(layers))
        worker_c = register(on_c, "w", kv_c, 16, layer_names(layers))
        assert worker_a.namespace_final == worker_c.namespace_final
        hashes = Hashes().take(n)
        on_a.save(worker_a.key, hashes, list(range(n)))
        deadline = time.monotonic() + 120
        while not _announced(meta, worker_a.namespace_final, hashes, n):
            if time.monotonic() > deadline:
                raise RuntimeError("engine A's blocks were not announced in 120 s")
            time.sleep(0.01)  # poll interval of a bounded wait on the MetaServer's answer
        engine_s = []
        for _ in range(plan.reps):
            _http(c, f"/v1/namespaces/{worker_c.namespace_final}", "DELETE")
            t0 = time.perf_counter()
            while True:
                r = on_c.query("w", hashes, request_id="bench")
                if not r.loading:
                    break
                time.sleep(0.002)  # a scheduler asks again at its next step; polling faster only takes C's GIL
            engine_s.append(time.perf_counter() - t0)
            if r.hits != n:
                raise RuntimeError(f"C got {r.hits} of {n} blocks from A: see {c.log_path}")
            on_c.release("w", r.lease_id)
        address = next(x.address for x in meta.stub.ListNodes(pb.ListNodesRequest()).nodes if x.node_id == f"a{tag}")
        fetcher = PeerFetcher(f"127.0.0.1:{meta.port}", "bench", TcpDataPlane(), timeout_s=60)
        into = np.zeros(n * page_bytes, dtype=np.uint8)
        destinations = [memoryview(into[i * page_bytes : (i + 1) * page_bytes]) for i in range(n)]
        layout = _LayoutOnTheWire(bytes.fromhex(_http(a, "/v1/namespaces")[0]["digest"]), page_bytes)
        wire_s = []
        for _ in range(plan.reps):
            t0 = time.perf_counter()
            got, _ = fetcher.fetch(address, worker_a.namespace_final, layout, hashes, [0] * n, destinations)  # type: ignore[arg-type]
            wire_s.append(time.perf_counter() - t0)
            if got != n:
                raise RuntimeError(f"the fetcher got {got} of {n} pages")
    finally:
        if fetcher is not None:
            fetcher.close()
        for client in (on_a, on_c):
            client.close()
        for engine in (a, c):
            engine.stop()
        kv_a.close()
        kv_c.close()
    nbytes = n * page_bytes
    return {"engine_gbps": nbytes / min(engine_s) / 1e9, "wire_gbps": nbytes / min(wire_s) / 1e9}


@dataclass(frozen=True)
class _LayoutOnTheWire:
    """The two fields of a layout a fetch sends (the fetcher's other callers pass the engine's Layout)."""

    digest: bytes
    page_bytes: int


def _announced(meta: MetaProcess, namespace_final: str, hashes: list[bytes], n: int) -> bool:
    r = meta.stub.QueryPrefix(pb.QueryPrefixRequest(namespace_final=namespace_final, block_hashes=hashes), timeout=30)
    return any(node.prefix == n for node in r.nodes)


def _metaquery_case(plan: Plan, meta: MetaProcess) -> tuple[float, float, float]:
    """(p50, p99) microseconds of QueryPrefix of 128 hashes with plan.announced blocks announced by 8 nodes, and
    the p50 of a QueryPrefix that finds nothing (the floor: the gRPC call itself)."""
    nodes, per_prompt = 8, 128
    rng = np.random.default_rng(3)
    prompts = plan.announced // per_prompt
    hashes = Hashes()
    prompt_hashes = [hashes.take(per_prompt) for _ in range(prompts)]
    ns = "bench-meta.00000000"
    for k in range(nodes):
        meta.stub.Heartbeat(pb.HeartbeatRequest(node_id=f"n{k}", session="s", address=f"127.0.0.1:{7000 + k}"))
    batch: list[bytes] = []
    for i, ph in enumerate(prompt_hashes):  # each prompt on one node: 1 M blocks in all
        batch += ph
        if len(batch) >= 8192 or i == prompts - 1:
            node = f"n{i % nodes}"
            blocks = [pb.NamespaceBlocks(namespace_final=ns, block_hashes=batch)]
            meta.stub.Announce(pb.BlocksRequest(node_id=node, session="s", blocks=blocks), timeout=60)
            batch = []
    requests = [
        pb.QueryPrefixRequest(namespace_final=ns, block_hashes=prompt_hashes[int(rng.integers(prompts))])
        for _ in range(plan.queries)
    ]
    for r in requests[:50]:  # warm the channel
        meta.stub.QueryPrefix(r, timeout=10)
    micros = []
    for r in requests:
        t0 = time.perf_counter()
        answer = meta.stub.QueryPrefix(r, timeout=10)
        micros.append((time.perf_counter() - t0) * 1e6)
        assert answer.nodes and answer.nodes[0].prefix == per_prompt
    micros.sort()
    empty = pb.QueryPrefixRequest(namespace_final="nobody.00000000", block_hashes=[bytes(32)])
    floor = []
    for _ in range(plan.queries):  # the same call with nothing to look up: gRPC's round trip in Python
        t0 = time.perf_counter()
        meta.stub.QueryPrefix(empty, timeout=10)
        floor.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(micros), micros[int(len(micros) * 0.99) - 1], statistics.median(floor)


_SENDER = """
import socket, sys
import numpy as np
n, reps, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
data = np.ones(n, dtype=np.uint8)
with socket.create_connection(("127.0.0.1", port)) as s:
    for _ in range(reps):
        s.recv(1)
        s.sendall(memoryview(data))
"""


def _loopback_tcp_gbps(nbytes: int, reps: int) -> float:
    """The ceiling of any TCP transport here: one process sendall()s `nbytes` to this one, which recv_into()s a
    pre-faulted buffer, over one loopback connection; best of `reps`."""
    into = np.ones(nbytes, dtype=np.uint8)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        sender = subprocess.Popen([sys.executable, "-c", _SENDER, str(nbytes), str(reps), str(port)])
        listener.settimeout(60)
        conn, _ = listener.accept()
    best = float("inf")
    with conn:
        view = memoryview(into)
        for _ in range(reps):
            conn.sendall(b"x")
            t0 = time.perf_counter()
            got = 0
            while got < nbytes:
                k = conn.recv_into(view[got:])
                if k == 0:
                    raise RuntimeError("the loopback sender closed early")
                got += k
            best = min(best, time.perf_counter() - t0)
    sender.wait(timeout=60)
    return nbytes / best / 1e9


def _mooncake(nbytes: int, page_bytes: int) -> float | None:
    from kvseal.bench.mooncake import mooncake_tcp_read_gbps

    try:
        return mooncake_tcp_read_gbps(nbytes, page_bytes)
    except Exception as e:  # it failed in this run: report, do not fail the rest
        print(f"  mooncake: not measured: {type(e).__name__}: {e}")
        return None


def main(quick: bool = False) -> int:
    plan = QUICK if quick else FULL
    print(f"kvseal peer benchmark ({plan.name}), {plan.bytes_per_case >> 20} MiB per case, {plan.reps} repetitions")
    figures: dict[int, dict[str, float | None]] = {}
    missing = mooncake_missing()
    if missing:
        print(f"  Mooncake TCP: not measured ({missing})")
    with tempfile.TemporaryDirectory(prefix="kvseal-bench-peer-") as tmp:
        meta = MetaProcess(Path(tmp))
        try:
            memcpy = Memcpy(plan.bytes_per_case)
            for page_bytes in (2 * MiB, 128 << 10):
                f: dict[str, float | None] = dict(_fetch_case(plan, Path(tmp), meta, page_bytes))
                f["memcpy_gbps"] = plan.bytes_per_case / memcpy.seconds(plan.bytes_per_case, 5) / 1e9
                f["mooncake_gbps"] = None if missing else _mooncake(plan.bytes_per_case, page_bytes)
                f["tcp_gbps"] = _loopback_tcp_gbps(plan.bytes_per_case, plan.reps)
                figures[page_bytes] = f
                mc = f["mooncake_gbps"]
                print(
                    f"  {page_bytes >> 10:>5} KiB pages: engine to engine {f['engine_gbps']:.2f} GB/s, fetcher alone "
                    f"{f['wire_gbps']:.2f} GB/s, memcpy {f['memcpy_gbps']:.2f} GB/s, Mooncake TCP "
                    + (f"{mc:.2f} GB/s" if mc is not None else "not measured")
                    + f", bare loopback TCP (sendall -> recv_into) {f['tcp_gbps']:.2f} GB/s"
                )
            p50, p99, floor = _metaquery_case(plan, meta)
            print(
                f"  QueryPrefix of 128 hashes at {plan.announced} announced blocks: p50 {p50:.0f} us, "
                f"p99 {p99:.0f} us; "
                f"the same call finding nothing (gRPC's round trip): p50 {floor:.0f} us"
            )
        except (OSError, RuntimeError, grpc.RpcError) as e:
            print(f"benchmark failed: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        finally:
            meta.stop()
    main_fig = figures[2 * MiB]
    peer, memcpy_gbps, mooncake = main_fig["engine_gbps"], main_fig["memcpy_gbps"], main_fig["mooncake_gbps"]
    assert peer is not None and memcpy_gbps is not None
    mooncake_text = f"{mooncake:.2f}" if mooncake else "nan"
    versus = f"{peer / mooncake:.3f}" if mooncake else "nan"
    print(
        "RESULT "
        f"peer_gbps={peer:.2f} memcpy_gbps={memcpy_gbps:.2f} mooncake_tcp_gbps={mooncake_text} "
        f"peer_vs_memcpy={peer / memcpy_gbps:.3f} peer_vs_mooncake={versus} metaquery_p50_us={p50:.0f} "
        f"metaquery_floor_us={floor:.0f} peer_vs_tcp={peer / main_fig['tcp_gbps']:.3f}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(quick="--quick" in sys.argv))
