"""The hit of a prompt prefix on a hybrid model: how many tokens can be served from stored blocks when the model's
layers fall into KV cache groups hit by different rules (kvseal.core.layout.KvGroup). Pure: no I/O.

For a prefix of L tokens, a group with blocks of b tokens needs (j = L / b):

    full           every block before L:                blocks [0, j)
    sliding(w)     the blocks the window still reads:   blocks [j - ceil((w - 1) / b), j), from 0 at least
    chunked(c)     the blocks of the chunk holding L:   blocks [floor(L / c) * c // b, j)
    mamba          the state after L tokens:            block j - 1 (nothing for L = 0)

The hit is the largest L, at most the prompt's, that is a multiple of every group's block size and whose needed
blocks are all present; the blocks to lease are exactly the needed ones (those vLLM leaves null it never reads).

EAGLE (and MTP) drafting recomputes the last block of a hit to get its hidden states, so an EAGLE group serves L
only when the block after L (index L / b) is present too: vLLM finds the hit one block further and drops that
block. That block may lie past the hit's limit (the prompt's last token, never served) but within the prompt's full
blocks, except with one group, where vLLM looks no further than the limit. A Mamba group never drops (its state at
L is what the drafter continues from), and vLLM supports no EAGLE with chunked attention.

How: each group on its own answers "the largest aligned L' <= L I can serve" (from the run of present blocks
ending at each block: O(1) per candidate, O(blocks) in all), and the smallest answer becomes the new L until every
group agrees. L never drops below the true hit (every group can serve it), and stops at a value every group
serves: the hit. Each round lowers L, so it ends.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

from kvseal.core.layout import KvGroup


def needed_blocks(group: KvGroup, tokens: int) -> range:
    """The block indices of `group` that a prefix of `tokens` tokens reads (a multiple of group.block_size)."""
    b = group.block_size
    j = tokens // b
    if group.kind == "full":
        return range(0, j)
    if group.kind == "sliding":
        return range(max(0, j - math.ceil((group.span - 1) / b)), j)
    if group.kind == "chunked":
        return range(min(j, tokens // group.span * group.span // b), j)
    if group.kind == "mamba":
        return range(j - 1, j) if j else range(0)
    raise ValueError(f"unknown group kind {group.kind!r}")


def judged_blocks(groups: Sequence[KvGroup], group: int, tokens: int, eagle: Collection[int], blocks: int) -> range:
    """The blocks of groups[group] a hit of `tokens` is judged on (of the prompt's `blocks` full blocks): the
    needed ones, and for a group an EAGLE drafter reads, the block after them (see hybrid_hit)."""
    needed = needed_blocks(groups[group], tokens)
    extra = _eagle_blocks(groups[group], groups[group] in {groups[i] for i in eagle})
    return range(needed.start, min(blocks, needed.stop + extra))


def hybrid_hit(
    groups: Sequence[KvGroup],
    present: Sequence[Sequence[bool]],
    max_tokens: int,
    eagle: Collection[int] = (),
) -> int:
    """The largest prefix (tokens) every group can serve from its `present` blocks (present[g][i]: block i of
    group g is stored, for each full block of the prompt), at most `max_tokens`, aligned to every group's block
    size. `eagle`: the indices of the groups an EAGLE drafter reads (each, and every group alike, then also needs
    the block after the hit)."""
    if len(groups) != len(present):
        raise ValueError(f"{len(groups)} groups but {len(present)} presence lists")
    drafted = {groups[i] for i in eagle}  # vLLM looks groups with one spec up together: the drop covers them all
    extra = [_eagle_blocks(g, g in drafted) for g in groups]
    align = math.lcm(*(g.block_size for g in groups)) if groups else 1
    if len(groups) == 1:  # vLLM's one-group manager looks no further than the limit, even for EAGLE's block
        present = [present[0][: max_tokens // groups[0].block_size]]
    runs = [_runs(p) for p in present]
    tokens = max_tokens // align * align
    while True:
        lowest = min(
            (_largest(g, r, tokens, align, x) for g, r, x in zip(groups, runs, extra, strict=True)), default=tokens
        )
        if lowest == tokens:
            return tokens
        tokens = lowest


def _eagle_blocks(group: KvGroup, eagle: bool) -> int:
    """How many blocks past a hit `group` must hold: one for an EAGLE group, but a Mamba state never drops."""
    if eagle and group.kind == "chunked":
        raise ValueError("EAGLE with chunked local attention is not supported (vLLM refuses it too)")
    return 1 if eagle and group.kind != "mamba" else 0


def _runs(present: Sequence[bool]) -> list[int]:
    """run[i]: how many present blocks end at block i (0 when block i is missing)."""
    out = []
    n = 0
    for stored in present:
        n = n + 1 if stored else 0
        out.append(n)
    return out


def _largest(group: KvGroup, run: list[int], tokens: int, align: int, extra: int) -> int:
    """The largest multiple of `align`, at most `tokens`, whose needed blocks of `group` (and `extra` blocks
    after them) are all present; `run` ends at the prompt's limit."""
    b = group.block_size
    while tokens > 0:
        needed = needed_blocks(group, tokens)
        needed = range(needed.start, needed.stop + extra)
        last = needed.stop - 1
        if not needed or (last < len(run) and run[last] >= len(needed)):
            return tokens
        if group.kind == "full":  # a missing block bounds every longer prefix: jump below it
            missing = len(run) if last >= len(run) else last - run[last]
            tokens = max(0, missing - extra) * b // align * align
        else:
            tokens -= align
    return 0
