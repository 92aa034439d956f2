"""The benchmark model of `kvseal bench vllm_ttft` and `kvseal bench pd`: a Llama with random weights and a BPE
tokenizer trained here on synthetic text, so nothing is downloaded.

    python -m kvseal.bench.vllm_ttft_model OUTDIR

Shape (SHAPE below): hidden 1024, 8 layers, 16 heads of 64, 4 KV heads, MLP 2816, vocabulary 32000, untied
LM head: 90 M parameters in the layers plus 2 x 32.8 M in the embedding and the LM head (156 M in all; a prefill
only multiplies the last token by the LM head, so the layers are what a prompt costs). Weights are fp32 on disk.
The directory is written under a temporary name and renamed when complete; `ensure` reuses it while its
`bench_shape.json` matches SHAPE.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

SHAPE = {
    "hidden": 1024,
    "layers": 8,
    "heads": 16,
    "kv_heads": 4,
    "head_dim": 64,
    "intermediate": 2816,
    "vocab": 32000,
    "seed": 0,
}
MARKER = "bench_shape.json"


def is_built(out: Path) -> bool:
    try:
        return json.loads((out / MARKER).read_text()) == SHAPE
    except (OSError, ValueError):
        return False


def build(out: Path) -> dict[str, float]:
    from kvseal.testing import llama

    tmp = out.with_name(out.name + f".partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    start = time.perf_counter()
    model = llama.build(tmp, **SHAPE)
    total = sum(p.numel() for p in model.parameters())
    embed = model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    info = {
        "params": total,
        "layer_params": total - embed,
        "vocab": SHAPE["vocab"],
        "seconds": time.perf_counter() - start,
    }
    (tmp / "bench_info.json").write_text(json.dumps(info))
    (tmp / MARKER).write_text(json.dumps(SHAPE))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return info


if __name__ == "__main__":
    print(json.dumps(build(Path(sys.argv[1]))))
