"""Llama models with random weights and a BPE tokenizer trained here on synthetic words, for tests and
benchmarks that run real vLLM with nothing downloaded.

    build(out, layers=4, hidden=64, heads=4, kv_heads=2, head_dim=32, intermediate=None, vocab=1000, seed=0)
    build_any(out, {"model_type": "gemma3_text", ...}, vocab=1000, seed=0)    # another architecture

Needs torch, transformers and tokenizers (the `vllm` extra). vLLM's CPU attention needs head_dim >= 32.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any


def train_tokenizer(vocab: int, seed: int = 0) -> Any:
    """A byte-level BPE of `vocab` tokens, trained on random words made of 80 syllables (32000 tokens: ~8 s)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    syllables = [c + v for c in "bdfghjklmnprstvz" for v in "aeiou"]
    words = sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(1, 5))) for _ in range(2 * vocab)})
    corpus = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) for _ in range(max(3000, vocab))]
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


def build(
    out: str | Path,
    layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    intermediate: int | None = None,
    vocab: int = 1000,
    seed: int = 0,
    config_extra: dict[str, Any] | None = None,
) -> Any:
    """Writes the model and tokenizer to `out` (fp32 safetensors) and returns the model. `config_extra`: more
    config.json fields (e.g. num_nextn_predict_layers, which nothing in kvseal may read to guess a layer set)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    Path(out).mkdir(parents=True, exist_ok=True)
    fast = train_tokenizer(vocab, seed)
    fast.save_pretrained(out)
    config = LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate or 2 * hidden,
        vocab_size=len(fast),
        max_position_embeddings=4096,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        **(config_extra or {}),
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return model


def build_any(out: str | Path, config: dict[str, Any], vocab: int = 1000, seed: int = 0) -> Any:
    """Writes a causal LM of any architecture transformers knows (`config["model_type"]`, e.g. "gemma3_text"),
    with random weights (transformers' own initialization) and this module's tokenizer, to `out`; returns it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    Path(out).mkdir(parents=True, exist_ok=True)
    fast = train_tokenizer(vocab, seed)
    fast.save_pretrained(out)
    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = AutoConfig.for_model(
        config["model_type"],
        vocab_size=len(fast),
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        **fields,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return model
