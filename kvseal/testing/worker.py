"""One worker rank registered with an engine, the ritual tests and benchmarks repeat: KV layers that are numpy views
into one sealed memfd (kvseal.memfd.SharedArray), described and registered as tp_rank `tp_rank` of an instance of
`world_size` ranks (tp_size = world_size, one pipeline stage).

    shared = SharedArray((num_blocks, 4096))
    status = register_one_rank(client, "w", shared, namespace="llama", layout_tag="t", dtype="uint8")
    client.save(("w", 0, 0), hashes, block_ids)

`engine` is an EngineClient (over the running engine's local lane; the client's connection is the worker's session)
or, in-process, a kvseal.engine.engine.Engine with the `session` the worker registers in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from kvseal.client import EngineClient, layer_from_array
from kvseal.core.layout import KvGroup
from kvseal.memfd import SharedArray

if TYPE_CHECKING:
    from kvseal.engine.engine import Engine, Session

DEFAULT_LAYER = "model.layers.0.attn"


def register_one_rank(
    engine: EngineClient | Engine,
    instance_id: str,
    memory: SharedArray,
    layers: Mapping[str, np.ndarray] | None = None,
    *,
    namespace: str,
    layout_tag: str,
    dtype: str,
    block_size: int = 16,
    tp_rank: int = 0,
    world_size: int = 1,
    session: Session | None = None,
    groups: Sequence[tuple[str, int, int]] = (),
    group_ids: Mapping[str, int] | None = None,
    tables: Mapping[str, int] | None = None,
    eagle_groups: Sequence[int] = (),
) -> Any:
    """Registers one rank whose layers are `layers` (name -> a [num_blocks, ...] view into `memory`, in layer order;
    default: one layer DEFAULT_LAYER that is the whole of memory.array) and returns the instance's status
    (pb.InstanceStatus from a client, kvseal.engine.engine.InstanceStatus in-process): sealed once the last rank
    registered, with its namespace_final and page_bytes. The worker's key is (instance_id, tp_rank, 0). `groups`:
    the KV cache groups as (kind, block_size, span), `group_ids` a layer's group (default 0), `tables` which of its
    group's block tables addresses a layer (default 0), `eagle_groups` the groups a drafter reads. An engine that
    refuses raises the client's or the engine's kvseal.errors exception."""
    ids = dict(group_ids or {})
    table_of = dict(tables or {})
    views = dict(layers) if layers is not None else {DEFAULT_LAYER: memory.array}

    def _spec(name: str, array: np.ndarray) -> Any:
        spec = layer_from_array(name, array, memory, layout_tag=layout_tag, dtype=dtype, group_id=ids.get(name, 0))
        spec.table = table_of.get(name, 0)
        return spec

    if isinstance(engine, EngineClient):
        return engine.register(
            instance_id=instance_id,
            namespace=namespace,
            tp_rank=tp_rank,
            tp_size=world_size,
            pp_rank=0,
            world_size=world_size,
            block_size=block_size,
            layers=[_spec(name, array) for name, array in views.items()],
            groups=groups,
            eagle_groups=eagle_groups,
        )
    if session is None:
        raise TypeError("register_one_rank: an in-process Engine needs the session the worker registers in")
    reg = _worker_registration(
        views, memory, instance_id, namespace, layout_tag, dtype, block_size, tp_rank, world_size
    )
    kv_groups = tuple(KvGroup(*g) for g in groups)
    layers = tuple(
        replace(
            x,
            geometry=replace(x.geometry, group_id=ids.get(x.geometry.name, 0)),
            table=table_of.get(x.geometry.name, 0),
        )
        for x in reg.layers
    )
    registration = replace(reg, layers=layers, groups=kv_groups, eagle_groups=tuple(eagle_groups))
    return engine.register(registration, session, [memory.fd])


def _worker_registration(
    views: Mapping[str, np.ndarray],
    memory: SharedArray,
    instance_id: str,
    namespace: str,
    layout_tag: str,
    dtype: str,
    block_size: int,
    tp_rank: int,
    world_size: int,
) -> Any:
    """The WorkerRegistration the lane would decode from the same layers (the memfd is descriptor 0)."""
    from kvseal.core.layout import LayerGeometry, LayerRegistration, WorkerRegistration
    from kvseal.engine.memory import ShmSpec

    layers = []
    for name, array in views.items():
        spec = layer_from_array(name, array, memory, layout_tag=layout_tag, dtype=dtype)  # checks the view
        geometry = LayerGeometry(name, dtype, spec.segment_bytes, 1, 0, layout_tag)
        memory_spec = ShmSpec(0, spec.memory.shm.offset, memory.region.size)
        layers.append(LayerRegistration(geometry, spec.num_blocks, tuple(spec.strides), memory_spec))
    return WorkerRegistration(instance_id, namespace, tp_rank, world_size, 0, world_size, block_size, tuple(layers))
