"""CUDA benchmark and check (needs torch with a CUDA device): a real `kvseal serve` subprocess and this process as
a worker whose KV lives on the GPU, registered by CUDA IPC handles (kvseal.client.cuda_handle), the way a vLLM
worker on a GPU would hand over its KV.

    KV         32 layers in vLLM's FlashAttention layout, [2, num_blocks, 16, 8, 128] bf16 per layer (K and V
               planes: two 32 KiB segments per block), random bytes: 2 MiB pages
    check      Save blocks, Load them into other block ids (consecutive and scattered), then compare the whole KV
               with a copy taken before: the loaded blocks equal their sources, every other byte is unchanged
    speed      Save (GPU -> pool, D2H) and Load (pool -> GPU, H2D) of 64 and 256 consecutive blocks per RPC, and
               of 256 scattered ones, end to end through the lane, against the ceiling of the same bytes measured
               in the same run: one contiguous cudaMemcpy between a GPU buffer and pinned host memory (best of
               the repetitions), and the pageable one for reference

The last line is machine-readable:

    RESULT d2h_gbps=... h2d_gbps=... pinned_d2h_gbps=... pinned_h2d_gbps=... save_ratio=... load_ratio=...
           byte_exact=1 pool_pinned=1

(save/load of 256 consecutive blocks per RPC; ratios against the pinned ceiling).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvseal.bench.harness import START_TIMEOUT_S, Hashes, start_engine
from kvseal.client import EngineClient, layer_from_tensor
from kvseal.errors import KvsealError
from kvseal.testing.process import EngineProcess

GiB, MiB = 1 << 30, 1 << 20
LAYERS, HEADS, HEAD_DIM, BLOCK_TOKENS = 32, 8, 128, 16
NUM_BLOCKS = 1024  # 64 MiB per layer, 2 GiB of KV
LAYOUT_TAG = "FLASH_ATTN/NHD/cuda/bfloat16/auto"
POOL = 4 * GiB


def main(quick: bool = False) -> int:
    try:
        import torch
    except ImportError:
        print("kvseal bench cuda needs torch with CUDA (pip install torch, a CUDA build)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(f"kvseal bench cuda needs a CUDA device; torch {torch.__version__} sees none", file=sys.stderr)
        return 2
    reps = 3 if quick else 10
    print(f"kvseal CUDA benchmark: torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    with tempfile.TemporaryDirectory(prefix="kvseal-bench-cuda-") as tmp:
        try:
            result = _run(torch, Path(tmp), reps)
        except (KvsealError, RuntimeError, OSError) as e:
            print(f"benchmark failed: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    print("RESULT " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))
    return 0 if result["byte_exact"] == 1 else 1


def _run(torch: Any, tmp: Path, reps: int) -> dict[str, Any]:
    engine = start_engine(tmp, "engine", POOL, extra=["--log-level", "INFO"])
    try:
        start = engine.wait_ready(START_TIMEOUT_S)
        client = EngineClient(engine.target, timeout=60.0)
        print(f"engine serving after {start:.1f} s (pool {POOL // GiB} GiB, pre-faulted)")
        return _measure(torch, engine, client, reps)
    except Exception:
        code = engine.proc.poll()
        print(f"engine {'exited with ' + str(code) if code is not None else 'running'}; its log:", file=sys.stderr)
        log_text = engine.log_path.read_text(errors="replace")
        fatal = log_text.find("Fatal Python error")  # a crash: its own thread's stack comes first
        print(log_text[fatal : fatal + 4000] if fatal >= 0 else engine.log_tail(60), file=sys.stderr)
        raise
    finally:
        engine.stop()


def _measure(torch: Any, engine: EngineProcess, client: EngineClient, reps: int) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(20261204)
    kv = [
        torch.randint(
            0, 256, (2, NUM_BLOCKS, BLOCK_TOKENS, HEADS, HEAD_DIM * 2), dtype=torch.uint8, device="cuda", generator=gen
        ).view(torch.bfloat16)
        for _ in range(LAYERS)
    ]
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    t0 = time.perf_counter()
    status = client.register(
        instance_id="bench-cuda",
        namespace="bench-cuda",
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        world_size=1,
        block_size=BLOCK_TOKENS,
        layers=[layer_from_tensor(n, t, layout_tag=LAYOUT_TAG, split_kv=True) for n, t in zip(names, kv, strict=True)],
    )
    print(
        f"registered {LAYERS} CUDA layers in {time.perf_counter() - t0:.2f} s as {status.namespace_final}, "
        f"{status.page_bytes / MiB:g} MiB pages"
    )
    worker, hashes, page = ("bench-cuda", 0, 0), Hashes(), status.page_bytes
    pinned = "page-locked the pool" in engine.log_path.read_text()

    # byte-exact: consecutive and scattered block ids, the whole KV compared with a copy taken before the loads
    exact = True
    perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1)).tolist()
    for label, src, dst in (
        ("consecutive", list(range(0, 256)), list(range(512, 768))),
        ("scattered", perm[:200], perm[200:400]),
    ):
        h = hashes.take(len(src))
        saved = client.save(worker, h, src)
        before = [t.clone() for t in kv]
        for t in kv:
            t[:, dst] = 0
        loaded = client.load(worker, h, dst)
        torch.cuda.synchronize()
        expected = [b.clone() for b in before]
        for e in expected:
            e[:, dst] = e[:, src]
        same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(kv, expected, strict=True))
        ok = saved.completed == len(src) and loaded.loaded == len(src) and same
        print(f"check {label}: saved {saved.completed}, loaded {loaded.loaded} of {len(src)}; byte-exact {same}")
        exact &= ok
        del before, expected

    figures: dict[str, tuple[float, float, float, float]] = {}
    for label, src, dst in (
        ("64 consecutive", list(range(0, 64)), list(range(512, 576))),
        ("256 consecutive", list(range(0, 256)), list(range(512, 768))),
        ("256 scattered", perm[:256], perm[256:512]),
    ):
        nbytes = len(src) * page
        save_s, load_s = [], []
        m0 = engine.metrics()
        for _ in range(reps):
            h = hashes.take(len(src))
            t0 = time.perf_counter()
            client.save(worker, h, src)
            t1 = time.perf_counter()
            r = client.load(worker, h, dst)
            t2 = time.perf_counter()
            if r.loaded != len(src):
                raise RuntimeError(f"{label}: loaded {r.loaded} of {len(src)}: {r.message}")
            save_s.append(t1 - t0)
            load_s.append(t2 - t1)
        m1 = engine.metrics()
        copy_save = (m1["kvseal_save_seconds_total"] - m0["kvseal_save_seconds_total"]) / reps
        copy_load = (m1["kvseal_load_seconds_total"] - m0["kvseal_load_seconds_total"]) / reps
        d2h, h2d = _ceiling(torch, nbytes, reps, pinned=True)
        pd2h, ph2d = _ceiling(torch, nbytes, max(3, reps // 3), pinned=False)
        save, load = nbytes / min(save_s) / 1e9, nbytes / min(load_s) / 1e9
        print(
            f"{label} blocks x {page / MiB:g} MiB = {nbytes / MiB:.0f} MiB per RPC, {reps} reps (best; median)\n"
            f"  save (D2H) {save:6.2f} GB/s ({nbytes / statistics.median(save_s) / 1e9:.2f}) = {save / d2h:.3f} x "
            f"pinned cudaMemcpy {d2h:.2f} GB/s; the engine's copy {nbytes / copy_save / 1e9:.2f} GB/s; "
            f"pageable cudaMemcpy {pd2h:.2f}\n"
            f"  load (H2D) {load:6.2f} GB/s ({nbytes / statistics.median(load_s) / 1e9:.2f}) = {load / h2d:.3f} x "
            f"pinned cudaMemcpy {h2d:.2f} GB/s; the engine's copy {nbytes / copy_load / 1e9:.2f} GB/s; "
            f"pageable cudaMemcpy {ph2d:.2f}"
        )
        figures[label] = (save, load, d2h, h2d)
    save, load, d2h, h2d = figures["256 consecutive"]
    return {
        "d2h_gbps": save,
        "h2d_gbps": load,
        "pinned_d2h_gbps": d2h,
        "pinned_h2d_gbps": h2d,
        "save_ratio": save / d2h,
        "load_ratio": load / h2d,
        "byte_exact": int(exact),
        "pool_pinned": int(pinned),
    }


def _ceiling(torch: Any, nbytes: int, reps: int, *, pinned: bool) -> tuple[float, float]:
    """Best GB/s of one contiguous D2H and one H2D copy of `nbytes` between a GPU buffer and host memory."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    host.fill_(1)  # faults pageable memory in
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = [float("inf"), float("inf")]
    for _ in range(reps):
        for i, (dst, src) in enumerate(((host, dev), (dev, host))):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=pinned)
            torch.cuda.synchronize()
            best[i] = min(best[i], time.perf_counter() - t0)
    return nbytes / best[0] / 1e9, nbytes / best[1] / 1e9
