"""The hybrid hit rule (kvseal.core.hybrid) against vLLM's own hybrid KV cache manager, without a model run: the
same blocks stored in vLLM's block pool and described to kvseal, both must find the same hit, and the blocks
kvseal would lease must be exactly the non-null block ids vLLM hands each group for that hit.

vLLM's side is its real coordinator (`get_kv_cache_coordinator`: the unitary one for one group, the hybrid one's
fixed point for several) over a real `BlockPool`, with full attention, sliding window, chunked local attention and
Mamba (align mode) specs, EAGLE groups flagged as vLLM flags them, and groups of two block sizes (where vLLM
allows them: no chunked group, and no Mamba group, which then turns sub-block hits on). Chunks are whole blocks, as
every model vLLM runs has them."""

from __future__ import annotations

import math
import warnings

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvseal.core.hybrid import hybrid_hit, needed_blocks
from kvseal.core.layout import KvGroup

with warnings.catch_warnings():  # vLLM's import-time deprecation warnings (pytest makes warnings errors)
    warnings.simplefilter("ignore")
    import torch
    from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

MAX_BLOCKS = 24


def vllm_spec(group: KvGroup) -> KVCacheSpec:
    attention = {"block_size": group.block_size, "num_kv_heads": 1, "head_size": 32, "dtype": torch.float32}
    if group.kind == "full":
        return FullAttentionSpec(**attention)
    if group.kind == "sliding":
        return SlidingWindowSpec(**attention, sliding_window=group.span)
    if group.kind == "chunked":
        return ChunkedLocalAttentionSpec(**attention, attention_chunk_size=group.span)
    return MambaSpec(block_size=group.block_size, shapes=((4,),), dtypes=(torch.float32,), mamba_cache_mode="align")


def vllm_hit(
    groups: list[KvGroup], present: list[list[bool]], prompt: int, eagle: set[int]
) -> tuple[int, list[list[int]]]:
    """vLLM's hit and, per group, the block indices it hands a non-null block for that hit, for a prompt of
    `prompt` tokens (present[g]: one flag per full block of group g; the hit is at most prompt - 1, as the
    scheduler asks). Block hashes are at the gcd of the groups' block sizes, and a larger block is found by the
    hash at its end, as vLLM hashes and looks them up."""
    sizes = [g.block_size for g in groups]
    hash_block, scheduler_block = math.gcd(*sizes), math.lcm(*sizes)
    config = KVCacheConfig(
        num_blocks=len(groups) * MAX_BLOCKS + 2,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"layers.{i}"], vllm_spec(g), is_eagle_group=i in eagle) for i, g in enumerate(groups)
        ],
    )
    coordinator = get_kv_cache_coordinator(
        config,
        max_model_len=MAX_BLOCKS * scheduler_block,
        max_in_flight_tokens=MAX_BLOCKS * scheduler_block,
        use_eagle=bool(eagle),
        enable_caching=True,
        enable_kv_cache_events=False,
        dcp_world_size=1,
        pcp_world_size=1,
        scheduler_block_size=scheduler_block,
        hash_block_size=hash_block,
    )
    pool = coordinator.block_pool
    hashes = [i.to_bytes(8, "big") for i in range(prompt // hash_block)]
    index_of: dict[int, int] = {}  # vLLM block id -> the block index it was cached for
    for g, stored in enumerate(present):
        for i, here in enumerate(stored):
            if here:
                (block,) = pool.get_new_blocks(1)
                end = (i + 1) * groups[g].block_size // hash_block - 1  # the hash at the block's end
                pool.cached_block_hash_to_block.insert(make_block_hash_with_group_id(hashes[end], g), block)
                index_of[block.block_id] = i
    blocks, hit, _ = coordinator.find_longest_cache_hit(hashes, prompt - 1)
    leased = []
    for group, group_blocks in zip(groups, blocks, strict=True):
        ids = [(i, b.block_id) for i, b in enumerate(group_blocks[: hit // group.block_size]) if not b.is_null]
        assert all(index_of[block_id] == i for i, block_id in ids)  # each block sits at the index it was cached for
        leased.append([i for i, _ in ids])
    return hit, leased


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[KvGroup], list[list[bool]], int, set[int]]:
    block = draw(st.sampled_from((16, 32)))
    kinds = draw(st.lists(st.sampled_from(("full", "sliding", "chunked", "mamba")), min_size=1, max_size=3))
    # groups of different block sizes (vLLM: chunked needs one size, Mamba then enables sub-block hits: not here)
    mixed = not {"chunked", "mamba"} & set(kinds) and draw(st.booleans())
    groups = []
    for kind in kinds:
        size = draw(st.sampled_from((block, 2 * block))) if mixed else block
        span = {"sliding": draw(st.integers(2, 5 * size)), "chunked": size * draw(st.integers(1, 4))}.get(kind, 0)
        groups.append(KvGroup(kind, size, span))
    prompt = draw(st.integers(1, MAX_BLOCKS * block))  # tokens; the hit is at most prompt - 1, as in vLLM
    dense = draw(st.floats(0.3, 1.0))  # mostly stored, so that hits are long and the rules meet
    present = [[draw(st.floats(0, 1)) < dense for _ in range(prompt // g.block_size)] for g in groups]
    eagle: set[int] = set()
    if "chunked" not in kinds and draw(st.booleans()):
        eagle = {i for i in range(len(groups)) if draw(st.booleans())} or set(range(len(groups)))
    return groups, present, prompt, eagle


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_kvseal_finds_vllms_hit_and_leases_exactly_the_blocks_vllm_reads(
    case: tuple[list[KvGroup], list[list[bool]], int, set[int]],
) -> None:
    groups, present, prompt, eagle = case
    hit, leased = vllm_hit(groups, present, prompt, eagle)
    ours = hybrid_hit(groups, present, prompt - 1, eagle)
    if len({groups[i] for i in eagle}) > 1 and ours < hit:
        # vLLM 0.32's coordinator checks a drafted group's extra block once per candidate length and keeps it
        # "verified" when another drafted group (one that cannot drop: Mamba) lowers the length, so it may accept a
        # length whose drafted block after it is missing; kvseal asks for that block at the final length too: a
        # shorter hit, never one vLLM would not take
        assert hybrid_hit(groups, present, hit, ()) >= hit  # without the drafter both agree the blocks are there
        return
    assert ours == hit
    assert leased == [list(needed_blocks(g, hit)) for g in groups]


def test_gemma_like_window_and_full_and_a_mid_prompt_window_hit() -> None:
    """Gemma 3's shape (a window and full attention) and Nemotron-H's (Mamba and full), worked by hand: vLLM and
    kvseal agree on a window that lost its early blocks and on a Mamba state stored only at block 7."""
    full, window, mamba = KvGroup("full", 16), KvGroup("sliding", 16, 40), KvGroup("mamba", 16)
    everything = [True] * 10
    late = [False] * 5 + [True] * 4 + [False]
    assert vllm_hit([full, window], [everything, late], 160, set()) == (144, [list(range(9)), [6, 7, 8]])
    assert hybrid_hit([full, window], [everything, late], 159) == 144
    state_at_8 = [False] * 7 + [True] + [False] * 2
    assert vllm_hit([full, mamba], [everything, state_at_8], 160, set()) == (128, [list(range(8)), [7]])
    assert hybrid_hit([full, mamba], [everything, state_at_8], 159) == 128


def test_a_drafted_window_is_checked_again_at_the_length_a_drafted_mamba_group_lowers_it_to() -> None:
    """vLLM 0.32 checks a drafted group's block after the hit once per candidate length: here the window is checked
    at 192 (block 6 there), then the drafted Mamba group lowers the hit to 128 and vLLM keeps the window "verified",
    though its block after 128 (block 4) is missing. kvseal asks for it at the final length: 96."""
    full, window, mamba = KvGroup("full", 32), KvGroup("sliding", 32, 2), KvGroup("mamba", 32)
    present = [[True] * 7, [True] * 4 + [False] + [True] * 2, [True] * 4 + [False, False, True]]
    assert vllm_hit([full, window, mamba], present, 224, {1, 2})[0] == 128
    assert hybrid_hit([full, window, mamba], present, 223, {1, 2}) == 96
