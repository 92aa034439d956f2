"""KVSealConnector: vLLM's KVConnectorBase_V1 backed by a kvseal engine.

    --kv-transfer-config '{"kv_connector":"KVSealConnector","kv_connector_module_path":"kvseal.vllm",
                           "kv_role":"kv_both","kv_connector_extra_config":{"kvseal.engine":"127.0.0.1:50055"}}'

Extra config: `kvseal.engine` (gRPC target, default 127.0.0.1:50055), `kvseal.namespace` (default: the model's
identity, kvseal.vllm.identity), `kvseal.mode` (read_write | save_only | load_only), `kvseal.token`,
`kvseal.timeout_s` (deadline of every engine call in seconds, default 5: a wedged engine costs at most that),
`kvseal.engine_uid` (the engine's user, a uid or name, when it is neither root nor vLLM's: the connector hands its KV
memory only to a lane served by root, its own user or this one), `kvseal.pd_timeout_s` (how long a prefill holds
its blocks for the decode instance, default 30), `kvseal.sync_load_bytes` (loads of at most this many bytes per
worker run in the step that schedules the request, default 64 MiB; 0: every load is asynchronous).

Scheduler side (one per vLLM instance): asks the engine, through the local lane, how many of a waiting request's
block hashes beyond vLLM's own hit are resident; the engine pins them under a lease. vLLM then allocates blocks.
A small load (at most `kvseal.sync_load_bytes` on each worker: ~9 ms at this machine class's 7 GB/s) runs
synchronously at the start of the step that computes the rest of the prompt, as vLLM's ExampleConnector's loads
do; a larger one runs asynchronously, the request waiting in WAITING_FOR_REMOTE_KVS for one step more, so that a
long copy does not stall the other requests' step. Every step it also plans the saves of blocks that became full.
Never claims the last prompt token, and with an EAGLE-style drafter (eagle, eagle3, mtp …) not the last block of
the hit either, exactly as vLLM drops it from its own prefix-cache hit.

One KV cache group only: kvseal saves and loads one block id per hash for all of a worker's layers, so a config to
which vLLM gives several block tables is refused at start (check_one_kv_cache_group says when vLLM does). That group
must be attention whose blocks are prefix-cacheable token blocks (full, MLA, sliding window, chunked local): a state
group (Mamba, gated delta net, short conv) or any spec vLLM does not prefix-cache is refused at start, naming it
(check_attention_kv_cache). Where vLLM puts its null block (id 0: positions a sliding window or a local chunk no
longer needs), nothing is loaded or saved: the engine is never handed id 0.

Worker side (one per tp/pp rank): registers exactly the KV tensors vLLM allocated (drafter layers included when
they exist) with their physical packing in `layout_tag`; the engine seals the layout and derives the namespace.
Loads run at the step's start and are reported through get_finished; a failed or refused load reports its blocks
through get_block_ids_with_load_errors so vLLM recomputes them. All saves of a step go in one Save RPC.

Prefill/decode (per request, from its kv_transfer_params, as vLLM's P/D connectors do): a prefill request
(`do_remote_decode`) finishes by holding its prompt's saved blocks under a lease of `kvseal.pd_timeout_s` and
returning `do_remote_prefill` parameters with a `kvseal` entry (namespace_final, descriptor, engine, node, lease,
block hashes); a decode request carrying them loads those blocks like any hit (the engine fetches them from the
prefill's node when it is another), releases the hold once loaded, and refuses them when its namespace_final is not
the prefill's, logging what differs. `kvseal_describe` requests answer the instance's layout (for routers).

The engine being down or wedged never stops inference: calls fail soft (no hit, no save), each within its deadline;
after a failure the connectors of a process skip engine calls for 1 s, doubling with every further failure up to
30 s (reset by a success), so a stopped engine costs one deadline per interval, not one per step. A warning is
logged once per outage. A worker's registration lives as long as its lane connection to the engine
(`EngineClient.session_alive`, checked once per step): when that is gone (engine restarted, connection broken)
the worker registers again, whatever its mode.
"""

from __future__ import annotations

import logging
import os
import pwd
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.request import RequestStatus

from kvseal.client import EngineClient, layer_from_tensor
from kvseal.errors import KvsealError
from kvseal.proto import kvseal_pb2 as pb
from kvseal.vllm.identity import model_identity

if TYPE_CHECKING:
    from collections.abc import Callable

    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvseal.vllm")
MODES = ("read_write", "save_only", "load_only")
RETRY_INTERVAL_S = 1.0  # at most one registration attempt per interval
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_PD_TIMEOUT_S = 30.0
# A synchronous load saves a scheduler step (vLLM's own local-hit path pays none) but holds up the step of every
# other request while it copies; 64 MiB copies in ~5-9 ms on this machine class, about a decode step.
DEFAULT_SYNC_LOAD_BYTES = 64 << 20
PD_WAIT_S = 3.0  # how long a decode request waits for the prefill's blocks to reach its engine (another node's)
NULL_BLOCK_ID = 0  # vLLM's null block (BlockPool.null_block, the first block id): holds nothing, is never written
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
# answers of an engine that works, about the state of this instance: not an outage
_INCOMPLETE = "FAILED_PRECONDITION"  # registration incomplete: other workers are not in yet
_NOT_REGISTERED = ("NOT_FOUND", "PERMISSION_DENIED")  # the engine does not (or no longer) know this worker


@dataclass(frozen=True, slots=True)
class LoadJob:
    req_id: str
    hashes: list[bytes]
    block_ids: list[int]
    lease_id: int
    sync: bool  # loaded in the step that schedules the request (vLLM's load_kv_async False): not reported finished


@dataclass
class KVSealConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    save_hashes: list[bytes] = field(default_factory=list)
    save_block_ids: list[int] = field(default_factory=list)


@dataclass
class _Tracked:
    request: Any
    block_ids: list[int]
    saved: int  # leading blocks known to be in the engine


@dataclass
class _Pending:
    start: int  # first block index the lease covers
    hits: int  # blocks claimed (at most the engine's hits)
    lease_id: int
    sync: bool


class _Outage:
    """The state of one engine target as the connectors of a process see it (scheduler and worker sides live in one
    process when vLLM runs without multiprocessing): logs one warning per outage and one line when the engine is
    back, and paces engine calls during an outage. After a failure no call is made for `backoff_s` seconds (1 s,
    doubling with each further failure up to 30 s; a success resets it), so a wedged engine, where every call waits
    out its deadline, costs one deadline per interval instead of one per step."""

    _by_target: dict[str, _Outage] = {}

    @classmethod
    def of(cls, target: str) -> _Outage:
        return cls._by_target.setdefault(target, cls(target))

    def __init__(self, target: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.target = target
        self.down = False
        self.backoff_s = 0.0  # 0 while the engine answers
        self.resume_at = 0.0
        self._clock = clock

    def allows_call(self) -> bool:
        return self._clock() >= self.resume_at

    def failed(self, what: str, error: Exception) -> None:
        if not self.down:
            log.warning(
                "kvseal engine at %s unavailable (%s: %s): continuing without the cache", self.target, what, error
            )
            self.down = True
        self.backoff_s = min(2 * self.backoff_s, BACKOFF_MAX_S) if self.backoff_s else BACKOFF_FIRST_S
        self.resume_at = self._clock() + self.backoff_s

    def ok(self) -> None:
        if self.down:
            log.warning("kvseal engine at %s is back", self.target)
            self.down = False
        self.backoff_s = 0.0
        self.resume_at = 0.0


def check_hashing_is_deterministic(vllm_config: VllmConfig) -> None:
    """Two instances share blocks only if they hash tokens the same way (ARCHITECTURE §5)."""
    algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
    if os.environ.get("PYTHONHASHSEED") is None and not algo.startswith("sha256"):
        raise ValueError(
            f"kvseal: prefix_caching_hash_algo={algo!r} without PYTHONHASHSEED seeds block hashes randomly in every "
            "process, so no two vLLM instances could ever share a cached block. Set PYTHONHASHSEED (the same value "
            "for every instance, e.g. PYTHONHASHSEED=0) or use --prefix-caching-hash-algo sha256."
        )


def check_one_kv_cache_group(kv_cache_config: KVCacheConfig) -> None:
    """kvseal keys a block by one hash and saves and loads one block id per hash for all of a worker's layers: that
    is one block table, vLLM's single KV cache group.

    Whether vLLM hands a connector more than one (vLLM 0.32): a connector without `SupportsHMA` (this one) turns
    the hybrid KV cache manager off (`VllmConfig.__post_init__` sets `disable_hybrid_kv_cache_manager`;
    `KVConnectorFactory.create_connector` refuses an explicit `--no-disable-hybrid-kv-cache-manager`). Then
    `kv_cache_utils.get_kv_cache_groups` first calls `unify_hybrid_kv_cache_specs`, which promotes sliding-window and
    chunked-local attention to full attention and raises for what it cannot unify (attention beside Mamba state:
    "Failed to promote local KV cache specs"). But it unifies two buckets separately, replicated attention
    (`dcp_sharded=False`, e.g. a draft model at DCP 1 under a DCP target, `gpu/model_runner.get_kv_cache_spec`) and
    the rest; when both exist the specs stay mixed and `_get_packed_kv_cache_groups` /
    `_get_kv_cache_groups_uniform_page_size` return several groups, which vLLM checks only when a request finishes
    (`Scheduler._connector_finished` asserts one group for a connector without SupportsHMA). So refuse at
    construction, naming the groups, rather than save and load group 0's block ids for every layer."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) == 1:
        return
    if not groups:
        raise ValueError(
            "kvseal supports one KV cache group; this model has none (it is attention-free: no KV cache to "
            "share). Run it without kvseal (drop --kv-transfer-config)."
        )
    described = "; ".join(
        f"group {i}: {type(g.kv_cache_spec).__name__}, {len(g.layer_names)} layers ({_names(g.layer_names)})"
        for i, g in enumerate(groups)
    )
    raise ValueError(
        f"kvseal supports one KV cache group; this model has {len(groups)} ({described}). vLLM gives each group "
        "its own block table, while kvseal saves and loads one block id per hash for all of a worker's layers. "
        "vLLM already merged what it could (kvseal turns the hybrid KV cache manager off). Give every layer one KV "
        "cache spec (e.g. the same decode-context-parallel sharding for draft and target layers), or run this "
        "model without kvseal (drop --kv-transfer-config)."
    )


def check_attention_kv_cache(kv_cache_config: KVCacheConfig) -> None:
    """kvseal serves blocks of attention KV: a block holds the keys and values of its tokens, so a prefix's blocks,
    keyed by the prefix's hashes, are the same bytes for every request that shares the prefix. Refuses at
    construction, naming the group and its spec, everything else vLLM can hand over in one group:
    - state specs (MambaSpec and its kinds: Mamba1/2, gated delta net, short conv, linear attention): a block is a
      sequence's running state at a boundary; loaded as a prefix block it gives wrong outputs (measured: every token
      of a tiny Mamba2 differed from the cold run);
    - specs vLLM itself does not prefix-cache (`prefix_cacheable` False: circular buffers, bounded-replay MLA
      windows), cross-attention (its KV depends on the encoder input, not on the hashed tokens), encoder-only,
      hidden-state caches, HiSparse pools.
    Accepted: FullAttentionSpec and its kinds (MLA, sinks, R-SWA), SlidingWindowSpec, ChunkedLocalAttentionSpec;
    their null blocks are never loaded or saved (the connector skips block id 0)."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        HiddenStateCacheSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    def refused(spec: Any) -> str | None:
        if isinstance(spec, UniformTypeKVCacheSpecs):
            return next(filter(None, map(refused, spec.kv_cache_specs.values())), None)
        kinds = (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec)
        if not isinstance(spec, kinds) or isinstance(spec, HiddenStateCacheSpec):
            return type(spec).__name__
        if not spec.prefix_cacheable:
            return f"{type(spec).__name__} (not prefix-cacheable)"
        return None

    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        why = refused(group.kv_cache_spec)
        if why is None:
            continue
        raise ValueError(
            f"kvseal cannot serve this model's KV cache: group {i} is {why}, {len(group.layer_names)} layers "
            f"({_names(group.layer_names)}). kvseal stores attention KV as prefix blocks (full, MLA, sliding window, "
            "chunked local); a Mamba / linear-attention state or a cache vLLM does not prefix-cache loaded as such "
            "blocks would give wrong outputs, so kvseal refuses it. Run this model without kvseal (drop "
            "--kv-transfer-config); vLLM's own prefix cache (--enable-prefix-caching) still serves it."
        )


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


def _names(names: list[str], shown: int = 2) -> str:
    more = f", … {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def drops_last_hit_block(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> bool:
    """Whether vLLM drops the last block of its own prefix-cache hit, mirrored from vLLM 0.32: the scheduler builds
    its KVCacheManager with `use_eagle=speculative_config.use_eagle_block_drop()` (method in eagle, eagle3, mtp,
    dflash, dspark, and `disable_eagle_block_drop` off); `KVCacheCoordinator` flags the groups marked
    `is_eagle_group`, or every group when that is set and none is marked; `UnitaryKVCacheCoordinator` (one group)
    passes `drop_eagle_block = 0 in eagle_group_ids` to `FullAttentionManager.find_longest_cache_hit`, which then
    takes one block (alignment = block size with one group) off a non-empty hit. The drafter needs that block
    recomputed: for its hidden states, and because its KV there depends on tokens past the block."""
    spec = vllm_config.speculative_config
    use_eagle = spec is not None and spec.use_eagle_block_drop()
    return use_eagle or kv_cache_config.kv_cache_groups[0].is_eagle_group


def claimable_blocks(hits: int, drop_last_block: bool) -> int:
    """Blocks of the engine's `hits` (leading resident blocks right after vLLM's own hit) the connector claims.

    vLLM has already taken the drafter's block off its own hit, and the engine's hit continues from there, so the
    last block of the whole hit is the engine's last one: dropping it gives exactly vLLM's rule applied to the
    union of both caches."""
    return max(hits - 1, 0) if drop_last_block else hits


def _prefill_params(request: Request) -> dict[str, Any] | None:
    """The kvseal part of a decode request's kv_transfer_params (what the prefill instance handed over), or None."""
    params = request.kv_transfer_params or {}
    prefill = params.get("kvseal") if params.get("do_remote_prefill") else None
    return prefill if isinstance(prefill, dict) and prefill.get("version") == 1 else None


def _seconds(extra: dict[str, Any], key: str, default: float) -> float:
    """A positive, finite number of seconds from the extra config, or ValueError naming the key."""
    value = extra.get(key, default)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{key} must be a positive number of seconds, got {value!r}")
    return seconds


def _bytes(extra: dict[str, Any], key: str, default: int) -> int:
    """A non-negative whole number of bytes from the extra config, or ValueError naming the key."""
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} must be a non-negative whole number of bytes, got {value!r}")
    return value


def _engine_uid(extra: dict[str, Any]) -> int | None:
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


class KVSealConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_hashing_is_deterministic(vllm_config)
        check_one_kv_cache_group(kv_cache_config)
        check_attention_kv_cache(kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        extra = transfer.kv_connector_extra_config or {}
        self.mode = extra.get("kvseal.mode", "read_write")
        if self.mode not in MODES:
            raise ValueError(f"kvseal.mode must be one of {MODES}, got {self.mode!r}")
        self.target = extra.get("kvseal.engine", "127.0.0.1:50055")
        self.timeout_s = _seconds(extra, "kvseal.timeout_s", DEFAULT_TIMEOUT_S)
        self.instance_id = f"vllm-{transfer.engine_id}"
        self.block_size = vllm_config.cache_config.block_size
        self.client = EngineClient(
            self.target, token=extra.get("kvseal.token"), timeout=self.timeout_s, engine_uid=_engine_uid(extra)
        )
        self.outage = _Outage.of(self.target)
        self.pd_timeout_s = _seconds(extra, "kvseal.pd_timeout_s", DEFAULT_PD_TIMEOUT_S)
        if role == KVConnectorRole.SCHEDULER:
            # a failed or refused load must make vLLM recompute, never fail the request
            transfer.kv_load_failure_policy = "recompute"
            self._drop_last_block = drops_last_hit_block(vllm_config, kv_cache_config)
            [group] = kv_cache_config.kv_cache_groups  # one KV cache group (check_one_kv_cache_group)
            self._block_bytes = group.kv_cache_spec.page_size_bytes * len(group.layer_names)  # per worker
            self._sync_load_bytes = _bytes(extra, "kvseal.sync_load_bytes", DEFAULT_SYNC_LOAD_BYTES)
            self._pending: dict[str, _Pending] = {}
            self._tracked: dict[str, _Tracked] = {}
            self._requests: dict[str, Any] = {}
            self._loads: list[LoadJob] = []
            self._holds: dict[str, dict[str, Any]] = {}  # decode: request id -> the prefill's hold, to end
            self._waiting_since: dict[str, float] = {}  # decode: when a request first waited for its prefill's KV
            self._described: dict[str, Any] | None = None  # this instance's layout, as prefill/decode params say it
        else:
            model = vllm_config.model_config
            self.namespace = extra.get("kvseal.namespace") or model_identity(model.model, model.revision)
            self._kv_caches: dict[str, torch.Tensor] = {}
            self._layers: list[pb.LayerSpec] = []
            self._on_cuda = False
            self._registered = False
            self._next_attempt = 0.0
            self._finished_loads: set[str] = set()
            self._load_errors: set[int] = set()

    # ================================================================ scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._release_pending(request.request_id)
        if self.mode == "save_only" or not self.outage.allows_call():
            return 0, False
        prefill = _prefill_params(request)
        start = num_computed_tokens // self.block_size
        limit = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))  # keep the last token
        if limit <= start:
            return 0, False
        try:
            q = self.client.query(self.instance_id, list(request.block_hashes[start:limit]))
        except KvsealError as e:
            if e.status in (_INCOMPLETE, "NOT_FOUND"):  # the engine answers, the workers are not (all) in yet
                self.outage.ok()
            else:
                self.outage.failed("query", e)
            return 0, False
        self.outage.ok()
        if q.loading:
            self._release(q.lease_id)
            return None, False
        if prefill is not None:
            if prefill.get("namespace_final") != q.namespace_final:
                self._release(q.lease_id)
                self._refuse(request.request_id, prefill, q.namespace_final)
                return 0, False  # computed here instead: never KV of another layout
            self._holds[request.request_id] = prefill
            wanted = min(len(prefill.get("block_hashes", ())), limit - start)
            if q.hits < wanted:
                if self._wait(request.request_id):
                    self._release(q.lease_id)
                    return None, False  # the prefill's blocks are on their way (another node announces them soon)
                log.warning(
                    "kvseal: request %s: %d of the prefill's %d blocks reached this engine in %.1f s; computing the "
                    "rest here",
                    request.request_id,
                    q.hits,
                    wanted,
                    min(PD_WAIT_S, self.pd_timeout_s),
                )
        hits = claimable_blocks(q.hits, self._drop_last_block)
        if hits == 0:
            self._release(q.lease_id)
            return 0, False
        sync = hits * self._block_bytes <= self._sync_load_bytes
        self._pending[request.request_id] = _Pending(start, hits, q.lease_id, sync)
        self._requests[request.request_id] = request
        return hits * self.block_size, not sync

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._requests[request.request_id] = request
        pending = self._pending.pop(request.request_id, None)
        if pending is None:
            return
        n = num_external_tokens // self.block_size
        if n == 0:
            self._release(pending.lease_id)
            return
        [block_ids] = blocks.get_block_ids()  # one KV cache group (check_one_kv_cache_group)
        end = pending.start + min(n, pending.hits)
        # a sliding window or local chunk has the null block where it needs nothing: only the rest is loaded
        hashes, ids = without_null_blocks(
            list(request.block_hashes[pending.start : end]), list(block_ids[pending.start : end])
        )
        self._loads.append(LoadJob(request.request_id, hashes, ids, pending.lease_id, pending.sync))
        if pending.sync:  # this engine's own lease pins the blocks until they are loaded: the prefill's hold can go
            hold = self._holds.pop(request.request_id, None)
            if hold is not None:
                self._end_hold(hold)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVSealConnectorMetadata(loads=self._loads)
        self._loads = []
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            request = self._requests.get(new.req_id)
            if request is not None:
                loaded = new.num_computed_tokens // self.block_size
                [block_ids] = new.block_ids
                self._tracked[new.req_id] = _Tracked(request, list(block_ids), loaded)
                self._plan_save(meta, new.req_id, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                [added] = new_ids
                tracked.block_ids.extend(added)
            self._plan_save(meta, req_id, cached.num_computed_tokens[i], scheduler_output)
        return meta

    def _plan_save(self, meta: KVSealConnectorMetadata, req_id: str, computed: int, so: SchedulerOutput) -> None:
        if self.mode == "load_only":
            return
        tracked = self._tracked[req_id]
        done = computed + so.num_scheduled_tokens.get(req_id, 0)
        hashes = tracked.request.block_hashes
        full = min(done // self.block_size, len(hashes), len(tracked.block_ids))
        if full > tracked.saved:
            saved, ids = without_null_blocks(
                list(hashes[tracked.saved : full]), tracked.block_ids[tracked.saved : full]
            )
            meta.save_hashes.extend(saved)
            meta.save_block_ids.extend(ids)
            tracked.saved = full

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # saves run synchronously at the end of the step that computed the blocks, so nothing is left to wait for
        self._forget(request.request_id)
        params = request.kv_transfer_params or {}
        if params.get("kvseal_describe"):  # a router asks which layout this instance has
            return False, {"kvseal": self._describe()}
        if params.get("do_remote_decode") and request.status == RequestStatus.FINISHED_LENGTH_CAPPED:
            return False, self._hand_over(request)
        return False, None

    # ---------------------------------------------------------------- prefill / decode

    def _describe(self) -> dict[str, Any]:
        """This instance's final namespace, layout descriptor and node, once known (the engine's Describe)."""
        if self._described is None and self.outage.allows_call():
            try:
                status = self.client.describe(self.instance_id)
                node_id = self.client.info().node_id
            except KvsealError as e:
                log.warning("kvseal: cannot describe %s to a prefill/decode router: %s", self.instance_id, e)
                return {"version": 1}
            if status.sealed:
                self._described = {
                    "version": 1,
                    "namespace_final": status.namespace_final,
                    "descriptor": status.descriptor.decode(),
                    "node_id": node_id,
                }
        return dict(self._described or {"version": 1})

    def _hand_over(self, request: Request) -> dict[str, Any]:
        """Prefill side: holds the prompt's saved blocks under a lease of kvseal.pd_timeout_s (capped by the engine's
        --lease-ttl) and says where the decode instance finds them. The lease ends when the decode side has loaded
        them (it releases it), or by its TTL (the decode never came)."""
        n = min(len(request.block_hashes), request.num_prompt_tokens // self.block_size)
        hashes = list(request.block_hashes[:n])
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.instance_id,
            "remote_block_ids": [],
            "remote_host": None,
            "remote_port": None,
        }
        if not hashes or not self.outage.allows_call():
            return params
        try:
            q = self.client.query(self.instance_id, hashes, lease_ttl_ms=int(self.pd_timeout_s * 1000))
        except KvsealError as e:
            self.outage.failed("query", e)
            return params  # the decode side computes the prompt itself
        params["kvseal"] = self._describe() | {
            "namespace_final": q.namespace_final,
            "engine": self.target,
            "instance_id": self.instance_id,
            "lease_id": q.lease_id,
            "lease_ttl_ms": q.lease_ttl_ms,
            "block_hashes": [bytes(h).hex() for h in hashes],
        }
        return params

    def _refuse(self, req_id: str, prefill: dict[str, Any], own: str) -> None:
        """Decode side: the prefill's layout is not this instance's. Says what differs (the engine compares the two
        descriptors), and the request is computed here."""
        why = "the layouts differ"
        descriptor = prefill.get("descriptor")
        if isinstance(descriptor, str):
            try:
                why = self.client.compare(own, descriptor.encode()).message or why
            except KvsealError as e:
                why = f"the layouts differ (the engine could not compare them: {e})"
        log.warning(
            "kvseal: request %s: refusing the prefill's KV (%s) for this decode instance (%s): %s; computing the "
            "prompt here",
            req_id,
            prefill.get("namespace_final"),
            own,
            why,
        )
        self._end_hold(prefill)

    def _wait(self, req_id: str) -> bool:
        first = self._waiting_since.setdefault(req_id, time.monotonic())
        return time.monotonic() - first < min(PD_WAIT_S, self.pd_timeout_s)

    def _end_hold(self, prefill: dict[str, Any]) -> None:
        """Ends the prefill's lease as soon as it is not needed, when the prefill used this instance's engine. On
        another node's engine its TTL ends it: the parameters come from the API client, and this connector does
        not call (and hand its token to) an engine address a client wrote."""
        lease_id, instance = prefill.get("lease_id"), prefill.get("instance_id")
        if prefill.get("engine") != self.target or not isinstance(instance, str):
            return
        if isinstance(lease_id, int) and lease_id > 0:
            self._release_of(instance, lease_id)

    def _release_of(self, instance: str, lease_id: int) -> None:
        if not self.outage.allows_call():
            return
        try:
            self.client.release(instance, lease_id)
        except KvsealError:
            pass  # expired, or released already: gone either way

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for req_id in connector_output.finished_recving or ():
            hold = self._holds.pop(req_id, None)
            if hold is not None:
                self._end_hold(hold)

    def _forget(self, req_id: str) -> None:
        self._release_pending(req_id)
        self._tracked.pop(req_id, None)
        self._requests.pop(req_id, None)
        self._waiting_since.pop(req_id, None)
        hold = self._holds.pop(req_id, None)
        if hold is not None:
            self._end_hold(hold)

    def _release_pending(self, req_id: str) -> None:
        pending = self._pending.pop(req_id, None)
        if pending is not None:
            self._release(pending.lease_id)

    def _release(self, lease_id: int) -> None:
        """Ends a lease early. Skipped during an outage: the engine ends it on its TTL anyway."""
        if not lease_id or not self.outage.allows_call():
            return
        try:
            self.client.release(self.instance_id, lease_id)
        except KvsealError as e:
            if e.status in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
                self.outage.failed("release", e)
            # otherwise the lease expired or the engine restarted: it is gone either way

    # ================================================================ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)
        self._layers = [
            # every layer is in the one KV cache group (check_one_kv_cache_group)
            layer_from_tensor(
                name,
                tensor,
                layout_tag=self._layout_tag(name, tensor),
                group_id=0,
                split_kv=splits_kv(tensor, self._vllm_config.cache_config.num_gpu_blocks),
            )
            for name, tensor in sorted(kv_caches.items())
        ]
        self._on_cuda = any(t.is_cuda for t in kv_caches.values())
        self._ensure_registered()

    def _layout_tag(self, name: str, tensor: torch.Tensor) -> str:
        """Names the packing of a block: backend, KV layout, kernel ISA path, dtypes (ARCHITECTURE §5)."""
        layer = self._vllm_config.compilation_config.static_forward_context.get(name)
        backend = "unknown"
        if layer is not None and hasattr(layer, "attn_backend"):
            backend = layer.attn_backend.get_name()
        isa = getattr(layer, "isa", None) or tensor.device.type
        layout = self._vllm_config.cache_config.kv_cache_layout or "default"
        cache_dtype = self._vllm_config.cache_config.cache_dtype
        return f"{backend}/{layout}/{isa}/{str(tensor.dtype).removeprefix('torch.')}/{cache_dtype}"

    def _check_session(self) -> None:
        """Once per step: a registration lives as long as the client's lane connection, which an engine restart or
        a failed call ends. Then register again (in every mode: a load_only worker never learns it from a Save)."""
        if self._registered and not self.client.session_alive():
            self._registered = False
            log.info("kvseal: the engine's session of %s is gone; registering again", self.instance_id)
        self._ensure_registered()

    def _ensure_registered(self) -> bool:
        if self._registered:
            return True
        if not self._layers or time.monotonic() < self._next_attempt or not self.outage.allows_call():
            return False
        self._next_attempt = time.monotonic() + RETRY_INTERVAL_S
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        parallel = self._vllm_config.parallel_config
        tp_size, pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        self._worker = (self.instance_id, get_tensor_model_parallel_rank(), get_pp_group().rank_in_group)
        try:
            status = self.client.register(
                instance_id=self.instance_id,
                namespace=self.namespace,
                tp_rank=self._worker[1],
                tp_size=tp_size,
                pp_rank=self._worker[2],
                world_size=tp_size * pp_size,
                block_size=self.block_size,
                layers=self._layers,
            )
        except KvsealError as e:
            self.outage.failed("register", e)
            return False
        self.outage.ok()
        self._registered = True
        log.info(
            "kvseal: registered %d KV layers as %s tp_rank %d (%s)",
            len(self._layers),
            self.instance_id,
            self._worker[1],
            status.namespace_final or f"{status.registered}/{status.world_size} workers in",
        )
        return True

    def _engine_call(self, what: str, fn: Any, *args: Any) -> Any:
        """Runs one data-path call of a registered worker, or skips it (None) during an outage's backoff."""
        if not self.outage.allows_call():
            return None
        try:
            result = fn(*args)
        except KvsealError as e:
            if e.status in _NOT_REGISTERED:  # the engine answers but no longer knows this registration
                self._registered = False
                self.outage.ok()
            elif e.status == _INCOMPLETE:  # other workers not in yet: nothing is wrong
                self.outage.ok()
            else:
                self.outage.failed(what, e)
            return None
        self.outage.ok()
        return result

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._check_session()
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVSealConnectorMetadata)
        for job in meta.loads:
            loaded = 0
            if self._registered and job.hashes:
                r = self._engine_call("load", self.client.load, self._worker, job.hashes, job.block_ids, job.lease_id)
                if r is not None:
                    loaded = r.loaded
                    if r.outcome == pb.LoadResponse.REFUSED:
                        log.warning("kvseal refused a load of request %s: %s", job.req_id, r.message)
            self._load_errors.update(job.block_ids[loaded:])
            if not job.sync:
                self._finished_loads.add(job.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # loads complete in start_load_kv

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        pass  # the engine copies every layer of a block at once in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVSealConnectorMetadata)
        if meta.save_hashes and self._registered:  # the session was checked at this step's start_load_kv
            if self._on_cuda:  # the engine copies on its own stream: this step's KV writes must be done first
                torch.cuda.current_stream().synchronize()
            self._engine_call("save", self.client.save, self._worker, meta.save_hashes, meta.save_block_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, self._finished_loads = self._finished_loads, set()
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self.client.close()  # ends the lane connection, and with it this worker's registration
