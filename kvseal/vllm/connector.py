"""KVSealConnector: vLLM's KVConnectorBase_V1 backed by a kvseal engine.

    --kv-transfer-config '{"kv_connector":"KVSealConnector","kv_connector_module_path":"kvseal.vllm",
                           "kv_role":"kv_both","kv_connector_extra_config":{"kvseal.engine":"127.0.0.1:50055"}}'

Extra config: `kvseal.engine` (gRPC target, default 127.0.0.1:50055), `kvseal.namespace` (default: the model's
identity, kvseal.vllm.identity), `kvseal.mode` (read_write | save_only | load_only), `kvseal.token`,
`kvseal.timeout_s` (deadline of every engine call in seconds, default 5: a wedged engine costs at most that),
`kvseal.engine_uid` (the engine's user, a uid or name, when it is neither root nor vLLM's: the connector hands its KV
memory only to a lane served by root, its own user or this one), `kvseal.pd_timeout_s` (how long a prefill holds
its blocks for the decode instance, default 30), `kvseal.sync_load_bytes` (loads of at most this many bytes per
worker run in the step that schedules the request, default 64 MiB; 0: every load is asynchronous),
`kvseal.window_retention_tokens` (hybrid models: the window blocks saved, default all). Parsed and checked at
construction (kvseal.vllm.compat.KVSealConfig): a `kvseal.` key that is none of these is refused, naming the closest.

vLLM builds one connector per role, and this one picks that role's side once and hands it every call, as vLLM's
OffloadingConnector does:

    KVSealConnector ─┬─ SchedulerSide  (kvseal.vllm.scheduler: one per instance; claims hits, plans loads and saves,
                     │                  prefill/decode hand-over)
                     ├─ WorkerSide     (kvseal.vllm.worker: one per tp/pp rank; registers KV, loads, saves)
                     └─ shared by both: KVSealConfig, EngineClient, Outage (kvseal.vllm.outage: the engine being
                                        down or wedged never stops inference; calls back off 1 s … 30 s)

KV cache groups: the connector declares vLLM's `SupportsHMA`, so vLLM keeps its hybrid KV cache manager on and
hands it a block table per KV cache group. Groups with one hit rule are one kvseal group (compat.stored_groups); an
instance with more than one vLLM group, a sliding window or a Mamba-like state is *hybrid*: it registers its groups,
asks the engine for the hybrid hit of the whole prompt, loads asynchronously and saves per group (a Mamba group's
state where a step ended on a block boundary). A group whose blocks a prefix's hashes do not name exactly (cross
attention, a cache vLLM does not prefix-cache, a Mamba state without boundary states) is refused at start, naming it
(check_attention_kv_cache). Where vLLM puts its null block (id 0: positions a window no longer needs, Mamba blocks
but the last), nothing is loaded or saved: the engine is never handed id 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvseal.client import EngineClient
from kvseal.vllm.compat import (
    DEFAULT_PD_TIMEOUT_S,
    DEFAULT_SYNC_LOAD_BYTES,
    DEFAULT_TIMEOUT_S,
    MODES,
    NULL_BLOCK_ID,
    KVSealConfig,
    check_attention_kv_cache,
    check_hashing_is_deterministic,
    check_some_kv_cache,
    claimable_blocks,
    drops_last_hit_block,
    splits_kv,
    without_null_blocks,
)
from kvseal.vllm.metadata import KVSealConnectorMetadata, LoadJob
from kvseal.vllm.outage import BACKOFF_FIRST_S, BACKOFF_MAX_S, Outage
from kvseal.vllm.scheduler import PD_WAIT_S, SchedulerSide
from kvseal.vllm.worker import RETRY_INTERVAL_S, WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [  # what kvseal.vllm.connector offered before it was split: kept importable from here
    "BACKOFF_FIRST_S",
    "BACKOFF_MAX_S",
    "DEFAULT_PD_TIMEOUT_S",
    "DEFAULT_SYNC_LOAD_BYTES",
    "DEFAULT_TIMEOUT_S",
    "MODES",
    "NULL_BLOCK_ID",
    "PD_WAIT_S",
    "RETRY_INTERVAL_S",
    "KVSealConfig",
    "KVSealConnector",
    "KVSealConnectorMetadata",
    "LoadJob",
    "check_attention_kv_cache",
    "check_hashing_is_deterministic",
    "check_some_kv_cache",
    "claimable_blocks",
    "drops_last_hit_block",
    "splits_kv",
    "without_null_blocks",
]


class KVSealConnector(KVConnectorBase_V1, SupportsHMA):
    """Refuses at construction a config or KV cache kvseal cannot serve (kvseal.vllm.compat); then builds the side
    of its role and delegates: scheduler calls to a SchedulerSide, worker calls to a WorkerSide. A call of the other
    role's (which vLLM never makes) raises RuntimeError. `config`, `client` and `outage` are the side's own."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_hashing_is_deterministic(vllm_config)
        check_some_kv_cache(kv_cache_config)
        check_attention_kv_cache(kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None  # KVConnectorBase_V1 refuses a config without one
        self.config = KVSealConfig.from_extra(transfer.kv_connector_extra_config or {})
        self.client = EngineClient(
            self.config.engine,
            token=self.config.token,
            timeout=self.config.timeout_s,
            engine_uid=self.config.engine_uid,
        )
        self.outage = Outage.of(self.config.engine)  # one per engine target and process, shared by both sides
        self._scheduler_side: SchedulerSide | None = None
        self._worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler_side = SchedulerSide(vllm_config, kv_cache_config, self.config, self.client, self.outage)
        else:
            self._worker_side = WorkerSide(vllm_config, kv_cache_config, self.config, self.client, self.outage)

    @property
    def _scheduler(self) -> SchedulerSide:
        if self._scheduler_side is None:
            raise RuntimeError(f"kvseal: a scheduler-side call on the {self.role.name} role's connector")
        return self._scheduler_side

    @property
    def _worker(self) -> WorkerSide:
        if self._worker_side is None:
            raise RuntimeError(f"kvseal: a worker-side call on the {self.role.name} role's connector")
        return self._worker_side

    def _metadata(self) -> KVSealConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVSealConnectorMetadata)
        return meta

    # ================================================================ scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVSealConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request)

    # ================================================================ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker.start_load_kv(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, _ = self._worker.get_finished()
        return None, done or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        done, failed = self._worker.get_finished()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    # ================================================================ both

    def shutdown(self) -> None:
        self.client.close()  # ends the lane connection, and with it a worker's registration
