"""The scheduler side of KVSealConnector: one per vLLM instance, in vLLM's scheduler process. It keeps the books
(which engine hits it claimed, which blocks each request has and which of them the engine holds) and plans; the
workers move the bytes (kvseal.vllm.worker).

    get_num_new_matched_tokens  Query the engine (lease)  ->  a claim   (or None: ask again next step)
    update_state_after_alloc    claim + vLLM's block ids   ->  a LoadJob for this step's metadata
    build_connector_meta        new full blocks of every scheduled request -> this step's saves
    request_finished            forget the request; a prefill hands its blocks over

It asks the engine, through the local lane, how many of a waiting request's block hashes beyond vLLM's own hit are
resident; the engine pins them under a lease. vLLM then allocates blocks. A small load (at most
`kvseal.sync_load_bytes` on each worker: ~9 ms at this machine class's 7 GB/s) runs synchronously at the start of
the step that computes the rest of the prompt, as vLLM's ExampleConnector's loads do; a larger one runs
asynchronously, the request waiting in WAITING_FOR_REMOTE_KVS for one step more, so that a long copy does not stall
the other requests' step. Every step it also plans the saves of blocks that became full. Never claims the last
prompt token, and with an EAGLE-style drafter (eagle, eagle3, mtp …) not the last block of the hit either, exactly
as vLLM drops it from its own prefix-cache hit. Where vLLM puts its null block, nothing is loaded or saved.

Prefill/decode (per request, from its kv_transfer_params, as vLLM's P/D connectors do): a prefill request
(`do_remote_decode`) finishes by holding its prompt's saved blocks under a lease of `kvseal.pd_timeout_s` and
returning `do_remote_prefill` parameters with a `kvseal` entry (namespace_final, descriptor, engine, node, lease,
block hashes); a decode request carrying them loads those blocks like any hit (the engine fetches them from the
prefill's node when it is another), releases the hold once loaded, and refuses them when its namespace_final is not
the prefill's, logging what differs. `kvseal_describe` requests answer the instance's layout (for routers).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.v1.request import RequestStatus

from kvseal.errors import KvsealError
from kvseal.vllm.compat import (
    NULL_BLOCK_ID,
    claimable_blocks,
    drops_last_hit_block,
    instance_id_of,
    stored_groups,
    without_null_blocks,
)
from kvseal.vllm.metadata import KVSealConnectorMetadata, LoadJob
from kvseal.wire.lane import BlockRun

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvseal.client import EngineClient
    from kvseal.vllm.compat import KVSealConfig
    from kvseal.vllm.outage import Outage

log = logging.getLogger("kvseal.vllm")
PD_WAIT_S = 3.0  # how long a decode request waits for the prefill's blocks to reach its engine (another node's)


@dataclass(frozen=True, slots=True)
class _Claim:
    """Engine hits claimed for a request, pinned by the engine's lease until vLLM allocates their blocks."""

    start: int  # first block index the lease covers (hybrid: vLLM's own hit, in hash blocks)
    hits: int  # blocks claimed (at most the engine's hits; hybrid: hash blocks after `start`)
    lease_id: int
    sync: bool  # loaded in the step that schedules the request


@dataclass(slots=True)
class _Request:
    """What the scheduler side knows of one request, from its first claim, hold or allocation until it finishes."""

    request: Request
    claim: _Claim | None = None  # claimed, not yet allocated
    block_ids: list[int] | None = None  # its blocks once scheduled (None before: no saves planned)
    saved: int = 0  # leading blocks known to be in the engine
    named: bool = False  # its first save was planned (it names the blocks before `saved`: the engine refreshes them)
    group_block_ids: list[list[int]] | None = None  # hybrid: its blocks per vLLM group once scheduled
    saved_tokens: int = 0  # hybrid: leading tokens whose full blocks (of every group) were saved or loaded
    hold: dict[str, Any] | None = None  # decode: the prefill's hold, to end once loaded
    waiting_since: float | None = None  # decode: when it first waited for the prefill's blocks


def _prefill_params(request: Request) -> dict[str, Any] | None:
    """The kvseal part of a decode request's kv_transfer_params (what the prefill instance handed over), or None."""
    params = request.kv_transfer_params or {}
    prefill = params.get("kvseal") if params.get("do_remote_prefill") else None
    return prefill if isinstance(prefill, dict) and prefill.get("version") == 1 else None


class SchedulerSide:
    """The caller (KVSealConnector) guarantees KV cache groups kvseal serves (kvseal.vllm.compat checks it at
    construction). Engine calls fail soft and are paced by `outage`.

    A hybrid instance (kvseal.vllm.compat.StoredGroups.hybrid: several groups, or one that is not full attention)
    asks the engine for the hybrid hit of the whole prompt (the engine applies the windows, the states, the
    alignment and the drafter's drop), loads asynchronously (vLLM takes no block-level load errors with several
    groups: a failed load is recomputed whole) and saves every group's full blocks as runs (a Mamba group's where a
    step ended); a prefill's hold leases what the decode side's hit needs (its limit: the prompt's last token)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        config: KVSealConfig,
        client: EngineClient,
        outage: Outage,
    ) -> None:
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        # a failed or refused load must make vLLM recompute, never fail the request
        transfer.kv_load_failure_policy = "recompute"
        self.config = config
        self.client = client
        self.outage = outage
        self.instance_id = instance_id_of(vllm_config)
        self.block_size = vllm_config.cache_config.block_size
        self._drop_last_block = drops_last_hit_block(vllm_config, kv_cache_config)
        self.stored = stored_groups(vllm_config, kv_cache_config)
        self.hybrid = self.stored.hybrid
        self._align = math.lcm(*(g.block_size for g in self.stored.groups))  # a hybrid hit's granularity
        group = kv_cache_config.kv_cache_groups[0]
        self._block_bytes = group.kv_cache_spec.page_size_bytes * len(group.layer_names)  # per worker (one group)
        self._requests: dict[str, _Request] = {}
        self._loads: list[LoadJob] = []  # this step's, handed to the workers by build_connector_meta
        self._described: dict[str, Any] | None = None  # this instance's layout, as prefill/decode params say it

    def _record(self, request: Request) -> _Request:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _Request(request)
        state.request = request
        return state

    # ---------------------------------------------------------------- hits, loads, saves

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._drop_claim(request.request_id)
        if self.config.mode == "save_only" or not self.outage.allows_call():
            return 0, False
        prefill = _prefill_params(request)
        step = self.stored.hash_block_size if self.hybrid else self.block_size
        start = num_computed_tokens // step
        if self.hybrid:  # the whole prompt's hit (the engine applies windows, states, alignment, the drafter's drop)
            first, end, limit_tokens = (
                0,
                min(len(request.block_hashes), request.num_tokens // step),
                request.num_tokens - 1,
            )
            reachable = limit_tokens // self._align * self._align // step
        else:  # the leading blocks after vLLM's own hit
            first, end, limit_tokens = start, min((request.num_tokens - 1) // step, len(request.block_hashes)), 0
            reachable = end
        if reachable <= start:
            return 0, False
        try:
            q = self.client.query(self.instance_id, list(request.block_hashes[first:end]), limit_tokens=limit_tokens)
        except KvsealError as e:
            self.outage.on_query_error(e)
            return 0, False
        self.outage.ok()
        if q.loading:
            self._release(q.lease_id)
            return None, False
        reached = first + q.hits  # blocks from the prompt's start the engine serves
        if prefill is not None:
            if prefill.get("namespace_final") != q.namespace_final:
                self._release(q.lease_id)
                self._refuse(request.request_id, prefill, q.namespace_final)
                return 0, False  # computed here instead: never KV of another layout
            state = self._record(request)
            state.hold = prefill
            wanted = min(len(prefill.get("block_hashes", ())), reachable)
            if reached < wanted:
                if self._wait(state):
                    self._release(q.lease_id)
                    return None, False  # the prefill's blocks are on their way (another node announces them soon)
                log.warning(
                    "kvseal: request %s: %d of the prefill's %d blocks reached this engine in %.1f s; computing the "
                    "rest here",
                    request.request_id,
                    reached,
                    wanted,
                    min(PD_WAIT_S, self.config.pd_timeout_s),
                )
        hits = max(reached - start, 0) if self.hybrid else claimable_blocks(q.hits, self._drop_last_block)
        if hits == 0:
            self._release(q.lease_id)
            return 0, False
        sync = not self.hybrid and hits * self._block_bytes <= self.config.sync_load_bytes
        self._record(request).claim = _Claim(start, hits, q.lease_id, sync)
        return hits * step, not sync

    def _runs(
        self, request: Request, group_block_ids: Any, start: int, end: int, state_at: int, *, save: bool = False
    ) -> list[BlockRun]:
        """Per kvseal group, its full blocks within tokens [start, end) that vLLM gave a real block in every table
        (the null block stands where a window needs nothing), keyed by the hash at each block's end. A Mamba group's
        block holds a state only where a step ended, `state_at` tokens (the hit's end for a load): its one block
        ending there, if any. `save` with kvseal.window_retention_tokens = N: a window's or chunk's blocks only
        where they end within the prompt's last N tokens (or after it)."""
        retained = self.config.window_retention_tokens
        thin_below = max(0, request.num_prompt_tokens - retained) if save and retained else 0
        step = self.stored.hash_block_size
        hashes = request.block_hashes
        runs = []
        for g, kind in enumerate(self.stored.groups):
            b, k = kind.block_size, kind.block_size // step
            tables = [group_block_ids[t] for t in self.stored.tables(g)]
            stop = min(end // b, len(hashes) // k, *map(len, tables))
            first = start // b
            if kind.kind == "mamba":
                first = state_at // b - 1 if state_at % b == 0 else stop
            elif kind.kind != "full":
                first = max(first, thin_below // b)
            kept = [i for i in range(first, stop) if all(ids[i] != NULL_BLOCK_ID for ids in tables)]
            if kept:
                runs.append(
                    BlockRun(g, [hashes[(i + 1) * k - 1] for i in kept], [[ids[i] for i in kept] for ids in tables])
                )
        return runs

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        state = self._record(request)
        claim, state.claim = state.claim, None
        if claim is None:
            return
        if self.hybrid:
            step = self.stored.hash_block_size
            n = min(num_external_tokens // step, claim.hits)
            end = (claim.start + n) * step
            runs = self._runs(request, blocks.get_block_ids(), claim.start * step, end, end)
            if not runs:
                self._release(claim.lease_id)
                return
            self._loads.append(LoadJob(request.request_id, [], [], claim.lease_id, False, runs))
            return
        n = num_external_tokens // self.block_size
        if n == 0:
            self._release(claim.lease_id)
            return
        [block_ids] = blocks.get_block_ids()  # one KV cache group (check_one_kv_cache_group)
        end = claim.start + min(n, claim.hits)
        # a sliding window or local chunk has the null block where it needs nothing: only the rest is loaded
        hashes, ids = without_null_blocks(
            list(request.block_hashes[claim.start : end]), list(block_ids[claim.start : end])
        )
        self._loads.append(LoadJob(request.request_id, hashes, ids, claim.lease_id, claim.sync))
        if claim.sync:  # this engine's own lease pins the blocks until they are loaded: the prefill's hold can go
            self._end_hold_of(state)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVSealConnectorMetadata:
        meta = KVSealConnectorMetadata(loads=self._loads)
        self._loads = []
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None and self.hybrid:
                state.group_block_ids = [list(ids) for ids in new.block_ids]
                state.saved_tokens = new.num_computed_tokens  # loaded or vLLM's own hit
                self._plan_save(meta, new.req_id, state, new.num_computed_tokens, scheduler_output)
            elif state is not None:
                [block_ids] = new.block_ids
                state.block_ids = list(block_ids)
                state.saved = new.num_computed_tokens // self.block_size  # loaded or vLLM's own hit
                self._plan_save(meta, new.req_id, state, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            new_ids = cached.new_block_ids[i]
            if state is not None and state.group_block_ids is not None:
                if req_id in cached.resumed_req_ids:
                    state.group_block_ids = [list(ids) for ids in new_ids] if new_ids else []
                elif new_ids:
                    for ids, added in zip(state.group_block_ids, new_ids, strict=True):
                        ids.extend(added)
                self._plan_save(meta, req_id, state, cached.num_computed_tokens[i], scheduler_output)
                continue
            if state is None or state.block_ids is None:
                continue
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                [added] = new_ids
                state.block_ids.extend(added)
            self._plan_save(meta, req_id, state, cached.num_computed_tokens[i], scheduler_output)
        return meta

    def _plan_save(
        self, meta: KVSealConnectorMetadata, req_id: str, state: _Request, computed: int, so: SchedulerOutput
    ) -> None:
        if self.config.mode == "load_only":
            return
        done = computed + so.num_scheduled_tokens.get(req_id, 0)
        if state.group_block_ids is not None:
            end = min(done, len(state.request.block_hashes) * self.stored.hash_block_size)
            if end > state.saved_tokens and state.group_block_ids:
                runs = self._runs(state.request, state.group_block_ids, state.saved_tokens, end, done, save=True)
                meta.save_runs.extend(runs)
                state.saved_tokens = end
            return
        assert state.block_ids is not None
        hashes = state.request.block_hashes
        full = min(done // self.block_size, len(hashes), len(state.block_ids))
        # the first save names the prompt's hit too (loaded, or vLLM's own): the engine copies none it holds and
        # makes them outlive the new blocks (prefix-lru: a request's head is evicted after its tail)
        start = state.saved if state.named else 0
        state.named = True
        if full > start:
            saved, ids = without_null_blocks(list(hashes[start:full]), state.block_ids[start:full])
            meta.save_hashes.extend(saved)
            meta.save_block_ids.extend(ids)
            meta.save_requests.append((req_id, len(saved)))
            state.saved = max(state.saved, full)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        # saves run synchronously at the end of the step that computed the blocks, so nothing is left to wait for
        self._forget(request.request_id)
        params = request.kv_transfer_params or {}
        if params.get("kvseal_describe"):  # a router asks which layout this instance has
            return False, {"kvseal": self._describe()}
        if params.get("do_remote_decode") and request.status == RequestStatus.FINISHED_LENGTH_CAPPED:
            return False, self._hand_over(request)
        return False, None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for req_id in connector_output.finished_recving or ():
            state = self._requests.get(req_id)
            if state is not None:
                self._end_hold_of(state)

    def _forget(self, req_id: str) -> None:
        state = self._requests.pop(req_id, None)
        if state is None:
            return
        if state.claim is not None:
            self._release(state.claim.lease_id)
        self._end_hold_of(state)

    def _drop_claim(self, req_id: str) -> None:
        state = self._requests.get(req_id)
        if state is not None and state.claim is not None:
            lease_id, state.claim = state.claim.lease_id, None
            self._release(lease_id)

    def _release(self, lease_id: int) -> None:
        """Ends a lease early. Skipped during an outage: the engine ends it on its TTL anyway."""
        if not lease_id or not self.outage.allows_call():
            return
        try:
            self.client.release(self.instance_id, lease_id)
        except KvsealError as e:
            self.outage.on_release_error(e)

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
        step = self.stored.hash_block_size if self.hybrid else self.block_size
        n = min(len(request.block_hashes), request.num_prompt_tokens // step)
        hashes = list(request.block_hashes[:n])
        # a hybrid hold leases what the decode side's hit needs: its limit is the prompt's last token
        limit_tokens = request.num_prompt_tokens - 1 if self.hybrid else 0
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
            ttl_ms = int(self.config.pd_timeout_s * 1000)
            q = self.client.query(self.instance_id, hashes, lease_ttl_ms=ttl_ms, limit_tokens=limit_tokens)
        except KvsealError as e:
            self.outage.failed("query", e)
            return params  # the decode side computes the prompt itself
        params["kvseal"] = self._describe() | {
            "namespace_final": q.namespace_final,
            "engine": self.config.engine,
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

    def _wait(self, state: _Request) -> bool:
        """Decode side: whether the request may wait longer for the prefill's blocks."""
        if state.waiting_since is None:
            state.waiting_since = time.monotonic()
        return time.monotonic() - state.waiting_since < min(PD_WAIT_S, self.config.pd_timeout_s)

    def _end_hold_of(self, state: _Request) -> None:
        hold, state.hold = state.hold, None
        if hold is not None:
            self._end_hold(hold)

    def _end_hold(self, prefill: dict[str, Any]) -> None:
        """Ends the prefill's lease as soon as it is not needed, when the prefill used this instance's engine. On
        another node's engine its TTL ends it: the parameters come from the API client, and this connector does
        not call (and hand its token to) an engine address a client wrote."""
        lease_id, instance = prefill.get("lease_id"), prefill.get("instance_id")
        if prefill.get("engine") != self.config.engine or not isinstance(instance, str):
            return
        if isinstance(lease_id, int) and lease_id > 0 and self.outage.allows_call():
            try:
                self.client.release(instance, lease_id)
            except KvsealError:
                pass  # expired, or released already: gone either way
