"""The hybrid hit rule (kvseal.core.hybrid) against its definition, by brute force: the largest aligned prefix
whose needed blocks, in every group, are all present; and the blocks it leases are exactly the needed ones."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvseal.core.hybrid import hybrid_hit, needed_blocks
from kvseal.core.layout import KvGroup


def brute_force(groups: list[KvGroup], present: list[list[bool]], max_tokens: int) -> int:
    align = math.lcm(*(g.block_size for g in groups))
    for tokens in range(max_tokens // align * align, -1, -align):
        if all(
            all(i < len(p) and p[i] for i in needed_blocks(g, tokens)) for g, p in zip(groups, present, strict=True)
        ):
            return tokens
    raise AssertionError("0 tokens always hit")


@st.composite
def group(draw: st.DrawFn) -> KvGroup:
    kind = draw(st.sampled_from(("full", "sliding", "chunked", "mamba")))
    block = draw(st.sampled_from((1, 2, 4, 16)))
    span = draw(st.integers(1, 80)) if kind in ("sliding", "chunked") else 0
    return KvGroup(kind, block, span)


Case = tuple[list[KvGroup], list[list[bool]], int]  # groups, per group the blocks stored, the prompt's tokens


@st.composite
def cases(draw: st.DrawFn) -> Case:
    groups = draw(st.lists(group(), min_size=1, max_size=4))
    max_tokens = draw(st.integers(0, 200))
    present = [draw(st.lists(st.booleans(), max_size=max_tokens // g.block_size + 2)) for g in groups]
    return groups, present, max_tokens


@settings(max_examples=400, deadline=None)
@given(case=cases())
def test_the_hit_is_the_largest_prefix_every_group_can_serve(case: Case) -> None:
    groups, present, max_tokens = case
    hit = hybrid_hit(groups, present, max_tokens)
    assert hit == brute_force(groups, present, max_tokens)
    for g, p in zip(groups, present, strict=True):
        assert hit % g.block_size == 0
        assert all(p[i] for i in needed_blocks(g, hit))  # what the hit leases is stored


@settings(max_examples=200, deadline=None)
@given(case=cases())
def test_with_every_block_stored_the_hit_is_the_aligned_prompt(
    case: tuple[list[KvGroup], list[list[bool]], int],
) -> None:
    groups, _, max_tokens = case
    full = [[True] * (max_tokens // g.block_size) for g in groups]
    align = math.lcm(*(g.block_size for g in groups))
    assert hybrid_hit(groups, full, max_tokens) == max_tokens // align * align


def test_a_window_needs_only_its_last_blocks_and_mamba_only_the_last_state() -> None:
    window, full, mamba = KvGroup("sliding", 16, 33), KvGroup("full", 16), KvGroup("mamba", 16)
    assert list(needed_blocks(window, 160)) == [8, 9]  # ceil((33 - 1) / 16) = 2 blocks before token 160
    assert list(needed_blocks(mamba, 160)) == [9] and list(needed_blocks(mamba, 0)) == []
    assert list(needed_blocks(KvGroup("chunked", 16, 64), 160)) == [8, 9]  # the chunk [128, 192) holds token 160
    # a mid-prompt prefix: the window layers lost blocks 0-6 (evicted), the full layers kept everything
    sliding_blocks = [False] * 7 + [True] * 3
    assert hybrid_hit([window, full], [sliding_blocks, [True] * 10], 160) == 160
    assert hybrid_hit([full, mamba], [[True] * 10, [False] * 9 + [True]], 160) == 160
    assert hybrid_hit([full, mamba], [[True] * 10, [True] * 5 + [False] * 5], 160) == 80  # the state at 80 tokens


def test_groups_and_presence_must_match() -> None:
    with pytest.raises(ValueError, match="2 groups but 1 presence lists"):
        hybrid_hit([KvGroup("full", 16), KvGroup("mamba", 16)], [[True]], 16)
