"""What the scheduler side hands every worker each step (vLLM pickles it across the process boundary): the loads
to run at the step's start and the full blocks to save at its end."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


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
