"""What the connector mirrors of vLLM, and what it accepts of it: the connector's extra config, parsed once into a
frozen `KVSealConfig`; the checks that refuse at construction what kvseal cannot serve (seeded block hashing,
KV that is not prefix-cacheable attention); and vLLM's own rules the connector follows
(its null block, the KV planes of a layer's tensor, the drafter's block of a prefix hit, how its KV cache groups
are stored), each naming the vLLM
version and code it mirrors.

Pure functions over vLLM's config objects: no engine, no I/O.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal, cast

from kvseal.core.layout import KvGroup
from kvseal.errors import did_you_mean, quote

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

Mode = Literal["read_write", "save_only", "load_only"]
MODES: tuple[Mode, ...] = ("read_write", "save_only", "load_only")
DEFAULT_ENGINE = "127.0.0.1:50055"
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_PD_TIMEOUT_S = 30.0
# A synchronous load saves a scheduler step (vLLM's own local-hit path pays none) but holds up the step of every
# other request while it copies; 64 MiB copies in ~5-9 ms on this machine class, about a decode step.
DEFAULT_SYNC_LOAD_BYTES = 64 << 20
NULL_BLOCK_ID = 0  # vLLM's null block (BlockPool.null_block, the first block id): holds nothing, is never written


# ---------------------------------------------------------------- kv_connector_extra_config


@dataclass(frozen=True, slots=True)
class KVSealConfig:
    """The connector's `kv_connector_extra_config`, validated. Every field is the key `kvseal.<field>`; build it
    with `from_extra`, which raises ValueError naming the key and the value it refuses, or a `kvseal.` key that is
    none of these (a typo would otherwise leave its default in place without a word)."""

    engine: str = DEFAULT_ENGINE  # gRPC target
    mode: Mode = "read_write"
    namespace: str | None = None  # None: the model's identity (kvseal.vllm.identity)
    token: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S  # deadline of every engine call
    engine_uid: int | None = None  # the engine's user, when it is neither root nor vLLM's
    pd_timeout_s: float = DEFAULT_PD_TIMEOUT_S  # how long a prefill holds its blocks for the decode instance
    sync_load_bytes: int = DEFAULT_SYNC_LOAD_BYTES  # loads up to this size per worker run synchronously
    window_retention_tokens: int = 0  # sliding/chunked blocks saved: those ending in a prompt's last N tokens (0: all)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> KVSealConfig:
        known = [f"kvseal.{field.name}" for field in fields(cls)]
        for key in extra:
            if isinstance(key, str) and key.startswith("kvseal.") and key not in known:
                hint = did_you_mean(key, known, "kvseal.") or f" (the connector's keys: {', '.join(known)})"
                raise ValueError(f"kv_connector_extra_config: unknown key {quote(key)}{hint}")
        mode = extra.get("kvseal.mode", "read_write")
        if mode not in MODES:
            raise ValueError(f"kvseal.mode must be one of {MODES}, got {mode!r}")
        return cls(
            engine=extra.get("kvseal.engine", DEFAULT_ENGINE),
            mode=cast(Mode, mode),
            namespace=extra.get("kvseal.namespace") or None,
            token=extra.get("kvseal.token"),
            timeout_s=_seconds(extra, "kvseal.timeout_s", DEFAULT_TIMEOUT_S),
            engine_uid=_engine_uid(extra),
            pd_timeout_s=_seconds(extra, "kvseal.pd_timeout_s", DEFAULT_PD_TIMEOUT_S),
            sync_load_bytes=_whole(extra, "kvseal.sync_load_bytes", DEFAULT_SYNC_LOAD_BYTES, "bytes"),
            window_retention_tokens=_whole(extra, "kvseal.window_retention_tokens", 0, "tokens"),
        )


def _seconds(extra: Mapping[str, Any], key: str, default: float) -> float:
    """A positive, finite number of seconds from the extra config, or ValueError naming the key."""
    value = extra.get(key, default)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{key} must be a positive number of seconds, got {value!r}")
    return seconds


def _whole(extra: Mapping[str, Any], key: str, default: int, unit: str) -> int:
    """A non-negative whole number (of `unit`) from the extra config, or ValueError naming the key."""
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} must be a non-negative whole number of {unit}, got {value!r}")
    return value


def _engine_uid(extra: Mapping[str, Any]) -> int | None:
    """`kvseal.engine_uid`: the user the engine runs as (a uid or a user name) when neither root nor vLLM's user."""
    value = extra.get("kvseal.engine_uid")
    if value is None:
        return None
    if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
        return int(value)
    try:
        return pwd.getpwnam(str(value)).pw_uid
    except KeyError:
        raise ValueError(f"kvseal.engine_uid must be a uid or a user name of this machine, got {value!r}") from None


def instance_id_of(vllm_config: VllmConfig) -> str:
    """The engine's name of this vLLM instance (its scheduler and all its workers): from vLLM's engine_id."""
    transfer = vllm_config.kv_transfer_config
    assert transfer is not None  # KVConnectorBase_V1 refuses a config without one
    return f"vllm-{transfer.engine_id}"


# ---------------------------------------------------------------- what kvseal refuses at construction


def check_hashing_is_deterministic(vllm_config: VllmConfig) -> None:
    """Two instances share blocks only if they hash tokens the same way (docs/design.md §6)."""
    algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
    if os.environ.get("PYTHONHASHSEED") is None and not algo.startswith("sha256"):
        raise ValueError(
            f"kvseal: prefix_caching_hash_algo={algo!r} without PYTHONHASHSEED seeds block hashes randomly in every "
            "process, so no two vLLM instances could ever share a cached block. Set PYTHONHASHSEED (the same value "
            "for every instance, e.g. PYTHONHASHSEED=0) or use --prefix-caching-hash-algo sha256."
        )


def check_some_kv_cache(kv_cache_config: KVCacheConfig) -> None:
    """An attention-free model has no KV cache group: nothing to share."""
    if not kv_cache_config.kv_cache_groups:
        raise ValueError(
            "kvseal shares KV cache blocks; this model has none (it is attention-free). Run it without kvseal (drop "
            "--kv-transfer-config)."
        )


@dataclass(frozen=True, slots=True)
class StoredGroups:
    """How an instance's KV cache groups are registered with the engine. vLLM gives each of its groups a block table;
    groups with one hit rule (the same KvGroup: e.g. Gemma 3's several sliding-window groups) are one kvseal group,
    whose pages hold all their layers, each layer addressed through its own vLLM group's block ids (its `table`).

    `hybrid`: anything but one vLLM group of full attention at the hash's block size. Such an instance registers its
    groups (layout format 2 unless they are one full-attention group), queries the hybrid hit (the engine applies
    the drafter's drop) and saves and loads per group; the other keeps format 1 and the prefix path, unchanged."""

    hash_block_size: int  # tokens per entry of Request.block_hashes: the registration's block_size
    groups: tuple[KvGroup, ...]  # kvseal's, in order of first appearance among vLLM's
    places: tuple[tuple[int, int], ...]  # per vLLM group: (kvseal group, table)
    eagle: tuple[int, ...]  # kvseal groups a drafter reads

    @property
    def hybrid(self) -> bool:
        return len(self.places) > 1 or self.groups != (KvGroup("full", self.hash_block_size),)

    def tables(self, group: int) -> list[int]:
        """The vLLM groups merged into kvseal group `group`, in table order."""
        return [i for i, (g, _) in enumerate(self.places) if g == group]


def stored_groups(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> StoredGroups:
    """vLLM's groups (kv_groups) merged by hit rule; the hash block size as vLLM 0.32 resolves it
    (`kv_cache_utils.resolve_kv_cache_block_sizes`: the GCD of the groups' block sizes with several)."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    _, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    groups: list[KvGroup] = []
    places = []
    for kind in kv_groups(kv_cache_config):
        if kind not in groups:
            groups.append(kind)
        g = groups.index(kind)
        places.append((g, sum(1 for other, _ in places if other == g)))
    eagle = sorted({places[i][0] for i in eagle_groups(vllm_config, kv_cache_config)})
    return StoredGroups(hash_block_size, tuple(groups), tuple(places), tuple(eagle))


def check_attention_kv_cache(kv_cache_config: KVCacheConfig) -> None:
    """kvseal serves the KV cache groups whose blocks a prefix's hashes name exactly: attention KV (full, MLA, sinks,
    sliding window, chunked local: a block holds its tokens' keys and values) and Mamba-like state kept at block
    boundaries (align mode: a block holds the state after its last token). Refuses at construction, naming the
    group, its spec and its layers, everything `kv_groups` refuses."""
    kv_groups(kv_cache_config)


def kv_groups(kv_cache_config: KVCacheConfig) -> tuple[KvGroup, ...]:
    """kvseal's KvGroup (the hit rule: kind, block size, window or chunk) of each of vLLM's KV cache groups, in
    vLLM's order; mirrored from vLLM 0.32's specs (`v1/kv_cache_interface.py`) and the manager each one gets
    (`single_type_kv_cache_manager.spec_manager_map`). Refuses, with a ValueError naming the group, its spec and
    its layers, what kvseal cannot serve exactly:
    - specs vLLM itself does not prefix-cache (`prefix_cacheable` False: circular buffers, bounded-replay MLA
      windows), cross-attention (its KV depends on the encoder input, not on the hashed tokens), encoder-only,
      hidden-state caches, HiSparse pools;
    - a Mamba-like state whose boundary states vLLM does not keep (`mamba_cache_mode` other than "align": prefix
      caching off), so no state at a block boundary exists to store;
    - one group whose specs mix kinds, and a window under 2 tokens."""
    return tuple(
        _kv_group(group.kv_cache_spec, i, group.layer_names) for i, group in enumerate(kv_cache_config.kv_cache_groups)
    )


def _kv_group(spec: Any, index: int, layer_names: list[str]) -> KvGroup:
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        HiddenStateCacheSpec,
        MambaSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    name = type(spec).__name__
    if isinstance(spec, UniformTypeKVCacheSpecs):
        inner = {_kv_group(s, index, layer_names) for s in spec.kv_cache_specs.values()}
        if len(inner) != 1:
            kinds = sorted({type(s).__name__ for s in spec.kv_cache_specs.values()})
            raise _cannot_serve(index, f"{name} mixing {' and '.join(kinds)}", layer_names)
        return inner.pop()
    if not spec.prefix_cacheable:
        raise _cannot_serve(index, f"{name} (not prefix-cacheable)", layer_names)
    if isinstance(spec, FullAttentionSpec) and not isinstance(spec, HiddenStateCacheSpec):
        return KvGroup("full", spec.block_size)
    if isinstance(spec, SlidingWindowSpec) and spec.sliding_window >= 2:
        return KvGroup("sliding", spec.block_size, spec.sliding_window)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return KvGroup("chunked", spec.block_size, spec.attention_chunk_size)
    if isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align":
        return KvGroup("mamba", spec.block_size)
    if isinstance(spec, MambaSpec):
        raise _cannot_serve(index, f"{name} with mamba_cache_mode={spec.mamba_cache_mode!r}", layer_names)
    if isinstance(spec, SlidingWindowSpec):
        raise _cannot_serve(index, f"{name} with a window of {spec.sliding_window} token", layer_names)
    raise _cannot_serve(index, name, layer_names)


def _cannot_serve(index: int, what: str, layer_names: list[str]) -> ValueError:
    return ValueError(
        f"kvseal cannot serve this model's KV cache: group {index} is {what}, {len(layer_names)} layers "
        f"({_names(layer_names)}). kvseal stores attention KV as prefix blocks (full, MLA, sliding window, "
        "chunked local); a Mamba / linear-attention state or a cache vLLM does not prefix-cache loaded as such "
        "blocks would give wrong outputs, so kvseal refuses it. Run this model without kvseal (drop "
        "--kv-transfer-config); vLLM's own prefix cache (--enable-prefix-caching) still serves it."
    )


def _names(names: list[str], shown: int = 2) -> str:
    more = f", … {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


# ---------------------------------------------------------------- vLLM's rules, mirrored


def without_null_blocks(hashes: list[bytes], block_ids: list[int]) -> tuple[list[bytes], list[int]]:
    """The (hash, block id) pairs whose block is a real one: vLLM's null block (id 0) stands where a sliding window
    or a local chunk needs nothing, and must never be written (loads) nor read as a block's KV (saves)."""
    if NULL_BLOCK_ID not in block_ids:
        return hashes, block_ids
    kept = [(h, b) for h, b in zip(hashes, block_ids, strict=True) if b != NULL_BLOCK_ID]
    return [h for h, _ in kept], [b for _, b in kept]


def splits_kv(tensor: torch.Tensor, num_blocks: int | None) -> bool:
    """Whether a layer's KV is two planes, [2, num_blocks, ...] (K then V: vLLM's FlashAttention layout on GPU),
    rather than one page per block, [num_blocks, ...] (vLLM's CPU and MLA layouts): read off the tensor vLLM
    allocated, whose block dimension has the engine's num_blocks."""
    if tensor.dim() >= 2 and tensor.shape[0] == 2 and tensor.shape[1] == num_blocks and num_blocks != 2:
        return True
    return False


def mamba_tag(spec: Any) -> str:
    """The layout tag of a Mamba-like layer (MambaSpec, vLLM 0.32: `shapes`, `dtypes`, `mamba_type`), '' for any
    other spec. vLLM hands the connector such a layer as one int8 tensor [num_blocks, 1, 1, state bytes] whose block
    b holds every state after block b's tokens (conv, then ssm; the rest of the page is padding no kernel reads)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    if not isinstance(spec, MambaSpec):
        return ""
    shapes = ",".join("x".join(map(str, shape)) for shape in spec.shapes)
    dtypes = ",".join(str(dtype).removeprefix("torch.") for dtype in spec.dtypes)
    kind = getattr(spec.mamba_type, "value", spec.mamba_type)
    return f"mamba/{kind}/{shapes}/{dtypes}"


def eagle_groups(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> frozenset[int]:
    """The KV cache groups whose prefix hit vLLM ends one block early for a drafter, mirrored from vLLM 0.32: the
    scheduler builds its KVCacheManager with `use_eagle=speculative_config.use_eagle_block_drop()` (method in
    eagle, eagle3, mtp, dflash, dspark, and `disable_eagle_block_drop` off); `KVCacheCoordinator` takes the groups
    marked `is_eagle_group`, or every group when use_eagle is set and none is marked. The drafter needs that block
    recomputed: for its hidden states, and because its KV there depends on tokens past the block (the hit rule:
    kvseal.core.hybrid)."""
    spec = vllm_config.speculative_config
    use_eagle = spec is not None and spec.use_eagle_block_drop()
    groups = kv_cache_config.kv_cache_groups
    marked = frozenset(i for i, group in enumerate(groups) if group.is_eagle_group)
    return marked or (frozenset(range(len(groups))) if use_eagle else frozenset())


def drops_last_hit_block(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> bool:
    """Whether vLLM drops the last block of its own prefix-cache hit with one KV cache group:
    `UnitaryKVCacheCoordinator` passes `drop_eagle_block = 0 in eagle_group_ids` to
    `FullAttentionManager.find_longest_cache_hit`, which then takes one block (alignment = block size with one
    group) off a non-empty hit."""
    return 0 in eagle_groups(vllm_config, kv_cache_config)


def claimable_blocks(hits: int, drop_last_block: bool) -> int:
    """Blocks of the engine's `hits` (leading resident blocks right after vLLM's own hit) the connector claims.

    vLLM has already taken the drafter's block off its own hit, and the engine's hit continues from there, so the
    last block of the whole hit is the engine's last one: dropping it gives exactly vLLM's rule applied to the
    union of both caches."""
    return max(hits - 1, 0) if drop_last_block else hits
