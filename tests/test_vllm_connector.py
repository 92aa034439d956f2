"""KVSealConnector's own rules, in-process against vLLM's own objects (no engine, no vLLM run): it refuses a
KVCacheConfig with more than one KV cache group as vLLM's grouping produces one; its claim of an engine hit with an
EAGLE-style drafter matches vLLM's own prefix-cache rule applied to both caches together; the backoff that keeps a
wedged engine from costing a deadline per step, and which engine answers are not an outage; the extra config
(`kvseal.timeout_s` …, one frozen KVSealConfig); the facade's one side per role; the scheduler side's books against a
fake engine (claims, loads, saves, leases released).

vLLM is imported once per module, with its import-time deprecation warnings silenced (pytest turns warnings into
errors, and they are vLLM's, not ours)."""

from __future__ import annotations

import logging
import types
import warnings
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import pytest
from vllm_support import TOKENIZER_FILES, shared_model

from kvseal.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from kvseal.proto import kvseal_pb2 as pb
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

        from kvseal.vllm import compat, connector, outage
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
        compat=compat,
        outage=outage,
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


def test_several_groups_of_one_rule_are_one_kvseal_group_with_a_block_table_each(v: types.SimpleNamespace) -> None:
    from kvseal.core.layout import KvGroup

    config = _vllm_config(v)
    # the connector declares SupportsHMA: vLLM keeps its hybrid KV cache manager on
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False

    # target layers DCP-sharded (the default), a draft layer replicated (a draft at DCP 1 under a DCP target):
    # groups of full attention (one layer each: vLLM's hybrid manager sizes groups alike), each with its block
    # table; kvseal stores them as one group (format 1: a page's bytes are what they would be with one group) and
    # addresses each layer through its own table
    specs = {
        "model.layers.0.self_attn.attn": _attention(v),
        "model.layers.1.self_attn.attn": _attention(v),
        "draft.layers.0.self_attn.attn": _attention(v, dcp_sharded=False),
    }
    groups = v.get_kv_cache_groups(config, dict(specs))
    assert len(groups) == 3
    stored = v.compat.stored_groups(config, _kv_cache_config(groups, v))
    assert (stored.groups, stored.hash_block_size) == ((KvGroup("full", BLOCK),), BLOCK)
    assert stored.places == ((0, 0), (0, 1), (0, 2)) and stored.tables(0) == [0, 1, 2] and stored.hybrid
    v.connector.KVSealConnector(config, v.KVConnectorRole.SCHEDULER, _kv_cache_config(groups, v)).shutdown()


def test_sliding_window_and_full_layers_stay_apart_and_alike_groups_merge(v: types.SimpleNamespace) -> None:
    from kvseal.core.layout import KvGroup

    config = _vllm_config(v)
    window = v.SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=v.torch.float32, sliding_window=4 * BLOCK
    )
    specs = {f"model.layers.{i}.self_attn.attn": _attention(v) if i == 5 else window for i in range(6)}
    groups = v.get_kv_cache_groups(config, dict(specs))  # vLLM's hybrid manager: groups of equal size
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    assert kinds.count("SlidingWindowSpec") > 1 and kinds.count("FullAttentionSpec") == 1
    stored = v.compat.stored_groups(config, _kv_cache_config(groups, v))
    sliding = KvGroup("sliding", BLOCK, 4 * BLOCK)
    assert set(stored.groups) == {KvGroup("full", BLOCK), sliding} and len(stored.groups) == 2
    g = stored.groups.index(sliding)
    assert [i for i, k in enumerate(kinds) if k == "SlidingWindowSpec"] == stored.tables(g)
    assert [stored.places[i] for i in stored.tables(g)] == [(g, t) for t in range(kinds.count("SlidingWindowSpec"))]
    connector = v.connector.KVSealConnector(config, v.KVConnectorRole.SCHEDULER, _kv_cache_config(groups, v))
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
        "mamba": (mamba, True),  # a state kept at block boundaries (align mode)
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


def test_only_what_a_prefix_names_exactly_is_served(v: types.SimpleNamespace) -> None:
    """Cross-attention, a cache vLLM does not prefix-cache, one group mixing kinds …: refused at construction, on
    both sides, naming the group's spec; never saved and loaded as if its blocks were a prefix's KV."""
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


def test_vllms_groups_become_kvseal_groups_with_their_hit_rule(v: types.SimpleNamespace) -> None:
    """Each of vLLM's KV cache groups gets kvseal's hit rule (kind, block size, window or chunk), in vLLM's order;
    what kvseal refuses is refused naming the group; a Mamba state kept only at the end (prefix caching off) is
    refused naming its mode."""
    from vllm.v1.kv_cache_interface import MambaSpec

    from kvseal.core.layout import KvGroup

    kinds = _spec_kinds(v)
    kv_groups = v.compat.kv_groups
    expected = {
        "full": KvGroup("full", BLOCK),
        "mla": KvGroup("full", BLOCK),
        "sink": KvGroup("full", BLOCK),
        "sliding": KvGroup("sliding", BLOCK, 4 * BLOCK),
        "chunked": KvGroup("chunked", BLOCK, 8 * BLOCK),
        "uniform": KvGroup("full", BLOCK),
        "mamba": KvGroup("mamba", BLOCK),
    }
    gemma = [kinds["sliding"][0]] * 5 + [kinds["full"][0], kinds["mamba"][0]]
    config = _kv_cache_config([v.KVCacheGroupSpec([f"layers.{i}"], spec) for i, spec in enumerate(gemma)], v)
    assert kv_groups(config) == (expected["sliding"],) * 5 + (expected["full"], expected["mamba"])
    for kind, (spec, _) in kinds.items():
        config = _kv_cache_config(
            [v.KVCacheGroupSpec(["layers.0"], kinds["full"][0]), v.KVCacheGroupSpec(["x"], spec)], v
        )
        if kind in expected:
            assert kv_groups(config) == (KvGroup("full", BLOCK), expected[kind]), kind
            continue
        with pytest.raises(ValueError, match="^kvseal cannot serve this model's KV cache: group 1 is ") as refused:
            kv_groups(config)
        assert "1 layers (x)" in str(refused.value), kind
    f32 = v.torch.float32
    ended = MambaSpec(block_size=BLOCK, shapes=((4,),), dtypes=(f32,), mamba_cache_mode="none")
    with pytest.raises(ValueError, match="group 0 is MambaSpec with mamba_cache_mode='none', 1 layers"):
        kv_groups(_kv_cache_config([v.KVCacheGroupSpec(["m"], ended)], v))
    drafted = [v.KVCacheGroupSpec(["t"], kinds["sliding"][0]), v.KVCacheGroupSpec(["d"], kinds["full"][0], True)]
    assert v.compat.eagle_groups(_vllm_config(v), _kv_cache_config(drafted, v)) == {1}  # the draft's group
    assert v.compat.eagle_groups(_vllm_config(v), _kv_cache_config(drafted[:1], v)) == set()  # no drafter
    point = v.SlidingWindowSpec(block_size=BLOCK, dtype=f32, sliding_window=1, num_kv_heads=2, head_size=32)
    with pytest.raises(ValueError, match="group 0 is SlidingWindowSpec with a window of 1 token"):
        kv_groups(_kv_cache_config([v.KVCacheGroupSpec(["w"], point)], v))


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
    outage = v.outage.Outage("unix:/wedged.sock", clock=clock)
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


def test_only_no_answer_is_an_outage(v: types.SimpleNamespace) -> None:
    """The engine answering about this instance's state (workers not in yet, this worker unknown) is no outage."""
    clock = FakeClock()

    def after(call: str, error: Exception) -> tuple[bool, bool | None]:
        """(whether calls are paused afterwards, what the call answered)"""
        outage = v.outage.Outage("unix:/classify.sock", clock=clock)
        answer = getattr(outage, call)(*(("load", error) if call == "on_worker_error" else (error,)))
        return not outage.allows_call(), answer

    down = Unavailable("gone"), DeadlineExceeded("slow")
    for error in down:
        assert after("on_query_error", error) == (True, None)
        assert after("on_release_error", error) == (True, None)
        assert after("on_worker_error", error) == (True, False)
    for error in (FailedPrecondition("2 of 4 workers in"), NotFound("no such instance")):
        assert after("on_query_error", error) == (False, None)
    assert after("on_query_error", PermissionDenied("not this lane's user")) == (True, None)
    for error in (NotFound("lease"), InvalidArgument("lease"), FailedPrecondition("x")):
        assert after("on_release_error", error) == (False, None)  # the lease is gone either way
    for error in (NotFound("worker"), PermissionDenied("worker")):
        assert after("on_worker_error", error) == (False, True)  # register again
    assert after("on_worker_error", FailedPrecondition("2 of 4 workers in")) == (False, False)
    assert after("on_worker_error", InvalidArgument("bad")) == (True, False)


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


# ---------------------------------------------------------------- the extra config


def test_extra_config_is_one_frozen_config_and_errors_name_the_key(v: types.SimpleNamespace) -> None:
    config = v.compat.KVSealConfig.from_extra({})
    assert config == v.compat.KVSealConfig()
    assert (config.engine, config.mode, config.namespace, config.timeout_s) == (
        "127.0.0.1:50055",
        "read_write",
        None,
        5,
    )
    assert (config.pd_timeout_s, config.sync_load_bytes) == (30, 64 << 20)
    with pytest.raises(AttributeError):
        config.mode = "load_only"  # type: ignore[misc]
    full = v.compat.KVSealConfig.from_extra(
        {
            "kvseal.engine": "unix:/run/kvseal.sock",
            "kvseal.mode": "load_only",
            "kvseal.namespace": "m",
            "kvseal.token": "t",
            "kvseal.timeout_s": "2.5",
            "kvseal.engine_uid": "0",
            "kvseal.pd_timeout_s": 7,
            "kvseal.sync_load_bytes": 0,
            "kvseal.window_retention_tokens": 4096,
        }
    )
    assert full == v.compat.KVSealConfig("unix:/run/kvseal.sock", "load_only", "m", "t", 2.5, 0, 7.0, 0, 4096)
    assert v.compat.KVSealConfig.from_extra({"kvseal.namespace": ""}).namespace is None  # the model's identity
    for key, bad, message in (
        ("kvseal.mode", "read", "kvseal.mode must be one of ('read_write', 'save_only', 'load_only'), got 'read'"),
        ("kvseal.pd_timeout_s", -3, "kvseal.pd_timeout_s must be a positive number of seconds, got -3"),
        ("kvseal.sync_load_bytes", 1.5, "kvseal.sync_load_bytes must be a non-negative whole number of bytes, got 1.5"),
        (
            "kvseal.sync_load_bytes",
            True,
            "kvseal.sync_load_bytes must be a non-negative whole number of bytes, got True",
        ),
        (
            "kvseal.window_retention_tokens",
            -1,
            "kvseal.window_retention_tokens must be a non-negative whole number of tokens, got -1",
        ),
    ):
        with pytest.raises(ValueError) as refused:
            v.compat.KVSealConfig.from_extra({key: bad})
        assert str(refused.value) == message
        for role in (v.KVConnectorRole.SCHEDULER, v.KVConnectorRole.WORKER):
            with pytest.raises(ValueError, match=key):
                v.connector.KVSealConnector(_vllm_config(v, **{key: bad}), role, _one_group(v))


def test_an_unknown_kvseal_key_is_refused_naming_the_closest(v: types.SimpleNamespace) -> None:
    """A typo (`kvseal.engin`) would otherwise start vLLM on the default engine address without a word."""
    for role in (v.KVConnectorRole.SCHEDULER, v.KVConnectorRole.WORKER):
        with pytest.raises(ValueError) as refused:
            v.connector.KVSealConnector(_vllm_config(v, **{"kvseal.engin": "127.0.0.1:6000"}), role, _one_group(v))
        assert str(refused.value) == (
            "kv_connector_extra_config: unknown key 'kvseal.engin' (did you mean 'kvseal.engine'?)"
        )
    with pytest.raises(ValueError, match=r"unknown key 'kvseal.timout_s' \(did you mean 'kvseal.timeout_s'\?\)"):
        v.compat.KVSealConfig.from_extra({"kvseal.timout_s": 2})
    # nothing close: the message lists every key (the shared prefix does not make every key close)
    with pytest.raises(ValueError) as refused:
        v.compat.KVSealConfig.from_extra({"kvseal.xyzzy": 1})
    assert "unknown key 'kvseal.xyzzy' (the connector's keys: kvseal.engine, kvseal.mode," in str(refused.value)
    assert "kvseal.window_retention_tokens)" in str(refused.value)
    # keys of other connectors sharing the dict (no kvseal. prefix) are not kvseal's to judge
    assert v.compat.KVSealConfig.from_extra({"lmcache.chunk_size": 256}) == v.compat.KVSealConfig()


# ---------------------------------------------------------------- the facade: one side per role


def test_the_connector_delegates_to_the_side_of_its_role(v: types.SimpleNamespace) -> None:
    config = _vllm_config(v, **{"kvseal.namespace": "unit"})
    scheduler = v.connector.KVSealConnector(config, v.KVConnectorRole.SCHEDULER, _one_group(v))
    worker = v.connector.KVSealConnector(config, v.KVConnectorRole.WORKER, _one_group(v))
    try:
        with pytest.raises(RuntimeError, match="a worker-side call on the SCHEDULER role's connector"):
            scheduler.register_kv_caches({})
        with pytest.raises(RuntimeError, match="a scheduler-side call on the WORKER role's connector"):
            worker.request_finished(types.SimpleNamespace(request_id="r"), [])
        assert worker.get_finished(set()) == (None, None)
        assert worker.get_block_ids_with_load_errors() == set()
        assert config.kv_transfer_config.kv_load_failure_policy == "recompute"  # set by the scheduler side
    finally:
        scheduler.shutdown()
        worker.shutdown()


def test_names_stay_importable_from_the_connector_module(v: types.SimpleNamespace) -> None:
    import kvseal.vllm

    assert kvseal.vllm.KVSealConnector is v.connector.KVSealConnector
    for name in v.connector.__all__:
        assert getattr(v.connector, name) is not None, name


# ---------------------------------------------------------------- the scheduler side's books


class _FakeEngine:
    """EngineClient's Query and Release as the scheduler side uses them: the leading resident hashes, under a
    new lease when there is a hit; releases are recorded."""

    def __init__(self, resident: list[bytes]) -> None:
        self.resident = set(resident)
        self.leases = 0
        self.released: list[int] = []

    def query(self, instance_id: str, hashes: list[bytes], **kwargs: Any) -> Any:
        hits = next((i for i, h in enumerate(hashes) if h not in self.resident), len(hashes))
        lease_id = 0
        if hits:
            self.leases += 1
            lease_id = self.leases
        return pb.QueryResponse(hits=hits, lease_id=lease_id, namespace_final="ns")

    def release(self, instance_id: str, lease_id: int) -> None:
        self.released.append(lease_id)


def _step(new: Sequence[tuple[str, int, list[int], int]] = (), finished: Collection[str] = ()) -> Any:
    """A SchedulerOutput with (req_id, num_computed_tokens, block_ids, num_scheduled_tokens) new requests."""
    return types.SimpleNamespace(
        finished_req_ids=set(finished),
        scheduled_new_reqs=[
            types.SimpleNamespace(req_id=r, num_computed_tokens=c, block_ids=(ids,)) for r, c, ids, _ in new
        ],
        scheduled_cached_reqs=types.SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
        ),
        num_scheduled_tokens={r: n for r, _, _, n in new},
    )


def test_scheduler_side_claims_loads_saves_and_releases_what_it_does_not_use(v: types.SimpleNamespace) -> None:
    from vllm.v1.request import RequestStatus

    from kvseal.vllm.scheduler import SchedulerSide

    hashes = [bytes([n]) * 32 for n in range(5)]
    engine = _FakeEngine(hashes[:3])
    config = _vllm_config(v)
    config.cache_config.block_size = BLOCK
    side = SchedulerSide(
        config, _one_group(v), v.compat.KVSealConfig(), engine, v.outage.Outage("fake", clock=FakeClock())
    )

    def request(req_id: str) -> Any:
        return types.SimpleNamespace(
            request_id=req_id,
            block_hashes=hashes,
            num_tokens=5 * BLOCK + 1,
            num_prompt_tokens=5 * BLOCK + 1,
            kv_transfer_params=None,
            status=RequestStatus.FINISHED_STOPPED,
        )

    a = request("a")
    assert side.get_num_new_matched_tokens(a, 0) == (3 * BLOCK, False)  # 3 blocks: small, loaded synchronously
    assert side.get_num_new_matched_tokens(a, 0) == (3 * BLOCK, False)  # asked again (not allocated): a new claim
    assert engine.released == [1]
    blocks = [7, 8, 9, 10, 11, 12]
    side.update_state_after_alloc(a, types.SimpleNamespace(get_block_ids=lambda: (blocks,)), 3 * BLOCK)
    meta = side.build_connector_meta(_step([("a", 3 * BLOCK, blocks, 2 * BLOCK + 1)]))
    assert [(j.req_id, j.hashes, j.block_ids, j.lease_id, j.sync) for j in meta.loads] == [
        ("a", hashes[:3], [7, 8, 9], 2, True)
    ]
    # the blocks it computed, after the hit it names (the engine refreshes those, copies none it holds)
    assert (meta.save_hashes, meta.save_block_ids) == (hashes[:5], [7, 8, 9, 10, 11])
    assert meta.save_requests == [("a", 5)]
    # a worker whose load of "a" failed this step saves none of a's blocks, and the other requests' as planned
    meta.save_hashes += [b"x" * 32]
    meta.save_block_ids += [20]
    meta.save_requests += [("d", 1)]
    assert meta.saves_except({"a"}) == ([b"x" * 32], [20])
    assert meta.saves_except(set()) == (hashes[:5] + [b"x" * 32], [7, 8, 9, 10, 11, 20])
    assert side.build_connector_meta(_step()).loads == []  # handed over once
    assert side.request_finished(a) == (False, None)
    assert engine.released == [1]  # the load's lease is the worker's to end

    b = request("b")
    assert side.get_num_new_matched_tokens(b, BLOCK) == (2 * BLOCK, False)  # from vLLM's own hit on
    side.update_state_after_alloc(b, types.SimpleNamespace(get_block_ids=lambda: (blocks,)), 0)  # vLLM took none
    assert engine.released == [1, 3]
    c = request("c")
    assert side.get_num_new_matched_tokens(c, 0)[0] == 3 * BLOCK
    side.request_finished(c)  # finished (aborted) before its blocks were allocated: its lease ends
    assert engine.released == [1, 3, 4]
    assert side._requests.keys() == {"b"}
    side.build_connector_meta(_step(finished={"b"}))
    assert not side._requests


def test_a_worker_saves_nothing_of_a_request_whose_load_failed_in_that_step(v: types.SimpleNamespace) -> None:
    """Request "a" was claimed for a synchronous load of 3 blocks and its first save names them with its 2 new
    blocks; the engine copies only 1 (the next one was evicted meanwhile): vLLM recomputes a from there, and the
    step's save carries none of a's blocks (its new ones were computed over the missing ones), only b's."""
    from kvseal.vllm.metadata import KVSealConnectorMetadata, LoadJob
    from kvseal.vllm.worker import WorkerSide

    class Client:
        saves: list[tuple[list[bytes], list[int]]] = []

        def session_alive(self) -> bool:
            return True

        def load(self, key: Any, hashes: list[bytes], block_ids: list[int], lease_id: int) -> Any:
            return pb.LoadResponse(outcome=pb.LoadResponse.MISSING, loaded=1)

        def save(self, key: Any, hashes: list[bytes], block_ids: list[int]) -> Any:
            self.saves.append((hashes, block_ids))
            return pb.SaveResponse()

    config = _vllm_config(v, **{"kvseal.namespace": "unit"})
    client = Client()
    worker = WorkerSide(config, _one_group(v), v.compat.KVSealConfig(namespace="unit"), client, v.outage.Outage("fake"))  # type: ignore[arg-type]
    worker._registered = True
    a, b = [bytes([n]) * 32 for n in range(5)], [b"b" * 32]
    meta = KVSealConnectorMetadata(
        loads=[LoadJob("a", a[:3], [7, 8, 9], 1, True)],
        save_hashes=a + b,
        save_block_ids=[7, 8, 9, 10, 11, 20],
        save_requests=[("a", 5), ("b", 1)],
    )
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)
    assert worker.get_block_ids_with_load_errors() == {8, 9}
    assert client.saves == [(b, [20])]
    worker.start_load_kv(KVSealConnectorMetadata())  # the next step: a's later blocks are saved again
    worker.wait_for_save(KVSealConnectorMetadata(save_hashes=a[3:], save_block_ids=[10, 11], save_requests=[("a", 2)]))
    assert client.saves[1] == (a[3:], [10, 11])
