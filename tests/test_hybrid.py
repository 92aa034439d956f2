"""The hybrid hit rule (kvseal.core.hybrid) against its definition, by brute force: the largest aligned prefix
whose needed blocks, in every group, are all present; and the blocks it leases are exactly the needed ones."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvseal.core.hybrid import hybrid_hit, needed_blocks
from kvseal.core.layout import KvGroup


def read(group: KvGroup, tokens: int, eagle: bool) -> list[int]:
    """The blocks a hit of `tokens` reads: the needed ones, and for an EAGLE group (not Mamba) the next one."""
    blocks = list(needed_blocks(group, tokens))
    return blocks + [tokens // group.block_size] if eagle and group.kind != "mamba" and tokens else blocks


def limit(group: KvGroup, present: list[bool], groups: int, max_tokens: int) -> int:
    """The blocks a hit may read: the prompt's, but only those within the limit with one group (as vLLM)."""
    return min(len(present), max_tokens // group.block_size) if groups == 1 else len(present)


def brute_force(groups: list[KvGroup], present: list[list[bool]], max_tokens: int, eagle: set[int]) -> int:
    align = math.lcm(*(g.block_size for g in groups))
    eagle = {n for n, g in enumerate(groups) if any(g == groups[e] for e in eagle)}  # alike groups drop together
    for tokens in range(max_tokens // align * align, -1, -align):
        if all(
            all(i < limit(g, p, len(groups), max_tokens) and p[i] for i in read(g, tokens, n in eagle))
            for n, (g, p) in enumerate(zip(groups, present, strict=True))
        ):
            return tokens
    raise AssertionError("0 tokens always hit")


@st.composite
def group(draw: st.DrawFn) -> KvGroup:
    kind = draw(st.sampled_from(("full", "sliding", "chunked", "mamba")))
    block = draw(st.sampled_from((1, 2, 4, 16)))
    span = draw(st.integers(2 if kind == "sliding" else 1, 80)) if kind in ("sliding", "chunked") else 0
    return KvGroup(kind, block, span)


# groups, per group the blocks stored, the prompt's tokens, the EAGLE groups
Case = tuple[list[KvGroup], list[list[bool]], int, set[int]]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    groups = draw(st.lists(group(), min_size=1, max_size=4))
    max_tokens = draw(st.integers(0, 200))
    present = [draw(st.lists(st.booleans(), max_size=max_tokens // g.block_size + 2)) for g in groups]
    eagle = {i for i, g in enumerate(groups) if g.kind != "chunked" and draw(st.booleans())}
    return groups, present, max_tokens, eagle


@settings(max_examples=400, deadline=None)
@given(case=cases())
def test_the_hit_is_the_largest_prefix_every_group_can_serve(case: Case) -> None:
    groups, present, max_tokens, eagle = case
    hit = hybrid_hit(groups, present, max_tokens, eagle)
    assert hit == brute_force(groups, present, max_tokens, eagle)
    for n, (g, p) in enumerate(zip(groups, present, strict=True)):
        assert hit % g.block_size == 0
        assert all(p[i] for i in read(g, hit, n in eagle))  # what the hit reads is stored


@settings(max_examples=200, deadline=None)
@given(case=cases())
def test_with_every_block_stored_the_hit_is_the_aligned_prompt(case: Case) -> None:
    groups, _, max_tokens, _ = case
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


def test_eagle_drops_the_last_block_of_attention_but_not_of_mamba_state() -> None:
    full, window, mamba = KvGroup("full", 16), KvGroup("sliding", 16, 33), KvGroup("mamba", 16)
    assert hybrid_hit([full], [[True] * 10], 160, eagle={0}) == 144
    assert hybrid_hit([full, mamba], [[True] * 10, [True] * 10], 160, eagle={0, 1}) == 144
    assert hybrid_hit([mamba], [[False] * 9 + [True]], 160, eagle={0}) == 160
    assert hybrid_hit([window], [[False] * 7 + [True] * 3], 160, eagle={0}) == 144  # the window's 2 blocks + 1
    assert hybrid_hit([window], [[False] * 8 + [True] * 2], 160, eagle={0}) == 0
    with pytest.raises(ValueError, match="EAGLE with chunked"):
        hybrid_hit([KvGroup("chunked", 16, 64)], [[True]], 16, eagle={0})


def test_groups_and_presence_must_match() -> None:
    with pytest.raises(ValueError, match="2 groups but 1 presence lists"):
        hybrid_hit([KvGroup("full", 16), KvGroup("mamba", 16)], [[True]], 16)
