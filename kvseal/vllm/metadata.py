"""What the scheduler side hands every worker each step (vLLM pickles it across the process boundary): the loads
to run at the step's start and the full blocks to save at its end. A hybrid instance (several KV cache groups)
moves its blocks as runs, one per kvseal group (kvseal.wire.lane.BlockRun); the others as one list of hashes and
block ids."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvseal.wire.lane import BlockRun


@dataclass(frozen=True, slots=True)
class LoadJob:
    req_id: str
    hashes: list[bytes]
    block_ids: list[int]
    lease_id: int
    sync: bool  # loaded in the step that schedules the request (vLLM's load_kv_async False): not reported finished
    runs: list[BlockRun] = field(default_factory=list)  # a hybrid instance's blocks (hashes and block_ids empty)


@dataclass
class KVSealConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    save_hashes: list[bytes] = field(default_factory=list)
    save_block_ids: list[int] = field(default_factory=list)
    save_requests: list[tuple[str, int]] = field(default_factory=list)  # (req_id, how many) of the two above, in turn
    save_runs: list[BlockRun] = field(default_factory=list)  # a hybrid instance's saves

    def saves_except(self, req_ids: Collection[str]) -> tuple[list[bytes], list[int]]:
        """save_hashes and save_block_ids without the blocks of `req_ids` (requests whose load failed this step:
        their named prefix was not loaded and their new blocks were computed over it)."""
        if not req_ids:
            return self.save_hashes, self.save_block_ids
        hashes: list[bytes] = []
        ids: list[int] = []
        k = 0
        for req_id, n in self.save_requests:
            if req_id not in req_ids:
                hashes += self.save_hashes[k : k + n]
                ids += self.save_block_ids[k : k + n]
            k += n
        return hashes, ids
