"""Registration, seal and the layout fingerprint (kvseal.core.layout, docs/design.md §2)."""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re
from collections import Counter
from dataclasses import dataclass, replace

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvseal.core.layout import (
    GROUP_KINDS,
    SPAN_KINDS,
    InstanceRegistry,
    KvGroup,
    LayerGeometry,
    LayerRegistration,
    SealedInstance,
    WorkerRegistration,
    build_layout,
    diff_layouts,
    explain_difference,
    layout_from_descriptor,
)
from kvseal.errors import FailedPrecondition, InvalidArgument

DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "int8")
TAGS = ("cpu_attn.avx512", "cpu_attn.amx", "flash_attn.nhd", "flash_attn.hnd", "mla.latent")
NAMESPACES = ("default", "llama3-8b", "team/a:prod", "qwen2.5@v1")

PROPERTY_SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------------------------------ instance model


@dataclass(frozen=True)
class InstanceSpec:
    """Everything that defines a valid instance. Node-local facts are drawn when registrations are built."""

    instance_id: str
    namespace: str
    tp_size: int
    pp_size: int
    block_size: int
    geometries: tuple[LayerGeometry, ...]
    stage_of: dict[str, int]  # layer name -> the pp stage that owns it
    groups: tuple[KvGroup, ...] = ()  # none: one full-attention group; else every group holds a layer

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def geometry(self, name: str) -> LayerGeometry:
        return next(g for g in self.geometries if g.name == name)

    def with_geometry(self, name: str, **changes: object) -> InstanceSpec:
        geometries = tuple(replace(g, **changes) if g.name == name else g for g in self.geometries)
        return replace(self, geometries=geometries)


def layer_registration(g: LayerGeometry, rnd: random.Random) -> LayerRegistration:
    num_blocks = rnd.randint(1, 5000)
    block_stride = g.segment_bytes * rnd.randint(1, 3) * (g.segments if rnd.random() < 0.5 else 1)
    strides: tuple[int, ...] = (block_stride,)
    if g.segments == 2:
        strides += (max(g.segment_bytes, block_stride * num_blocks * rnd.randint(0, 1)),)
    memory = {"handle": rnd.getrandbits(64), "device": rnd.randint(0, 7)}
    return LayerRegistration(geometry=g, num_blocks=num_blocks, strides=strides, memory=memory)


def registrations(spec: InstanceSpec, rnd: random.Random) -> list[WorkerRegistration]:
    """One registration per worker, with random node-local facts, layer order and worker order."""
    workers = []
    for pp_rank in range(spec.pp_size):
        owned = [g for g in spec.geometries if spec.stage_of[g.name] == pp_rank]
        for tp_rank in range(spec.tp_size):
            layers = [layer_registration(g, rnd) for g in owned]
            rnd.shuffle(layers)
            workers.append(
                WorkerRegistration(
                    instance_id=spec.instance_id,
                    namespace=spec.namespace,
                    tp_rank=tp_rank,
                    tp_size=spec.tp_size,
                    pp_rank=pp_rank,
                    world_size=spec.world_size,
                    block_size=spec.block_size,
                    layers=tuple(layers),
                    groups=spec.groups,
                )
            )
    rnd.shuffle(workers)
    return workers


def seal_all(workers: list[WorkerRegistration]) -> SealedInstance:
    """Feeds every registration to a fresh registry; only the last one may seal."""
    registry = InstanceRegistry(workers[0].instance_id)
    for i, w in enumerate(workers):
        sealed = registry.add(w)
        if i < len(workers) - 1:
            assert sealed is None
            assert registry.sealed is None
    assert sealed is not None and registry.sealed is sealed
    return sealed


def summary(s: SealedInstance) -> tuple[object, ...]:
    return (s.layer_ids, s.layout.descriptor, s.layout.digest, s.layout.fingerprint, s.namespace_final)


def geometry_for(draw: st.DrawFn, name: str, group_id: int) -> LayerGeometry:
    return LayerGeometry(
        name=name,
        dtype=draw(st.sampled_from(DTYPES)),
        segment_bytes=draw(st.integers(1, 1 << 16)),
        segments=draw(st.sampled_from((1, 2))),
        group_id=group_id,
        layout_tag=draw(st.sampled_from(TAGS)),
    )


@st.composite
def kv_groups(draw: st.DrawFn, block_size: int) -> KvGroup:
    kind = draw(st.sampled_from(GROUP_KINDS))
    span = draw(st.integers(2 if kind == "sliding" else 1, 1 << 16)) if kind in SPAN_KINDS else 0
    return KvGroup(kind, draw(st.sampled_from((block_size, 2 * block_size, 17 * block_size))), span)


layer_names = st.one_of(
    st.integers(0, 63).map(lambda i: f"model.layers.{i}.self_attn.attn"),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789._", min_size=1, max_size=12),
)


def stage_split(draw: st.DrawFn, names: list[str], pp_size: int) -> dict[str, int]:
    """Each layer owned by exactly one stage, every stage owning at least one layer."""
    stages = [i % pp_size for i in range(len(names))]
    order = draw(st.permutations(stages))
    return dict(zip(names, order, strict=True))


@st.composite
def instance_specs(draw: st.DrawFn) -> InstanceSpec:
    tp_size = draw(st.integers(1, 4))
    pp_size = draw(st.integers(1, 2))
    # at least pp_size + 1 layers, so some stage owns two and a layer can be removed without emptying a stage
    block_size = draw(st.sampled_from((1, 16, 32, 64, 128)))
    groups = tuple(draw(st.lists(kv_groups(block_size), max_size=3)))
    names = draw(st.lists(layer_names, min_size=max(pp_size + 1, len(groups)), max_size=7, unique=True))
    group_ids = draw(st.permutations([i % max(len(groups), 1) for i in range(len(names))]))  # every group a layer
    return InstanceSpec(
        instance_id=draw(st.sampled_from(("inst-a", "inst-b", "node3/vllm:0"))),
        namespace=draw(st.sampled_from(NAMESPACES)),
        tp_size=tp_size,
        pp_size=pp_size,
        block_size=block_size,
        geometries=tuple(geometry_for(draw, name, gid) for name, gid in zip(names, group_ids, strict=True)),
        stage_of=stage_split(draw, names, pp_size),
        groups=groups,
    )


seeds = st.randoms(use_true_random=False)


# ------------------------------------------------------------------------------------------ order invariance


@PROPERTY_SETTINGS
@given(spec=instance_specs(), rnd1=seeds, rnd2=seeds)
def test_any_registration_order_gives_the_same_seal(
    spec: InstanceSpec, rnd1: random.Random, rnd2: random.Random
) -> None:
    a = seal_all(registrations(spec, rnd1))
    b = seal_all(registrations(spec, rnd2))
    assert summary(a) == summary(b)
    assert a.layout == b.layout
    assert a.layer_ids == {name: i for i, name in enumerate(sorted(g.name for g in spec.geometries))}
    assert a.namespace_final == f"{spec.namespace}.{a.layout.fingerprint}"
    assert a.layout.fingerprint == a.layout.digest.hex()[:8]
    assert a.layout.digest == hashlib.sha256(a.layout.descriptor).digest()


@PROPERTY_SETTINGS
@given(spec=instance_specs(), rnd=seeds)
def test_layout_facts(spec: InstanceSpec, rnd: random.Random) -> None:
    workers = registrations(spec, rnd)
    sealed = seal_all(workers)
    layout = sealed.layout
    tp = spec.tp_size
    assert layout.page_bytes == tp * sum(g.slot_bytes for g in spec.geometries)
    assert layout.num_slots == tp * len(spec.geometries)
    offset = 0
    for layer_id, g in enumerate(layout.layers):
        assert sealed.layer_ids[g.name] == layer_id
        for tp_rank in range(tp):
            slot = layout.slot(layer_id, tp_rank)
            assert slot == layer_id * tp + tp_rank
            assert layout.slot_offsets[slot] == offset
            assert layout.slot_sizes[slot] == g.slot_bytes == g.segments * g.segment_bytes
            offset += g.slot_bytes
    assert offset == layout.page_bytes
    # each group is stored apart: its own layers, pages that add up to the layout's; one group is the layout itself
    parts = sealed.parts
    assert [p.group for p in parts] == list(range(len(layout.groups)))
    assert sum(p.layout.page_bytes for p in parts) == layout.page_bytes
    if len(parts) == 1:
        assert parts[0].layout == layout and parts[0].name == sealed.namespace_final
    for p in parts:
        in_group = [g.name for g in layout.layers if g.group_id == p.group]
        assert [g.name for g in p.layout.layers] == in_group and list(p.layer_ids) == in_group
        assert p.kind == layout.groups[p.group]
        assert len(parts) == 1 or p.name == f"{sealed.namespace_final}/g{p.group}"
        # every (layer, tp_rank) cell of a group's page is written by exactly one worker
        masks = [sealed.cell_mask(w.key, p.group) for w in workers]
        assert sum(masks) == (1 << p.layout.num_slots) - 1
        union = 0
        for m in masks:
            assert m & union == 0
            union |= m
    for w in workers:
        assert sorted(sealed.worker_layer_ids[w.key]) == sorted(
            sealed.layer_ids[layer.geometry.name] for layer in w.layers
        )


def test_slot_sizes_may_differ_between_layers() -> None:
    small = LayerGeometry("a.small", "bfloat16", 100, 1, 0, "t")
    big = LayerGeometry("b.big", "bfloat16", 300, 2, 1, "t")
    layout = build_layout(16, 2, [big, small])
    assert layout.slot_sizes == (100, 100, 600, 600)
    assert layout.slot_offsets == (0, 100, 200, 800)
    assert layout.page_bytes == 1400


# ------------------------------------------------------------------------------------------ what changes it


MUTATIONS = (
    "segment_bytes",
    "segments",
    "dtype",
    "layout_tag",
    "group_id",
    "groups",
    "add_mtp_layer",
    "remove_layer",
    "block_size",
    "tp_size",
)


def mutate(spec: InstanceSpec, mutation: str, draw: st.DrawFn) -> InstanceSpec:
    name = draw(st.sampled_from([g.name for g in spec.geometries]))
    g = spec.geometry(name)
    if mutation == "segment_bytes":
        return spec.with_geometry(
            name, segment_bytes=draw(st.integers(1, 1 << 16).filter(lambda v: v != g.segment_bytes))
        )
    if mutation == "segments":
        return spec.with_geometry(name, segments=3 - g.segments)
    if mutation == "dtype":
        return spec.with_geometry(name, dtype=draw(st.sampled_from([d for d in DTYPES if d != g.dtype])))
    if mutation == "layout_tag":
        return spec.with_geometry(name, layout_tag=draw(st.sampled_from([t for t in TAGS if t != g.layout_tag])))
    if mutation == "group_id":  # a layer moves to another group, leaving none empty
        members = Counter(x.group_id for x in spec.geometries)
        movable = [x.name for x in spec.geometries if members[x.group_id] > 1]
        assume(len(spec.groups) > 1 and movable)
        name = draw(st.sampled_from(movable))
        others = [i for i in range(len(spec.groups)) if i != spec.geometry(name).group_id]
        return spec.with_geometry(name, group_id=draw(st.sampled_from(others)))
    if mutation == "groups":  # vLLM's hybrid manager on (a window) where it was off, or one group otherwise
        if not spec.groups:
            return replace(spec, groups=(KvGroup("sliding", spec.block_size, draw(st.integers(2, 4096))),))
        i = draw(st.integers(0, len(spec.groups) - 1))
        other = draw(kv_groups(spec.block_size).filter(lambda k: k != spec.groups[i]))
        return replace(spec, groups=spec.groups[:i] + (other,) + spec.groups[i + 1 :])
    if mutation == "add_mtp_layer":
        n = 64
        while f"model.layers.{n}.self_attn.attn" in spec.stage_of:
            n += 1
        drafter = replace(g, name=f"model.layers.{n}.self_attn.attn")
        return replace(
            spec,
            geometries=(*spec.geometries, drafter),
            stage_of={**spec.stage_of, drafter.name: spec.pp_size - 1},  # the drafter sits in the last stage
        )
    if mutation == "remove_layer":
        per_stage = {s: sum(1 for v in spec.stage_of.values() if v == s) for s in range(spec.pp_size)}
        members = Counter(x.group_id for x in spec.geometries)  # no stage nor group left empty
        removable = sorted(
            n for n, s in spec.stage_of.items() if per_stage[s] > 1 and members[spec.geometry(n).group_id] > 1
        )
        assume(removable)
        victim = draw(st.sampled_from(removable))
        return replace(
            spec,
            geometries=tuple(x for x in spec.geometries if x.name != victim),
            stage_of={k: v for k, v in spec.stage_of.items() if k != victim},
        )
    if mutation == "block_size":
        return replace(
            spec,  # the hash's block: every group's block size stays a multiple of it (1 always is)
            block_size=draw(
                st.sampled_from((1, 8, 16, 32, 256)).filter(
                    lambda v: v != spec.block_size and all(k.block_size % v == 0 for k in spec.groups)
                )
            ),
        )
    if mutation == "tp_size":
        return replace(spec, tp_size=draw(st.integers(1, 4).filter(lambda v: v != spec.tp_size)))
    raise AssertionError(mutation)


@PROPERTY_SETTINGS
@given(spec=instance_specs(), mutation=st.sampled_from(MUTATIONS), data=st.data(), rnd1=seeds, rnd2=seeds)
def test_layout_changes_change_the_fingerprint(
    spec: InstanceSpec, mutation: str, data: st.DataObject, rnd1: random.Random, rnd2: random.Random
) -> None:
    changed = mutate(spec, mutation, data.draw)
    a = seal_all(registrations(spec, rnd1))
    b = seal_all(registrations(changed, rnd2))
    assert a.layout.descriptor != b.layout.descriptor
    assert a.layout.digest != b.layout.digest
    assert a.layout.fingerprint != b.layout.fingerprint
    assert a.namespace_final != b.namespace_final


# what diff_layouts reports for each mutation: (field, whether it names a layer)
_DIFF_OF = {
    "add_mtp_layer": ("layer", True),
    "remove_layer": ("layer", True),
    "block_size": ("block_size", False),
    "tp_size": ("tp_size", False),
}


@PROPERTY_SETTINGS
@given(spec=instance_specs(), mutation=st.sampled_from(MUTATIONS), data=st.data(), rnd1=seeds, rnd2=seeds)
def test_the_difference_of_two_layouts_names_what_was_changed(  # noqa: C901
    spec: InstanceSpec, mutation: str, data: st.DataObject, rnd1: random.Random, rnd2: random.Random
) -> None:
    changed = mutate(spec, mutation, data.draw)
    a = seal_all(registrations(spec, rnd1)).layout
    b = seal_all(registrations(changed, rnd2)).layout
    assert diff_layouts(a, a) == [] and explain_difference(a, b, "P", "D") != ""
    diffs = diff_layouts(a, b)
    field, names_layer = _DIFF_OF.get(mutation, (mutation, True))
    if mutation == "groups":  # the group list's length changed ("groups"), or one group ("group N")
        field = "groups" if len(a.groups) != len(b.groups) else diffs[0].field
        assert field.startswith("group") and not diffs[0].layer
        names_layer = False
    expected = [field]
    implied = [x.groups == (KvGroup("full", x.block_size),) for x in (spec, changed)]
    if mutation == "block_size" and implied[0] != implied[1]:
        # one full group of one side's block size is implied there (format 1) and listed on the other side
        expected.append("groups")
    assert [d.field for d in diffs] == expected  # exactly the change: a layer added shifts no other layer's id
    assert bool(diffs[0].layer) == names_layer
    if mutation == "add_mtp_layer":
        [extra] = {g.name for g in b.layers} - {g.name for g in a.layers}
        assert explain_difference(a, b, "P", "D") == f"layer {extra!r} only in D"
    assert [(d.field, d.layer) for d in diff_layouts(b, a)] == [(d.field, d.layer) for d in diffs]  # symmetric


@PROPERTY_SETTINGS
@given(spec=instance_specs(), data=st.data(), rnd1=seeds, rnd2=seeds)
def test_node_local_facts_and_pp_split_do_not_change_the_fingerprint(
    spec: InstanceSpec, data: st.DataObject, rnd1: random.Random, rnd2: random.Random
) -> None:
    names = [g.name for g in spec.geometries]
    pp_size = data.draw(st.integers(1, min(2, len(names))))
    resplit = replace(spec, pp_size=pp_size, stage_of=stage_split(data.draw, names, pp_size))
    a = seal_all(registrations(spec, rnd1))
    b = seal_all(registrations(resplit, rnd2))  # other num_blocks, strides, memory, orders and pp split
    assert summary(a) == summary(b)
    assert a.layout == b.layout


# ------------------------------------------------------------------------------------------ golden


GOLDEN_DESCRIPTOR = (
    b'{"block_size":16,"format":1,"layers":['
    b'["model.layers.0.self_attn.attn","bfloat16",16384,2,0,"cpu_attn.avx512"],'
    b'["model.layers.1.self_attn.attn","bfloat16",16384,2,0,"cpu_attn.avx512"]'
    b'],"tp_size":2}'
)
GOLDEN_DIGEST = "b1f66478659714e7448d0e2a55e1f1a24368096bd668b031854607580f0d943b"
GOLDEN_FINGERPRINT = "b1f66478"


def test_golden_descriptor_and_fingerprint() -> None:
    """If this fails the descriptor algorithm changed: every stored block would become unreachable."""
    layers = [
        LayerGeometry("model.layers.1.self_attn.attn", "bfloat16", 16384, 2, 0, "cpu_attn.avx512"),
        LayerGeometry("model.layers.0.self_attn.attn", "bfloat16", 16384, 2, 0, "cpu_attn.avx512"),
    ]
    layout = build_layout(16, 2, layers)
    assert layout.descriptor == GOLDEN_DESCRIPTOR
    assert layout.digest.hex() == GOLDEN_DIGEST
    assert layout.fingerprint == GOLDEN_FINGERPRINT
    assert layout.page_bytes == 131072
    assert layout.slot_offsets == (0, 32768, 65536, 98304)
    assert build_layout(16, 2, list(reversed(layers))) == layout


def test_golden_through_registration() -> None:
    def reg(tp_rank: int) -> WorkerRegistration:
        layers = tuple(
            LayerRegistration(
                LayerGeometry(f"model.layers.{i}.self_attn.attn", "bfloat16", 16384, 2, 0, "cpu_attn.avx512"),
                num_blocks=100,
                strides=(16384, 16384 * 100),
            )
            for i in (0, 1)
        )
        return WorkerRegistration("vllm-0", "llama", tp_rank, 2, 0, 2, 16, layers)

    sealed = seal_all([reg(1), reg(0)])
    assert sealed.namespace_final == f"llama.{GOLDEN_FINGERPRINT}"
    assert sealed.layout.digest.hex() == GOLDEN_DIGEST


# ------------------------------------------------------------------------------------------ seal errors


def geo(name: str, segment_bytes: int = 1024, **kw: object) -> LayerGeometry:
    fields = {"dtype": "bfloat16", "segments": 2, "group_id": 0, "layout_tag": "cpu_attn.avx512", **kw}
    return LayerGeometry(name, segment_bytes=segment_bytes, **fields)  # type: ignore[arg-type]


def lreg(g: LayerGeometry, num_blocks: int = 64) -> LayerRegistration:
    strides = (g.segment_bytes,) if g.segments == 1 else (g.segment_bytes, g.segment_bytes * num_blocks)
    return LayerRegistration(g, num_blocks=num_blocks, strides=strides)


def wreg(
    tp_rank: int,
    layers: list[LayerGeometry],
    *,
    tp_size: int = 2,
    pp_rank: int = 0,
    world_size: int = 2,
    block_size: int = 16,
    instance_id: str = "inst",
    namespace: str = "ns",
    groups: tuple[KvGroup, ...] = (),
) -> WorkerRegistration:
    return WorkerRegistration(
        instance_id,
        namespace,
        tp_rank,
        tp_size,
        pp_rank,
        world_size,
        block_size,
        tuple(lreg(g) for g in layers),
        groups,
    )


L0, L1, L2 = geo("model.layers.0.attn"), geo("model.layers.1.attn"), geo("model.layers.2.attn")


def assert_unchanged(registry: InstanceRegistry, workers: dict[tuple[int, int], WorkerRegistration]) -> None:
    assert registry.sealed is None
    assert registry.workers == workers


def test_missing_owner_names_layer_and_rank_and_retry_seals() -> None:
    registry = InstanceRegistry("inst")
    good0 = wreg(0, [L0, L1, L2])
    assert registry.add(good0) is None
    before = dict(registry.workers)
    with pytest.raises(FailedPrecondition) as exc:
        registry.add(wreg(1, [L0, L2]))  # tp_rank 1 forgot layer 1
    assert "model.layers.1.attn" in str(exc.value)
    assert "tp_rank 1" in str(exc.value)
    assert exc.value.status == "FAILED_PRECONDITION"
    assert_unchanged(registry, before)
    assert registry.progress() == "1/2 workers registered"
    sealed = registry.add(wreg(1, [L2, L1, L0]))
    assert sealed is not None and registry.sealed is sealed
    assert sealed.layer_ids == {"model.layers.0.attn": 0, "model.layers.1.attn": 1, "model.layers.2.attn": 2}


@pytest.mark.parametrize(
    ("field_name", "changes"),
    [
        ("segment_bytes", {"segment_bytes": 2048}),
        ("segments", {"segments": 1}),
        ("dtype", {"dtype": "float16"}),
        ("group_id", {"group_id": 0}),
        ("layout_tag", {"layout_tag": "cpu_attn.amx"}),
    ],
)
def test_inconsistent_geometry_names_the_field(field_name: str, changes: dict[str, object]) -> None:
    groups = (KvGroup("full", 16), KvGroup("sliding", 16, 1024))  # layer 1 in the sliding window group
    L1 = geo("model.layers.1.attn", group_id=1)  # noqa: N806
    registry = InstanceRegistry("inst")
    registry.add(wreg(0, [L0, L1], groups=groups))
    before = dict(registry.workers)
    with pytest.raises(FailedPrecondition) as exc:
        registry.add(wreg(1, [L0, replace(L1, **changes)], groups=groups))
    message = str(exc.value)
    assert field_name in message
    assert "model.layers.1.attn" in message
    assert "tp_rank 1" in message and "tp_rank 0" in message
    assert_unchanged(registry, before)
    assert registry.add(wreg(1, [L0, L1], groups=groups)) is not None


@pytest.mark.parametrize(
    ("field_name", "kw"),
    [("block_size", {"block_size": 32}), ("namespace", {"namespace": "other"}), ("world_size", {"world_size": 4})],
)
def test_instance_wide_disagreement_names_the_field(field_name: str, kw: dict[str, object]) -> None:
    registry = InstanceRegistry("inst")
    registry.add(wreg(0, [L0]))
    before = dict(registry.workers)
    with pytest.raises(FailedPrecondition, match=field_name):
        registry.add(wreg(1, [L0], **kw))  # type: ignore[arg-type]
    assert_unchanged(registry, before)
    assert registry.add(wreg(1, [L0])) is not None


def test_same_layer_from_two_pipeline_stages_is_refused() -> None:
    registry = InstanceRegistry("inst")
    kw = {"tp_size": 1, "world_size": 2}
    registry.add(wreg(0, [L0, L1], pp_rank=0, **kw))  # type: ignore[arg-type]
    before = dict(registry.workers)
    with pytest.raises(FailedPrecondition) as exc:
        registry.add(wreg(0, [L1, L2], pp_rank=1, **kw))  # type: ignore[arg-type]
    assert "pipeline stage" in str(exc.value)
    assert "model.layers.1.attn" in str(exc.value)
    assert_unchanged(registry, before)
    sealed = registry.add(wreg(0, [L2], pp_rank=1, **kw))  # type: ignore[arg-type]
    assert sealed is not None
    assert sealed.worker_layer_ids == {(0, 0): (0, 1), (0, 1): (2,)}


def test_failed_seal_when_the_faulty_worker_arrived_first() -> None:
    registry = InstanceRegistry("inst")
    bad1 = wreg(1, [L0])
    registry.add(bad1)
    with pytest.raises(FailedPrecondition, match="tp_rank 1"):
        registry.add(wreg(0, [L0, L1]))
    assert_unchanged(registry, {(1, 0): bad1})
    assert registry.add(wreg(1, [L0, L1])) is None  # replaces the faulty registration
    assert registry.add(wreg(0, [L0, L1])) is not None


def test_reregistration_replaces_and_remove_unseals() -> None:
    registry = InstanceRegistry("inst")
    registry.add(wreg(0, [L0, L1]))
    first = registry.add(wreg(1, [L0, L1]))
    assert first is not None
    again = registry.add(wreg(1, [L1, L0]))  # the same worker registering again: still sealed, same layout
    assert again is not None and again.layout == first.layout and len(registry.workers) == 2
    assert registry.remove((1, 0)) is True
    assert registry.sealed is None
    assert registry.progress() == "1/2 workers registered"
    assert registry.remove((1, 0)) is False
    resealed = registry.add(wreg(1, [L0, L1]))
    assert resealed is not None and resealed.namespace_final == first.namespace_final


def _layer(i: int = 0, *, num_blocks: int = 64, strides: tuple[int, ...] = (1024, 65536)) -> LayerRegistration:
    return LayerRegistration(geo(f"model.layers.{i}.attn"), num_blocks=num_blocks, strides=strides)


def _bad_geometry(**changes: object) -> tuple[LayerRegistration, ...]:
    g = replace(geo("model.layers.0.attn"), **changes)
    strides = (4096,) if g.segments == 1 else (4096, 4096 * 64)
    return (LayerRegistration(g, num_blocks=64, strides=strides),)


BASE = wreg(0, [L0, L1])

BAD_FIELDS = [
    ("instance_id", {"instance_id": ""}),
    ("instance_id", {"instance_id": "has space"}),
    ("namespace", {"namespace": ""}),
    ("namespace", {"namespace": "bad namespace!"}),
    ("tp_size", {"tp_size": 0}),
    ("tp_rank", {"tp_rank": 2}),
    ("tp_rank", {"tp_rank": 5}),
    ("world_size", {"world_size": 3}),
    ("world_size", {"world_size": 0}),
    ("pp_rank", {"pp_rank": 1}),
    ("pp_rank", {"pp_rank": 2, "world_size": 4}),
    ("block_size", {"block_size": 0}),
    ("layers", {"layers": ()}),
    ("layers[1].name", {"layers": (_layer(0), _layer(0))}),
    ("layers[0].segments", {"layers": _bad_geometry(segments=3)}),
    ("layers[0].strides", {"layers": (_layer(0, strides=(1024,)),)}),
    ("layers[0].strides", {"layers": (_layer(0, strides=(1024, 65536, 1)),)}),
    ("layers[0].segment_bytes", {"layers": _bad_geometry(segment_bytes=0)}),
    ("layers[0].strides[0]", {"layers": (_layer(0, strides=(512, 65536)),)}),
    ("layers[0].strides[1]", {"layers": (_layer(0, strides=(2048, 512)),)}),
    ("layers[0].num_blocks", {"layers": (_layer(0, num_blocks=0),)}),
    ("layers[0].dtype", {"layers": _bad_geometry(dtype="torch.bfloat16")}),
    ("layers[0].dtype", {"layers": _bad_geometry(dtype="BF16")}),
    ("layers[0].dtype", {"layers": _bad_geometry(dtype="")}),
    ("layers[0].name", {"layers": _bad_geometry(name="has space")}),
    ("layers[0].layout_tag", {"layers": _bad_geometry(layout_tag="")}),
    ("layers[0].group_id", {"layers": _bad_geometry(group_id=2**32)}),
]


@pytest.mark.parametrize(("field_name", "changes"), BAD_FIELDS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_FIELDS)])
def test_field_validation_names_the_field(field_name: str, changes: dict[str, object]) -> None:
    registry = InstanceRegistry("inst")
    registry.add(wreg(1, [L0, L1]))
    before = dict(registry.workers)
    with pytest.raises(InvalidArgument) as exc:
        registry.add(dataclasses.replace(BASE, **changes))  # type: ignore[arg-type]
    assert field_name in str(exc.value)
    assert exc.value.status == "INVALID_ARGUMENT"
    assert_unchanged(registry, before)


def test_single_block_layer_may_have_any_block_stride() -> None:
    layer = _layer(0, num_blocks=1, strides=(0, 1024))
    sealed = InstanceRegistry("inst").add(replace(BASE, tp_size=1, world_size=1, layers=(layer,)))
    assert sealed is not None


def test_registration_for_another_instance_is_refused() -> None:
    registry = InstanceRegistry("other")
    with pytest.raises(InvalidArgument, match="instance_id"):
        registry.add(BASE)
    assert registry.workers == {} and registry.sealed is None


# ------------------------------------------------------------------------------------------ KV cache groups

GEMMA = (KvGroup("sliding", 16, 1024), KvGroup("full", 16))  # 5 sliding-window layers : 1 full


def gemma_layers(*, window_group: int = 0) -> list[LayerGeometry]:
    return [geo(f"model.layers.{i}.attn", group_id=window_group if i % 6 else 1 - window_group) for i in range(6)]


def test_no_groups_and_one_full_group_are_todays_format_1_layout() -> None:
    layers = [geo("model.layers.0.attn"), geo("model.layers.1.attn")]
    implicit = build_layout(16, 2, layers)
    explicit = build_layout(16, 2, layers, (KvGroup("full", 16),))
    assert implicit == explicit and implicit.descriptor == explicit.descriptor
    assert b'"format":1' in implicit.descriptor and b"groups" not in implicit.descriptor
    assert implicit.groups == (KvGroup("full", 16),)


def test_hybrid_groups_are_sealed_into_format_2_and_read_back() -> None:
    hybrid = build_layout(16, 1, gemma_layers(), GEMMA)
    assert b'"format":2' in hybrid.descriptor and b'"groups":[["sliding",16,1024],["full",16,0]]' in hybrid.descriptor
    assert layout_from_descriptor(hybrid.descriptor) == hybrid
    tampered = hybrid.descriptor.replace(b'["sliding",16,1024]', b'["sliding",16,1025]')
    assert layout_from_descriptor(tampered) is not None  # another canonical layout: another digest
    assert layout_from_descriptor(tampered).digest != hybrid.digest  # type: ignore[union-attr]
    assert layout_from_descriptor(hybrid.descriptor.replace(b'"format":2', b'"format":3')) is None


def test_hybrid_manager_on_or_off_and_another_window_never_share_blocks() -> None:
    """vLLM with its hybrid manager off promotes every window layer to full attention: one group."""
    on = seal_all([wreg(0, gemma_layers(), tp_size=1, world_size=1, groups=GEMMA)])
    off = seal_all([wreg(0, [replace(g, group_id=0) for g in gemma_layers()], tp_size=1, world_size=1)])
    wider = (KvGroup("sliding", 16, 4096), GEMMA[1])
    other_window = seal_all([wreg(0, gemma_layers(), tp_size=1, world_size=1, groups=wider)])
    names = {on.namespace_final, off.namespace_final, other_window.namespace_final}
    assert len(names) == 3
    assert explain_difference(on.layout, other_window.layout, "P", "D") == (
        "group 0: P 'sliding 1024 x16', D 'sliding 4096 x16'"
    )
    assert [d.field for d in diff_layouts(on.layout, off.layout)][0] == "groups"
    assert "one full-attention group" in explain_difference(on.layout, off.layout, "P", "D")


@pytest.mark.parametrize(
    ("groups", "group_id", "error"),
    [
        ((KvGroup("dense", 16),), 0, "groups[0].kind must be one of full, sliding, chunked, mamba"),
        ((KvGroup("sliding", 16, 1),), 0, "groups[0].span (the window, in tokens) must be in 2.."),
        ((KvGroup("chunked", 16, 0),), 0, "groups[0].span (the chunk, in tokens) must be in 1.."),
        ((KvGroup("full", 16, 8),), 0, "groups[0].span must be 0 for a full group, got 8"),
        ((KvGroup("mamba", 0),), 0, "groups[0].block_size must be in 1.."),
        ((KvGroup("full", 16),), 1, "layers[0].group_id 1 names no group: 1 listed"),
        ((), 1, "layers[0].group_id 1 names no group: 0 listed (none listed: one full-attention group, id 0)"),
        ((KvGroup("full", 16),) * 65, 0, "groups: at most 64 KV cache groups, got 65"),
    ],
)
def test_a_group_that_cannot_be_served_is_refused_naming_the_field(
    groups: tuple[KvGroup, ...], group_id: int, error: str
) -> None:
    reg = wreg(0, [geo("model.layers.0.attn", group_id=group_id)], tp_size=1, world_size=1, groups=groups)
    with pytest.raises(InvalidArgument, match=re.escape(error)):
        InstanceRegistry("inst").add(reg)


def test_a_group_without_a_layer_is_refused_at_seal_and_workers_must_agree_on_groups() -> None:
    with pytest.raises(FailedPrecondition, match=r"group 1 \(full x16\) has no layer"):
        seal_all([wreg(0, [geo("model.layers.0.attn")], tp_size=1, world_size=1, groups=GEMMA)])
    registry = InstanceRegistry("inst")
    registry.add(wreg(0, gemma_layers(), groups=GEMMA))
    with pytest.raises(FailedPrecondition, match="groups"):
        registry.add(wreg(1, gemma_layers(), groups=(GEMMA[0], KvGroup("full", 32))))
