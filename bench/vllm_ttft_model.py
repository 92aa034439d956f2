"""The benchmark model of bench/vllm_ttft.py: a Llama with random weights and a BPE tokenizer trained here on
synthetic text, so nothing is downloaded.

    python bench/vllm_ttft_model.py OUTDIR

Shape (SHAPE below): hidden 1024, 8 layers, 16 heads of 64, 4 KV heads, MLP 2816, vocabulary 32000, untied
LM head: 90 M parameters in the layers plus 2 x 32.8 M in the embedding and the LM head (156 M in all; a prefill
only multiplies the last token by the LM head, so the layers are what a prompt costs). Weights are fp32 on disk.
The directory is written under a temporary name and renamed when complete; `ensure` reuses it while its
`bench_shape.json` matches SHAPE.
"""

from __future__ import annotations

import json
import os
import random
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


def _tokenizer(vocab: int, seed: int):  # type: ignore[no-untyped-def]
    """A byte-level BPE trained on random words from 80 syllables; 32000 merges take ~8 s."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    syllables = [c + v for c in "bdfghjklmnprstvz" for v in "aeiou"]
    words = sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(1, 5))) for _ in range(60000)})
    corpus = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) for _ in range(40000)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def build(out: Path) -> dict[str, float]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = out.with_name(out.name + f".partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    start = time.perf_counter()
    fast = _tokenizer(SHAPE["vocab"], SHAPE["seed"])
    fast.save_pretrained(tmp)
    config = LlamaConfig(
        hidden_size=SHAPE["hidden"],
        num_hidden_layers=SHAPE["layers"],
        num_attention_heads=SHAPE["heads"],
        num_key_value_heads=SHAPE["kv_heads"],
        head_dim=SHAPE["head_dim"],
        intermediate_size=SHAPE["intermediate"],
        vocab_size=len(fast),
        max_position_embeddings=4096,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(SHAPE["seed"])
    model = LlamaForCausalLM(config).to(torch.float32)
    total = sum(p.numel() for p in model.parameters())
    embed = model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    model.save_pretrained(tmp, safe_serialization=True)
    info = {"params": total, "layer_params": total - embed, "vocab": len(fast), "seconds": time.perf_counter() - start}
    (tmp / "bench_info.json").write_text(json.dumps(info))
    (tmp / MARKER).write_text(json.dumps(SHAPE))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return info


if __name__ == "__main__":
    print(json.dumps(build(Path(sys.argv[1]))))
