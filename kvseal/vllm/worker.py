"""The worker side of KVSealConnector: one per tp/pp rank, in vLLM's worker process. It moves bytes as the
scheduler side planned them (kvseal.vllm.metadata) and reports one result per job.

    register_kv_caches    ->  Register (the engine maps this worker's KV tensors over the lane)
    start_load_kv         ->  one Load per LoadJob; blocks not loaded -> get_block_ids_with_load_errors
                              (a hybrid instance's loads: LoadGroups, a failure -> failed_recving)
    wait_for_save         ->  one Save (SaveGroups: hybrid) of all the step's full blocks, each request's first
                              save naming its hit prefix too; none of a request whose sync load failed this step
    get_transfer_results  ->  the asynchronous loads of this step, and those that failed

It registers exactly the KV tensors vLLM allocated (drafter layers included when they exist) with their physical
packing in `layout_tag`; the engine seals the layout and derives the namespace. Loads run at the step's start and
are reported through get_finished; a failed or refused load reports its blocks through
get_block_ids_with_load_errors so vLLM recomputes them, and none of that request's blocks is saved in that step
(its new blocks were computed over the blocks that failed). All saves of a step go in one Save RPC (more only
past the lane's limit per call).

A worker's registration lives as long as its lane connection to the engine (`EngineClient.session_alive`, checked
once per step): when that is gone (engine restarted, connection broken) the worker registers again, whatever its
mode.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from kvseal.client import layer_from_tensor
from kvseal.errors import KvsealError
from kvseal.limits import MAX_BLOCKS_PER_REQUEST
from kvseal.proto import kvseal_pb2 as pb
from kvseal.vllm.compat import instance_id_of, mamba_tag, splits_kv, stored_groups
from kvseal.vllm.identity import model_identity

if TYPE_CHECKING:
    from collections.abc import Callable

    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvseal.client import EngineClient, WorkerKey
    from kvseal.vllm.compat import KVSealConfig
    from kvseal.vllm.metadata import KVSealConnectorMetadata, LoadJob
    from kvseal.vllm.outage import Outage

log = logging.getLogger("kvseal.vllm")
RETRY_INTERVAL_S = 1.0  # at most one registration attempt per interval


class WorkerSide:
    """The caller (KVSealConnector) guarantees KV cache groups of prefix-cacheable attention (kvseal.vllm.compat
    checks it at construction). Engine calls fail soft and are paced by `outage`."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        config: KVSealConfig,
        client: EngineClient,
        outage: Outage,
    ) -> None:
        self.client = client
        self.outage = outage
        self.instance_id = instance_id_of(vllm_config)
        self.stored = stored_groups(vllm_config, kv_cache_config)
        self.block_size = self.stored.hash_block_size
        # layer name -> (kvseal group, table): where its blocks are stored, and which block ids address it
        self._places = {
            name: self.stored.places[i]
            for i, group in enumerate(kv_cache_config.kv_cache_groups)
            for name in group.layer_names
        }
        self._specs = {
            name: group.kv_cache_spec for group in kv_cache_config.kv_cache_groups for name in group.layer_names
        }
        self._vllm_config = vllm_config
        model = vllm_config.model_config
        self.namespace = config.namespace or model_identity(model.model, model.revision)
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layers: list[pb.LayerSpec] = []
        self._on_cuda = False
        self._registered = False
        self._next_attempt = 0.0
        self._key: WorkerKey = (self.instance_id, 0, 0)  # (instance, tp rank, pp rank), set when registering
        self._finished_loads: set[str] = set()
        self._failed_loads: set[str] = set()  # a hybrid instance's: vLLM recomputes the request
        self._load_errors: set[int] = set()
        self._failed_sync: set[str] = set()  # this step's requests whose sync load failed: none of their blocks saved

    # ---------------------------------------------------------------- registration

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)
        self._layers = []
        for name, tensor in sorted(kv_caches.items()):
            group, table = self._places[name] if self.stored.hybrid else (0, 0)
            layer = layer_from_tensor(
                name,
                tensor,
                layout_tag=self._layout_tag(name, tensor),
                group_id=group,
                split_kv=splits_kv(tensor, self._vllm_config.cache_config.num_gpu_blocks),
            )
            layer.table = table
            self._layers.append(layer)
        self._on_cuda = any(t.is_cuda for t in kv_caches.values())
        self._ensure_registered()

    def _layout_tag(self, name: str, tensor: torch.Tensor) -> str:
        """Names the packing of a block: backend, KV layout, kernel ISA path, dtypes (docs/design.md §2); for a
        Mamba-like layer (whose tensor is its states' bytes, one run per block) the kind, each state's shape (the
        conv state's layout with it) and dtype."""
        tag = mamba_tag(self._specs.get(name))
        if tag:
            return tag
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
        self._key = (self.instance_id, get_tensor_model_parallel_rank(), get_pp_group().rank_in_group)
        try:
            status = self.client.register(
                instance_id=self.instance_id,
                namespace=self.namespace,
                tp_rank=self._key[1],
                tp_size=tp_size,
                pp_rank=self._key[2],
                world_size=tp_size * pp_size,
                block_size=self.block_size,
                layers=self._layers,
                groups=[(g.kind, g.block_size, g.span) for g in self.stored.groups] if self.stored.hybrid else (),
                eagle_groups=self.stored.eagle if self.stored.hybrid else (),
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
            self._key[1],
            status.namespace_final or f"{status.registered}/{status.world_size} workers in",
        )
        return True

    def _engine_call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs one data-path call of a registered worker, or skips it (None) during an outage's backoff."""
        if not self.outage.allows_call():
            return None
        try:
            result = fn(*args)
        except KvsealError as e:
            if self.outage.on_worker_error(what, e):  # the engine answers but no longer knows this registration
                self._registered = False
            return None
        self.outage.ok()
        return result

    # ---------------------------------------------------------------- each step

    def start_load_kv(self, meta: KVSealConnectorMetadata) -> None:
        self._check_session()
        self._failed_sync = set()
        for job in meta.loads:
            if job.runs:
                self._load_runs(job)
                continue
            loaded = 0
            if self._registered and job.hashes:
                r = self._engine_call("load", self.client.load, self._key, job.hashes, job.block_ids, job.lease_id)
                if r is not None:
                    loaded = r.loaded
                    if r.outcome == pb.LoadResponse.REFUSED:
                        log.warning("kvseal refused a load of request %s: %s", job.req_id, r.message)
            self._load_errors.update(job.block_ids[loaded:])
            if job.sync and loaded < len(job.block_ids):
                self._failed_sync.add(job.req_id)
            if not job.sync:
                self._finished_loads.add(job.req_id)

    def _load_runs(self, job: LoadJob) -> None:
        """A hybrid instance's load (always asynchronous): whole, or reported failed and recomputed by vLLM (which
        takes no block-level load errors with several KV cache groups)."""
        wanted = sum(len(run.hashes) for run in job.runs)
        r = None
        if self._registered:
            r = self._engine_call("load", self.client.load_groups, self._key, job.runs, job.lease_id)
        if r is None or r.outcome != pb.LoadResponse.LOADED or r.loaded != wanted:
            if r is not None and r.outcome == pb.LoadResponse.REFUSED:
                log.warning("kvseal refused a load of request %s: %s", job.req_id, r.message)
            self._failed_loads.add(job.req_id)
        self._finished_loads.add(job.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # loads complete in start_load_kv

    def save_kv_layer(self, layer_name: str) -> None:
        pass  # the engine copies every layer of a block at once in wait_for_save

    def wait_for_save(self, meta: KVSealConnectorMetadata) -> None:
        if (meta.save_hashes or meta.save_runs) and self._registered:  # the session was checked at start_load_kv
            if self._on_cuda:  # the engine copies on its own stream: this step's KV writes must be done first
                torch.cuda.current_stream().synchronize()
            if meta.save_runs:
                self._engine_call("save", self.client.save_groups, self._key, meta.save_runs)
            else:
                hashes, ids = meta.saves_except(self._failed_sync)
                for k in range(0, len(hashes), MAX_BLOCKS_PER_REQUEST):  # long named prefixes may pass one call's
                    end = k + MAX_BLOCKS_PER_REQUEST
                    self._engine_call("save", self.client.save, self._key, hashes[k:end], ids[k:end])

    def get_finished(self) -> tuple[set[str], set[str]]:
        """The requests whose asynchronous load ended since the last call, and those of them that failed."""
        done, self._finished_loads = self._finished_loads, set()
        failed, self._failed_loads = self._failed_loads, set()
        return done, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
