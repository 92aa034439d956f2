"""A registering worker's memory, attached: its layers mapped (memfds, CUDA IPC handles), and once its instance
seals, the copier that moves its blocks to and from pool pages."""

from __future__ import annotations

from typing import Any

from kvseal.copy.copier import SlotSource, WorkerCopier
from kvseal.copy.cuda import cuda_runtime
from kvseal.core.layout import LayerRegistration, SealedInstance, WorkerRegistration
from kvseal.core.slabs import page_stride
from kvseal.engine.memory import Arena, CudaSpec, ShmLayer, ShmPlan, ShmSpec, layer_extent, map_cuda_storage, map_shm
from kvseal.engine.memory import plan_shm as _plan_shm
from kvseal.engine.registry import Worker
from kvseal.errors import ResourceExhausted


def plan_shm(reg: WorkerRegistration, fds: Any) -> ShmPlan:
    """The registration's memfd layers checked against `fds` (every descriptor and bound); maps nothing yet."""
    shm = [
        ShmLayer(f"layers[{i}].memory", layer.memory, extent(layer))
        for i, layer in enumerate(reg.layers)
        if isinstance(layer.memory, ShmSpec)
    ]
    return _plan_shm(shm, fds)


def map_memory(reg: WorkerRegistration, plan: ShmPlan, arena: Arena) -> tuple[list[Any], list[int]]:
    """Per layer, in registration order: the memory its blocks are in and the offset of block 0 there."""
    shm = iter(map_shm(plan))
    memories: list[Any] = []
    offsets: list[int] = []
    for i, layer in enumerate(reg.layers):
        if isinstance(layer.memory, CudaSpec):
            memories.append(map_cuda_storage(f"layers[{i}].memory", layer.memory, extent(layer)))
            offsets.append(layer.memory.offset)
            # page-locked once, here and not under the engine's lock (a large pool takes a second or more)
            cuda_runtime().pin(arena.bytes.ctypes.data, arena.size)
        else:
            memory, offset = next(shm)
            memories.append(memory)
            offsets.append(offset)
    return memories, offsets


def plan_copies(
    workers: dict[tuple[int, int], Worker], sealed: SealedInstance, max_page_bytes: int, arena: Arena
) -> dict[tuple[int, int], dict[tuple[int, int], WorkerCopier]]:
    """Per worker, the copiers of a sealed instance: one per (group, table) the worker holds layers of, each moving
    those layers' slots of the group's pages (pure: raises before anything is changed)."""
    for part in sealed.parts:
        if part.layout.page_bytes > max_page_bytes:
            layout = part.layout
            what = "this layout" if len(sealed.parts) == 1 else f"group {part.group} of this layout"
            raise ResourceExhausted(
                f"a page of {what} holds {layout.page_bytes} bytes ({layout.num_slots} slots) but the pool's "
                f"largest page is {max_page_bytes} bytes: raise --pool-size (and --slab-size)"
            )
    copiers = {}
    for key, worker in workers.items():
        sources: dict[tuple[int, int], list[SlotSource]] = {}
        for layer, memory, offset in zip(worker.registration.layers, worker.memories, worker.offsets, strict=True):
            g = layer.geometry
            part = sealed.parts[g.group_id]
            slot = part.layout.slot(part.layer_ids[g.name], key[0])
            sources.setdefault((g.group_id, layer.table), []).append(
                SlotSource(
                    memory=memory,
                    src_offset=offset,
                    block_stride=layer.strides[0],
                    segment_stride=layer.strides[1] if g.segments == 2 else 0,
                    num_blocks=layer.num_blocks,
                    segments=g.segments,
                    segment_bytes=g.segment_bytes,
                    dst_offset=part.layout.slot_offsets[slot],
                )
            )
        copiers[key] = {
            (group, table): WorkerCopier(run, arena.bytes, page_stride(sealed.parts[group].layout.page_bytes))
            for (group, table), run in sources.items()
        }
    return copiers


def extent(layer: LayerRegistration) -> int:
    g = layer.geometry
    return layer_extent(layer.num_blocks, g.segments, g.segment_bytes, layer.strides)
