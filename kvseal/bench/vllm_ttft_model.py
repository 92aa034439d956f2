"""The benchmark model of `kvseal bench vllm_ttft` and `kvseal bench pd`: a Llama with random weights and a BPE
tokenizer trained here on synthetic text, so nothing is downloaded.

    python -m kvseal.bench.vllm_ttft_model OUTDIR [ARCH]

ARCH "gemma3" (`kvseal bench vllm_ttft --arch gemma3`) builds Gemma 3 (Gemma3ForCausalLM) of the same shape: the
same 8 layers of the same attention and MLP sizes, six of them with a 512-token sliding window, the sixth and the
eighth global (Gemma 3's pattern, every sixth layer global, with the last made global too so that a prompt's KV is
held in full by a quarter of the layers).

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
ARCHS = ("llama", "gemma3")
WINDOW = 512  # gemma3's sliding window, in tokens


def shape(arch: str = "llama") -> dict[str, object]:
    """What identifies a built model of `arch` (the marker file's content)."""
    return dict(SHAPE) if arch == "llama" else SHAPE | {"arch": arch, "window": WINDOW}


def gemma3_config() -> dict[str, object]:
    layers = int(SHAPE["layers"])
    return {
        "model_type": "gemma3_text",
        "hidden_size": SHAPE["hidden"],
        "intermediate_size": SHAPE["intermediate"],
        "num_hidden_layers": layers,
        "num_attention_heads": SHAPE["heads"],
        "num_key_value_heads": SHAPE["kv_heads"],
        "head_dim": SHAPE["head_dim"],
        "query_pre_attn_scalar": SHAPE["head_dim"],
        "sliding_window": WINDOW,
        "layer_types": [
            "full_attention" if (i + 1) % 6 == 0 or i == layers - 1 else "sliding_attention" for i in range(layers)
        ],
        "max_position_embeddings": 4096,
    }


def is_built(out: Path, arch: str = "llama") -> bool:
    try:
        return bool(json.loads((out / MARKER).read_text()) == shape(arch))
    except (OSError, ValueError):
        return False


def build(out: Path, arch: str = "llama") -> dict[str, float]:
    from kvseal.testing import llama

    tmp = out.with_name(out.name + f".partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    start = time.perf_counter()
    if arch == "llama":
        model = llama.build(tmp, **SHAPE)
    else:
        model = llama.build_any(tmp, gemma3_config(), vocab=SHAPE["vocab"], seed=SHAPE["seed"])
    total = sum(p.numel() for p in model.parameters())
    embed = model.model.embed_tokens.weight.numel()
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():  # Gemma ties them
        embed += model.lm_head.weight.numel()
    info = {
        "params": total,
        "layer_params": total - embed,
        "vocab": SHAPE["vocab"],
        "seconds": time.perf_counter() - start,
    }
    (tmp / "bench_info.json").write_text(json.dumps(info))
    (tmp / MARKER).write_text(json.dumps(shape(arch)))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return info


if __name__ == "__main__":
    print(json.dumps(build(Path(sys.argv[1]), *sys.argv[2:3])))
