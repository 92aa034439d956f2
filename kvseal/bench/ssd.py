"""`kvseal bench ssd`: the SSD tier's write and read throughput against `dd` with O_DIRECT on the same directory
and bytes in the same run, and its recovery time per million records.

Cases (each page size: 2 MiB and 128 KiB):
  write   pages from an anonymous arena handed to DiskTier.write in batches of 64, timed until every batch
          is acknowledged (the tier's writers build records in place and write 4 MiB batches)
  read    the same blocks read back by a freshly opened tier (so nothing is cached by the tier), 256 per call,
          every record verified (checksums, digest, namespace, hash) on the way
  dd      `dd if=/dev/zero of=F bs=4M oflag=direct` then `dd if=F of=/dev/null bs=4M iflag=direct`, same bytes
Save with write-through: Saves of 64 x 2 MiB pages (Llama-8B-like, 32 layers) through a real engine, new hashes each
time, with the tier off and on (same run): the Save path's cost of writing through, and how long the disk takes
to catch up after the last Save.
Recovery: a tier of tiny records (one 64-byte page each) closed cleanly, then opened: seconds per million records
through the segment summaries; and the same after a crash (no close: the open segment is scanned).

Last line:
    RESULT ssd_write_gbps=... ssd_read_gbps=... dd_write_gbps=... dd_read_gbps=... write_ratio=... read_ratio=...
           recovery_s_per_m=... scan_s_per_m=... save_with_ssd_ratio=...
(write/read figures: the 2 MiB pages, medians of 3 repetitions, each the tier over the mean of the dd runs just
before and after it. Targets: ratios >= 0.9, recovery <= 2 s per million.)
"""

from __future__ import annotations

import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvseal.core.layout import LayerGeometry, Layout, build_layout, namespace_final
from kvseal.ssd.device import FileDevice
from kvseal.ssd.tier import DiskTier, WriteItem


@dataclass(frozen=True)
class Plan:
    name: str
    bytes_per_case: int
    recovery_records: int


FULL = Plan("full", 1 << 30, 1_000_000)
QUICK = Plan("quick: smoke figures on small sizes, not the targets' measurement", 128 << 20, 50_000)
REPS = 3  # repetitions per page size, each between two dd runs


def _layout(page_bytes: int) -> Layout:
    return build_layout(16, 1, [LayerGeometry("model.layers.0.attn", "bfloat16", page_bytes, 1, 0, "bench")])


def _tier(directory: Path, capacity: int, segment: int) -> DiskTier:
    tier = DiskTier([FileDevice(directory, capacity, segment)])
    return tier


def _write_all(tier: DiskTier, layout: Layout, arena: np.ndarray, hashes: list[bytes], batch: int = 64) -> float:
    key = (0, namespace_final("bench", layout))
    size = layout.page_bytes
    pending = threading.Semaphore(0)
    submitted = 0
    t0 = time.perf_counter()
    for i in range(0, len(hashes), batch):
        chunk = hashes[i : i + batch]
        items = [WriteItem(h, memoryview(arena[(i + k) * size : (i + k + 1) * size])) for k, h in enumerate(chunk)]
        while items:
            taken = tier.write(key, layout, items, lambda ok: pending.release())
            if taken:
                submitted += 1
                items = items[taken:]
            else:
                time.sleep(0.0005)  # the queues are full: wait for the writers, as a steady workload would
    for _ in range(submitted):
        pending.acquire()
    return time.perf_counter() - t0


def _read_all(tier: DiskTier, layout: Layout, hashes: list[bytes], batch: int = 256) -> tuple[float, int]:
    key = (0, namespace_final("bench", layout))
    size = layout.page_bytes
    scratch = np.ones(batch * size, dtype=np.uint8)  # faulted in: the pool pages a refill writes are too
    views = [memoryview(scratch[k * size : (k + 1) * size]) for k in range(batch)]
    bad = 0
    t0 = time.perf_counter()
    for i in range(0, len(hashes), batch):
        chunk = hashes[i : i + batch]
        bad += sum(1 for r in tier.read(key, layout, chunk, views[: len(chunk)]) if r)
    return time.perf_counter() - t0, bad


def _dd(args: list[str]) -> float:
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
    m = re.search(r"copied, ([\d.]+) s", out)
    if m is None:
        raise RuntimeError(f"cannot read dd's output: {out!r}")
    return float(m.group(1))


def _throughput_case(plan: Plan, directory: Path, page_bytes: int) -> dict[str, float]:
    """Each repetition brackets the tier between two dd runs on the same bytes (the disks here are shared and
    drift by 2x within minutes) and takes the tier over the mean of its two dd neighbours; the ratios are the
    medians of the repetitions', the GB/s figures the medians too."""
    layout = _layout(page_bytes)
    n = plan.bytes_per_case // page_bytes
    arena = np.random.default_rng(page_bytes).integers(0, 256, n * page_bytes, dtype=np.uint8)
    hashes = [i.to_bytes(32, "big") for i in range(n)]
    data = n * page_bytes
    count = data // (4 << 20)
    dd_bytes = count * (4 << 20)
    dd_file = directory / "dd.bin"
    capacity = 2 * plan.bytes_per_case + (512 << 20)

    def dd() -> tuple[float, float]:
        w = _dd(["if=/dev/zero", f"of={dd_file}", "bs=4M", f"count={count}", "oflag=direct"])
        r = _dd([f"if={dd_file}", "of=/dev/null", "bs=4M", "iflag=direct"])
        dd_file.unlink()
        return dd_bytes / w / 1e9, dd_bytes / r / 1e9

    runs: dict[str, list[float]] = {k: [] for k in ("write", "read", "dd_write", "dd_read", "wr", "rr")}
    before = dd()
    for rep in range(REPS):
        tier_dir = directory / f"tier-{page_bytes}-{rep}"
        tier = _tier(tier_dir, capacity, 256 << 20)
        tier.open()
        write = data / _write_all(tier, layout, arena, hashes) / 1e9
        tier.close()
        reader = _tier(tier_dir, capacity, 256 << 20)
        reader.open()
        read_s, bad = _read_all(reader, layout, hashes)
        reader.close()
        shutil.rmtree(tier_dir)
        if bad:
            raise RuntimeError(f"{bad} blocks failed verification")
        after = dd()
        dd_w, dd_r = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2
        for k, v in (("write", write), ("read", data / read_s / 1e9), ("dd_write", dd_w), ("dd_read", dd_r)):
            runs[k].append(v)
        runs["wr"].append(write / dd_w)
        runs["rr"].append(runs["read"][-1] / dd_r)
        before = after
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "write_gbps": med["write"],
        "read_gbps": med["read"],
        "dd_write_gbps": med["dd_write"],
        "dd_read_gbps": med["dd_read"],
        "write_ratio": med["wr"],
        "read_ratio": med["rr"],
        "write_ratios": runs["wr"],
        "read_ratios": runs["rr"],
    }


def _save_case(plan: Plan, directory: Path, with_ssd: bool) -> tuple[float, float, int]:
    """Save GB/s through a real engine (best of the repetitions), seconds from the last Save until the SSD had
    written (or skipped) every block, and how many it skipped (0, 0 without the tier)."""
    from kvseal.bench.harness import START_TIMEOUT_S, Hashes, SharedKV, layer_names, register, start_engine
    from kvseal.client import EngineClient

    reps, batch = (6, 64) if plan is FULL else (3, 32)
    page = 2 << 20
    extra = ("--ssd-path", str(directory / "save-tier"), "--ssd-capacity", "16GiB") if with_ssd else ()
    engine = start_engine(directory, f"save-{with_ssd}", (reps + 1) * batch * page + (256 << 20), extra)
    kv = SharedKV(32, batch, page // 32, np.random.default_rng(1))
    try:
        engine.wait_ready(START_TIMEOUT_S)
        client = EngineClient(engine.target, timeout=120)
        worker = register(client, "save", kv, 16, layer_names(32))
        hashes = Hashes()
        best = float("inf")
        for _ in range(reps):
            block_hashes = hashes.take(batch)
            t0 = time.perf_counter()
            client.save(worker.key, block_hashes, list(range(batch)))
            best = min(best, time.perf_counter() - t0)
        t_last = time.perf_counter()
        drain, skipped = 0.0, 0
        if with_ssd:
            deadline = t_last + 300

            def handled() -> tuple[float, float]:
                m = engine.metrics()
                return m.get("kvseal_ssd_records", 0), m.get("kvseal_ssd_skipped_total", 0)

            while sum(handled()) < reps * batch:  # every block written, or skipped (its queue was full)
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"the SSD writers did not catch up in 300 s: {handled()}")
                time.sleep(0.01)  # poll interval of a bounded wait on the engine's own figure
            drain = time.perf_counter() - t_last
            skipped = int(handled()[1])
        client.close()
    finally:
        engine.stop()
        kv.close()
        shutil.rmtree(directory / "save-tier", ignore_errors=True)
    return batch * page / best / 1e9, drain, skipped


def _recovery_case(plan: Plan, directory: Path, crash: bool) -> float:
    layout = _layout(64)
    n = plan.recovery_records
    arena = np.zeros(n * 64, dtype=np.uint8)
    hashes = [i.to_bytes(32, "big") for i in range(n)]
    tier_dir = directory / f"recovery-{crash}"
    capacity = max(n * 256 * 2, 64 << 20)
    device = FileDevice(tier_dir, capacity, 16 << 20)
    tier = DiskTier([device])
    tier.open()
    _write_all(tier, layout, arena, hashes, batch=4096)
    if not crash:
        tier.close()
    else:
        tier.flush()  # written, but the open segment never sealed: as after SIGKILL,
        device.close()  # whose descriptors (the directory's lock among them) the kernel closes
    reopened = _tier(tier_dir, capacity, 16 << 20)
    report = reopened.open()
    if report.records != n:
        raise RuntimeError(f"recovered {report.records} of {n} records")
    reopened.close()
    shutil.rmtree(tier_dir)
    return report.seconds / n * 1e6


def main(quick: bool = False, directory: str | None = None) -> int:
    plan = QUICK if quick else FULL
    base = Path(directory) if directory else Path(tempfile.gettempdir())
    print(f"kvseal SSD benchmark ({plan.name}), directory {base}")
    with tempfile.TemporaryDirectory(prefix="kvseal-bench-ssd-", dir=base) as tmp:
        work = Path(tmp)
        probe = FileDevice(work / "probe", 1 << 20, 256 << 10)
        direct = probe.direct
        probe.close()
        print(f"  O_DIRECT {'supported' if direct else 'NOT supported: buffered I/O (figures include the page cache)'}")
        try:
            figures: dict[int, dict[str, Any]] = {}
            for page_bytes in (2 << 20, 128 << 10):
                f = _throughput_case(plan, work, page_bytes)
                figures[page_bytes] = f
                ratios = " ".join(f"{w:.2f}/{r:.2f}" for w, r in zip(f["write_ratios"], f["read_ratios"], strict=True))
                print(
                    f"  {page_bytes >> 10:>5} KiB pages: write {f['write_gbps']:.2f} GB/s = {f['write_ratio']:.2f} "
                    f"x dd {f['dd_write_gbps']:.2f}, read {f['read_gbps']:.2f} GB/s = {f['read_ratio']:.2f} x dd "
                    f"{f['dd_read_gbps']:.2f} (medians of {REPS} over {plan.bytes_per_case >> 20} MiB; write/read "
                    f"ratios {ratios})"
                )
            save_off, _, _ = _save_case(plan, work, with_ssd=False)
            save_on, drain, skipped = _save_case(plan, work, with_ssd=True)
            print(
                f"  Save, 2 MiB pages: {save_off:.2f} GB/s without the tier, {save_on:.2f} GB/s writing through "
                f"({save_on / save_off:.2f} x); the writers were done {drain:.2f} s after the last Save, "
                f"{skipped} blocks skipped (queues full: the pool's quarter they may pin)"
            )
            recovery = _recovery_case(plan, work, crash=False)
            scan = _recovery_case(plan, work, crash=True)
            print(
                f"  recovery of {plan.recovery_records} records: {recovery:.2f} s per million through summaries, "
                f"{scan:.2f} s per million scanning an unsealed segment"
            )
        except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
            print(f"benchmark failed: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    main_fig = figures[2 << 20]
    print(
        "RESULT "
        f"ssd_write_gbps={main_fig['write_gbps']:.2f} ssd_read_gbps={main_fig['read_gbps']:.2f} "
        f"dd_write_gbps={main_fig['dd_write_gbps']:.2f} dd_read_gbps={main_fig['dd_read_gbps']:.2f} "
        f"write_ratio={main_fig['write_ratio']:.3f} read_ratio={main_fig['read_ratio']:.3f} "
        f"recovery_s_per_m={recovery:.2f} scan_s_per_m={scan:.2f} save_with_ssd_ratio={save_on / save_off:.3f}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(quick="--quick" in sys.argv))
