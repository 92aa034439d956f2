"""KVSealConnector's own rules, in-process against vLLM's own objects (no engine, no vLLM run): it refuses a
KVCacheConfig with more than one KV cache group as vLLM's grouping produces one; its claim of an engine hit with an
EAGLE-style drafter matches vLLM's own prefix-cache rule applied to both caches together; the backoff that keeps a
wedged engine from costing a deadline per step; `kvseal.timeout_s`.

vLLM is imported once per module, with its import-time deprecation warnings silenced (pytest turns warnings into
errors, and they are vLLM's, not ours)."""

from __future__ import annotations

import logging
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
from vllm_support import TOKENIZER_FILES, shared_model

from kvseal.errors import DeadlineExceeded
from kvseal.testing import FakeClock

BLOCK = 16


@pytest.fixture(scope="module")
def v() -> types.SimpleNamespace:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
        from vllm.config import KVTransferConfig, VllmConfig
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_kv_cache_groups, make_block_hash_with_group_id
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

        from kvseal.vllm import connector
    return types.SimpleNamespace(
        torch=torch,
        KVTransferConfig=KVTransferConfig,
        VllmConfig=VllmConfig,
        KVConnectorRole=KVConnectorRole,
        KVCacheManager=KVCacheManager,
        get_kv_cache_groups=get_kv_cache_groups,
        make_block_hash_with_group_id=make_block_hash_with_group_id,
        FullAttentionSpec=FullAttentionSpec,
        KVCacheConfig=KVCacheConfig,
        KVCacheGroupSpec=KVCacheGroupSpec,
        SlidingWindowSpec=SlidingWindowSpec,
        connector=connector,
    )


def _transfer(v: types.SimpleNamespace, **extra: Any) -> Any:
    return v.KVTransferConfig(
        kv_connector="KVSealConnector",
        kv_connector_module_path="kvseal.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"kvseal.engine": "unix:/nonexistent/kvseal-unit.sock", **extra},
    )


def _vllm_config(v: types.SimpleNamespace, **extra: Any) -> Any:
    config = v.VllmConfig(kv_transfer_config=_transfer(v, **extra))
    config.cache_config.kv_cache_layout = "LBHNC"  # what the engine core resolves before grouping
    return config


def _attention(v: types.SimpleNamespace, **kwargs: Any) -> Any:
    return v.FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=v.torch.float32, **kwargs)


def _kv_cache_config(groups: list[Any], v: types.SimpleNamespace) -> Any:
    return v.KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def _one_group(v: types.SimpleNamespace, **group: Any) -> Any:
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    return _kv_cache_config([v.KVCacheGroupSpec(names, _attention(v), **group)], v)


# ---------------------------------------------------------------- KV cache groups


def test_vllm_groups_and_the_connector_refuses_more_than_one(v: types.SimpleNamespace) -> None:
    config = _vllm_config(v)
    # the connector has no SupportsHMA, so vLLM turned its hybrid KV cache manager off
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is True

    # target layers DCP-sharded (the default), a draft layer replicated (a draft at DCP 1 under a DCP target):
    # vLLM's own grouping, with the hybrid manager off, still gives several groups
    specs = {
        "model.layers.0.self_attn.attn": _attention(v),
        "model.layers.1.self_attn.attn": _attention(v),
        "draft.layers.0.self_attn.attn": _attention(v, dcp_sharded=False),
    }
    groups = v.get_kv_cache_groups(config, dict(specs))
    assert len(groups) > 1
    kv_cache_config = _kv_cache_config(groups, v)

    for role in (v.KVConnectorRole.SCHEDULER, v.KVConnectorRole.WORKER):
        with pytest.raises(ValueError) as refused:
            v.connector.KVSealConnector(config, role, kv_cache_config)
        message = str(refused.value)
        assert message.startswith(f"kvseal supports one KV cache group; this model has {len(groups)} (group 0: ")
        for i, group in enumerate(groups):
            assert f"group {i}: {type(group.kv_cache_spec).__name__}, {len(group.layer_names)} layers" in message
        assert "draft.layers.0.self_attn.attn" in message
        assert "drop --kv-transfer-config" in message


def test_sliding_window_layers_merge_into_the_one_group_it_accepts(v: types.SimpleNamespace) -> None:
    config = _vllm_config(v)
    window = v.SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=v.torch.float32, sliding_window=4 * BLOCK
    )
    specs = {f"model.layers.{i}.self_attn.attn": _attention(v) if i % 2 else window for i in range(4)}
    [group] = v.get_kv_cache_groups(config, dict(specs))  # unify_hybrid_kv_cache_specs: all full attention
    assert sorted(group.layer_names) == sorted(specs)
    connector = v.connector.KVSealConnector(config, v.KVConnectorRole.SCHEDULER, _kv_cache_config([group], v))
    connector.shutdown()


def test_an_attention_free_model_is_refused(v: types.SimpleNamespace) -> None:
    with pytest.raises(ValueError, match=r"this model has none \(it is attention-free"):
        v.connector.KVSealConnector(_vllm_config(v), v.KVConnectorRole.SCHEDULER, _kv_cache_config([], v))


def _spec_kinds(v: types.SimpleNamespace) -> dict[str, tuple[Any, bool]]:
    """One spec of every kind vLLM may put in a lone group, and whether kvseal serves it."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        CircularBufferSpec,
        CrossAttentionSpec,
        EncoderOnlyAttentionSpec,
        HiddenStateCacheSpec,
        MambaSpec,
        MLAAttentionSpec,
        SinkFullAttentionSpec,
        SlidingWindowMLASpec,
        UniformTypeKVCacheSpecs,
    )

    f32, heads = v.torch.float32, {"num_kv_heads": 2, "head_size": 32}
    mamba = MambaSpec(block_size=BLOCK, shapes=((3, 64), (4, 16, 16)), dtypes=(f32, f32), mamba_cache_mode="align")
    window = v.SlidingWindowSpec(block_size=BLOCK, dtype=f32, sliding_window=4 * BLOCK, **heads)
    return {
        "full": (_attention(v), True),
        "mla": (MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=f32), True),
        "sink": (SinkFullAttentionSpec(block_size=BLOCK, dtype=f32, sink_len=4, **heads), True),
        "sliding": (window, True),
        "chunked": (
            ChunkedLocalAttentionSpec(block_size=BLOCK, dtype=f32, attention_chunk_size=8 * BLOCK, **heads),
            True,
        ),
        "uniform": (UniformTypeKVCacheSpecs(block_size=BLOCK, kv_cache_specs={"a": _attention(v)}), True),
        "mamba": (mamba, False),
        "mamba-in-uniform": (
            UniformTypeKVCacheSpecs(block_size=BLOCK, kv_cache_specs={"a": window, "m": mamba}),
            False,
        ),
        "cross": (CrossAttentionSpec(block_size=BLOCK, dtype=f32, **heads), False),
        "encoder-only": (EncoderOnlyAttentionSpec(block_size=BLOCK, dtype=f32, **heads), False),
        "circular": (CircularBufferSpec(block_size=BLOCK, dtype=f32, **heads), False),
        "bounded-replay": (
            SlidingWindowMLASpec(
                block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=f32, sliding_window=BLOCK, bounded_replay=True
            ),
            False,
        ),
        "hidden-states": (HiddenStateCacheSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=f32), False),
    }


def test_only_prefix_cacheable_attention_is_served(v: types.SimpleNamespace) -> None:
    """A Mamba state, cross-attention, a cache vLLM does not prefix-cache …: refused at construction, on both sides,
    naming the group's spec; never saved and loaded as if its blocks were a prefix's KV."""
    names = [f"model.layers.{i}.mixer" for i in range(3)]
    for kind, (spec, served) in _spec_kinds(v).items():
        kv_cache_config = _kv_cache_config([v.KVCacheGroupSpec(names, spec)], v)
        for role in (v.KVConnectorRole.SCHEDULER, v.KVConnectorRole.WORKER):
            if served:  # (a worker side needs a model config: the refusal comes before it is read)
                if role == v.KVConnectorRole.SCHEDULER:
                    v.connector.KVSealConnector(_vllm_config(v), role, kv_cache_config).shutdown()
                continue
            with pytest.raises(ValueError) as refused:
                v.connector.KVSealConnector(_vllm_config(v), role, kv_cache_config)
            message = str(refused.value)
            assert message.startswith("kvseal cannot serve this model's KV cache: group 0 is "), kind
            inner = "MambaSpec" if kind == "mamba-in-uniform" else type(spec).__name__
            assert inner in message and "3 layers (model.layers.0.mixer, model.layers.1.mixer, … 1 more)" in message
            assert "drop --kv-transfer-config" in message


def test_the_null_block_is_never_handed_over(v: types.SimpleNamespace) -> None:
    without = v.connector.without_null_blocks
    hashes = [bytes([n]) * 32 for n in range(5)]
    assert without(hashes, [0, 0, 0, 7, 9]) == (hashes[3:], [7, 9])
    assert without(hashes, [3, 0, 5, 0, 8]) == ([hashes[0], hashes[2], hashes[4]], [3, 5, 8])
    assert without(hashes, [1, 2, 3, 4, 5]) == (hashes, [1, 2, 3, 4, 5])
    assert without([], []) == ([], [])


# ---------------------------------------------------------------- EAGLE / MTP: the last block of the hit


def _vllm_hit(v: types.SimpleNamespace, cached: int, hashes: list[bytes], num_tokens: int, use_eagle: bool) -> int:
    """Blocks of vLLM's own prefix-cache hit when its pool holds the first `cached` of `hashes`: vLLM's
    KVCacheManager (the scheduler passes use_eagle=speculative_config.use_eagle_block_drop()), and the lookup
    get_computed_blocks makes (at most num_tokens - 1 tokens)."""
    manager = v.KVCacheManager(
        _one_group(v), max_model_len=4096, scheduler_block_size=BLOCK, hash_block_size=BLOCK, use_eagle=use_eagle
    )
    pool = manager.block_pool
    for i in range(cached):
        pool.cached_block_hash_to_block.insert(v.make_block_hash_with_group_id(hashes[i], 0), pool.blocks[i + 1])
    _, tokens, _ = manager.coordinator.find_longest_cache_hit(hashes, num_tokens - 1)
    assert tokens % BLOCK == 0
    return tokens // BLOCK


@pytest.mark.parametrize("use_eagle", [False, True])
def test_claim_matches_vllms_rule_over_both_caches(v: types.SimpleNamespace, use_eagle: bool) -> None:
    """For every split of a prompt's prefix between vLLM's own cache (`local` leading blocks) and kvseal (`kept`
    leading blocks), vLLM's hit plus the connector's claim is exactly the hit vLLM would take if kvseal's blocks
    were its own: the drafter's block is never loaded from kvseal."""
    claim = v.connector.claimable_blocks
    five = [bytes([n]) * 32 for n in range(5)]
    assert _vllm_hit(v, 5, five, 5 * BLOCK + 1, use_eagle) == (4 if use_eagle else 5)  # the rule being mirrored
    assert _vllm_hit(v, 5, five, 5 * BLOCK, use_eagle) == (3 if use_eagle else 4)  # never the last prompt token
    for num_tokens in (5 * BLOCK, 5 * BLOCK + 1, 6 * BLOCK - 1, 3 * BLOCK):
        hashes = [bytes([n, num_tokens % 256]) * 16 for n in range(num_tokens // BLOCK)]
        for local in range(len(hashes) + 1):
            for kept in range(len(hashes) + 1):
                vllm_hit = _vllm_hit(v, local, hashes, num_tokens, use_eagle)
                # the connector: blocks from vLLM's hit on, never the last prompt token
                limit = min((num_tokens - 1) // BLOCK, len(hashes))
                engine_hits = max(min(kept, limit) - vllm_hit, 0)
                claimed = claim(engine_hits, use_eagle)
                both = _vllm_hit(v, max(local, kept), hashes, num_tokens, use_eagle)
                assert vllm_hit + claimed == both, (num_tokens, local, kept, vllm_hit, engine_hits, claimed)
                assert 0 <= claimed <= engine_hits


def test_claim_drops_exactly_one_block(v: types.SimpleNamespace) -> None:
    claim = v.connector.claimable_blocks
    assert [claim(h, True) for h in range(4)] == [0, 0, 1, 2]
    assert [claim(h, False) for h in range(4)] == [0, 1, 2, 3]


@pytest.fixture(scope="module")
def eagle_draft(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny Llama and a one-layer EAGLE draft for it (config only)."""
    import json
    import shutil

    llama = shared_model(tmp_path_factory, layers=4)
    draft = tmp_path_factory.mktemp("eagle-draft")
    config = json.loads((llama / "config.json").read_text())
    config.update(architectures=["EagleLlamaForCausalLM"], num_hidden_layers=1)
    (draft / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES:
        shutil.copy(llama / name, draft / name)
    return llama, draft


def test_drafters_whose_block_vllm_drops(v: types.SimpleNamespace, eagle_draft: tuple[Path, Path]) -> None:
    """drops_last_hit_block reads vLLM's own engine config, as `vllm serve` builds it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from vllm.engine.arg_utils import EngineArgs

    llama, draft = eagle_draft

    def engine_config(speculative: dict[str, Any] | None) -> Any:
        args = EngineArgs(
            model=str(llama),
            speculative_config=speculative,
            enforce_eager=True,
            max_model_len=2048,
            kv_transfer_config=_transfer(v),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return args.create_engine_config()

    drops = v.connector.drops_last_hit_block
    eagle = {"method": "eagle", "model": str(draft), "num_speculative_tokens": 2}
    assert drops(engine_config(eagle), _one_group(v)) is True
    # vLLM's experimental switch keeps the block in its own hit; the connector follows it
    assert drops(engine_config({**eagle, "disable_eagle_block_drop": True}), _one_group(v)) is False
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    assert drops(engine_config(ngram), _one_group(v)) is False  # no drafter hidden states: nothing dropped
    assert drops(engine_config(None), _one_group(v)) is False
    # a group vLLM flagged as the drafter's is dropped from whatever the method
    assert drops(engine_config(None), _one_group(v, is_eagle_group=True)) is True


# ---------------------------------------------------------------- outages: backoff and one warning


def test_backoff_doubles_to_30s_and_a_success_resets_it(
    v: types.SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    outage = v.connector._Outage("unix:/wedged.sock", clock=clock)
    error = DeadlineExceeded("no answer within 5.0s")
    assert outage.allows_call()

    waits = []
    with caplog.at_level(logging.WARNING, logger="kvseal.vllm"):
        for _ in range(8):
            outage.failed("save", error)
            start = clock.now
            while not outage.allows_call():
                clock.advance(0.25)
            waits.append(clock.now - start)
        assert waits == [1, 2, 4, 8, 16, 30, 30, 30]
        assert [r.getMessage() for r in caplog.records] == [
            "kvseal engine at unix:/wedged.sock unavailable (save: no answer within 5.0s): continuing without the cache"
        ]

        outage.ok()
        assert outage.allows_call()
        assert caplog.records[-1].getMessage() == "kvseal engine at unix:/wedged.sock is back"
        outage.ok()
        assert len(caplog.records) == 2  # "back" once per outage

        outage.failed("query", error)  # a new outage: a new warning, and the interval starts over at 1 s
        assert not outage.allows_call()
        clock.advance(1.0)
        assert outage.allows_call()
    assert len(caplog.records) == 3


def test_outage_is_shared_by_the_connectors_of_a_process(v: types.SimpleNamespace) -> None:
    config = _vllm_config(v, **{"kvseal.engine": "unix:/nonexistent/shared-outage.sock", "kvseal.namespace": "unit"})
    scheduler = v.connector.KVSealConnector(config, v.KVConnectorRole.SCHEDULER, _one_group(v))
    worker = v.connector.KVSealConnector(config, v.KVConnectorRole.WORKER, _one_group(v))
    try:
        assert scheduler.outage is worker.outage  # a failure seen by one side pauses the other's calls too
    finally:
        scheduler.shutdown()
        worker.shutdown()


def test_timeout_s_sets_every_calls_deadline(v: types.SimpleNamespace) -> None:
    connector = v.connector.KVSealConnector(_vllm_config(v), v.KVConnectorRole.SCHEDULER, _one_group(v))
    assert connector.client.timeout == v.connector.DEFAULT_TIMEOUT_S == 5.0
    connector.shutdown()
    connector = v.connector.KVSealConnector(
        _vllm_config(v, **{"kvseal.timeout_s": "0.5"}), v.KVConnectorRole.SCHEDULER, _one_group(v)
    )
    assert connector.client.timeout == 0.5
    connector.shutdown()
    for bad in (0, -1, "soon", float("nan"), float("inf"), None):
        with pytest.raises(ValueError, match="kvseal.timeout_s must be a positive number of seconds, got"):
            v.connector.KVSealConnector(
                _vllm_config(v, **{"kvseal.timeout_s": bad}), v.KVConnectorRole.SCHEDULER, _one_group(v)
            )


def test_engine_uid_names_the_engines_user_by_uid_or_name(v: types.SimpleNamespace) -> None:
    for value, uid in (("65534", 65534), (65534, 65534), ("nobody", 65534), ("root", 0)):
        connector = v.connector.KVSealConnector(
            _vllm_config(v, **{"kvseal.engine_uid": value}), v.KVConnectorRole.SCHEDULER, _one_group(v)
        )
        assert uid in connector.client._engine_uids
        connector.shutdown()
    with pytest.raises(ValueError, match="kvseal.engine_uid must be a uid or a user name of this machine"):
        v.connector.KVSealConnector(
            _vllm_config(v, **{"kvseal.engine_uid": "no-such-user"}), v.KVConnectorRole.SCHEDULER, _one_group(v)
        )


# ---------------------------------------------------------------- KV tensor layouts


def test_kv_planes_are_read_off_the_tensor_vllm_allocated(v: types.SimpleNamespace) -> None:
    torch, splits_kv = v.torch, v.connector.splits_kv
    from kvseal.client import layer_from_tensor

    flash = torch.zeros(2, 64, BLOCK, 2, 32)  # FlashAttention on GPU: [2, num_blocks, block_size, heads, head_size]
    cpu = torch.zeros(64, 2, BLOCK, 64)  # vLLM CPU: [num_blocks, heads, block_size, 2 * head_size]
    mla = torch.zeros(64, BLOCK, 576)  # MLA: [num_blocks, block_size, latent]
    assert splits_kv(flash, 64)
    assert not splits_kv(cpu, 64) and not splits_kv(mla, 64)
    assert not splits_kv(torch.zeros(2, 2, BLOCK, 64), 2)  # two blocks of a page layout: not told apart, not split

    spec = layer_from_tensor("l0", flash, layout_tag="t", split_kv=splits_kv(flash, 64))
    assert (spec.segments, spec.num_blocks, spec.segment_bytes) == (2, 64, BLOCK * 2 * 32 * 4)
    assert list(spec.strides) == [BLOCK * 2 * 32 * 4, 64 * BLOCK * 2 * 32 * 4]
