"""Registration, seal and the layout fingerprint (docs/design.md §2). Pure: no I/O, no clocks.

Theory of operation
-------------------
Each worker of an inference instance sends one `WorkerRegistration` listing every KV layer it holds. An
`InstanceRegistry` collects them. Each arrival is checked on its own (field by field) and against what the other
workers already registered (instance-wide fields, per-name geometry, pipeline stage); a registration that fails
is rejected and leaves the registry as it was. When `world_size` workers are present the registry seals:

    names      = sorted(union of all registered layer names)       -> dense ids 0..L-1
    grid       = [layer][tp_rank] must each have an owner           -> error names layer and rank
    descriptor = canonical JSON of (format, block_size, tp_size, per layer in id order:
                 name, dtype, segment_bytes, segments, group_id, layout_tag; format 2 adds the KV cache
                 groups: per group its kind, block size and window or chunk, and a layer's group_id names one)
    digest     = sha256(descriptor); fingerprint = digest.hex()[:8]
    namespace_final = f"{namespace}.{fingerprint}"

Node-local facts (num_blocks, strides, memory handles, pp split) never enter the descriptor, so two instances
with the same layout on different hardware share blocks, and any layout difference separates them.

KV cache groups. A hybrid model's layers fall into groups whose blocks are hit by different rules: full attention
(every block of the prefix), a sliding window or a chunk of `span` tokens (only the blocks the window or chunk
still reads), Mamba-like state (the state at the end of the prefix). A registration lists its groups
(`KvGroup`); none listed is one full-attention group of block_size, today's layouts, whose descriptor stays
format 1 (their fingerprints and stored blocks do not change). Any other group list is format 2: the same model
with vLLM's hybrid manager on or off, or with another window, gets another namespace_final.

Each group's blocks are stored apart, as pages of that group's layers only (`StoragePart`): the store keeps them
under the namespace `namespace_final` when the layout has one group, else `namespace_final/g<index>` (a name no
client's namespace_final can take: those end in ".<fingerprint>"), with a layout of the group's layers alone. A
layer also names its block `table` within its group (node-local, not in the descriptor): vLLM gives each of its KV
cache groups a block table, and its groups of one spec, which kvseal merges into one, still address their blocks by
their own ids: table t of a group is the t-th of the vLLM groups merged into it (0 when there is one).

A page holds one slot per (layer_id, tp_rank), in that order:

    page = | L0 r0 | L0 r1 | ... | L0 r(T-1) | L1 r0 | ... | L(L-1) r(T-1) |
    slot(l, r) = segments_l * segment_bytes_l bytes (slot sizes may differ between layers)
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field, replace
from typing import Any

from kvseal.errors import FailedPrecondition, InvalidArgument, quote

DESCRIPTOR_FORMAT = 1  # one full-attention group
GROUPS_FORMAT = 2  # the descriptor lists the KV cache groups
GROUP_KINDS = ("full", "sliding", "chunked", "mamba")
SPAN_KINDS = ("sliding", "chunked")  # the kinds whose hit rule needs a span (window or chunk, in tokens)
MAX_GROUPS = 64
MAX_SPAN = 1 << 30
FINGERPRINT_HEX_CHARS = 8

MAX_TP_SIZE = 1024
MAX_WORLD_SIZE = 65536
MAX_BLOCK_SIZE = 1 << 20
MAX_LAYERS = 4096
MAX_SEGMENT_BYTES = 1 << 30
MAX_NAME_CHARS = 256
MAX_STRIDE = (1 << 63) - 1  # strides become numpy/torch (int64) strides

_NAME_RE = re.compile(r"^[\x21-\x7e]+$")  # printable ASCII, no spaces
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9._:/@+=-]+$")
_DTYPE_RE = re.compile(r"^[a-z0-9_]+$")


def normalize_dtype(dtype: str) -> str:
    """'torch.bfloat16' and 'bfloat16' name the same dtype."""
    return dtype.strip().lower().removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class LayerGeometry:
    """What the descriptor records about one layer: everything that decides what a slot's bytes mean."""

    name: str
    dtype: str
    segment_bytes: int
    segments: int
    group_id: int
    layout_tag: str

    @property
    def slot_bytes(self) -> int:
        return self.segments * self.segment_bytes

    def as_descriptor_entry(self) -> list[Any]:
        return [self.name, self.dtype, self.segment_bytes, self.segments, self.group_id, self.layout_tag]


@dataclass(frozen=True, slots=True)
class KvGroup:
    """One KV cache group: how a query hits its blocks. `span`: the window (sliding) or chunk (chunked) in tokens;
    0 for the other kinds. `block_size`: tokens per block of this group."""

    kind: str
    block_size: int
    span: int = 0

    def as_descriptor_entry(self) -> list[Any]:
        return [self.kind, self.block_size, self.span]


@dataclass(frozen=True, slots=True)
class LayerRegistration:
    """One layer as a worker holds it: geometry plus node-local placement. `memory` is opaque to the core."""

    geometry: LayerGeometry
    num_blocks: int
    strides: tuple[int, ...]
    memory: Any = field(default=None, compare=False)
    table: int = 0  # which of its group's block tables addresses this layer (vLLM: its KV cache group's)


@dataclass(frozen=True, slots=True)
class WorkerRegistration:
    instance_id: str
    namespace: str
    tp_rank: int
    tp_size: int
    pp_rank: int
    world_size: int
    block_size: int
    layers: tuple[LayerRegistration, ...]
    groups: tuple[KvGroup, ...] = ()  # none: one full-attention group of block_size
    eagle_groups: tuple[int, ...] = ()  # groups a drafter reads: a hit also needs the block after it

    @property
    def key(self) -> tuple[int, int]:
        return (self.tp_rank, self.pp_rank)

    def describe(self) -> str:
        return f"tp_rank {self.tp_rank} pp_rank {self.pp_rank}"


def validate_registration(reg: WorkerRegistration) -> None:
    """Field-level checks of one registration on its own. Raises InvalidArgument naming the field."""
    _check_text("instance_id", reg.instance_id, _NAME_RE)
    _check_text("namespace", reg.namespace, _NAMESPACE_RE)
    if not 1 <= reg.tp_size <= MAX_TP_SIZE:
        raise InvalidArgument(f"tp_size must be in 1..{MAX_TP_SIZE}, got {reg.tp_size}")
    if reg.tp_rank >= reg.tp_size:
        raise InvalidArgument(f"tp_rank {reg.tp_rank} must be below tp_size {reg.tp_size}")
    if not 1 <= reg.world_size <= MAX_WORLD_SIZE or reg.world_size % reg.tp_size:
        raise InvalidArgument(
            f"world_size must be a positive multiple of tp_size {reg.tp_size} (tp_size x pp_size), got {reg.world_size}"
        )
    if reg.pp_rank >= reg.world_size // reg.tp_size:
        raise InvalidArgument(
            f"pp_rank {reg.pp_rank} must be below pp_size {reg.world_size // reg.tp_size} "
            f"(world_size {reg.world_size} / tp_size {reg.tp_size})"
        )
    if not 1 <= reg.block_size <= MAX_BLOCK_SIZE:
        raise InvalidArgument(f"block_size (tokens per block) must be in 1..{MAX_BLOCK_SIZE}, got {reg.block_size}")
    if not reg.layers:
        raise InvalidArgument("layers must list at least one KV layer")
    if len(reg.layers) > MAX_LAYERS:
        raise InvalidArgument(f"layers: at most {MAX_LAYERS} layers per worker, got {len(reg.layers)}")
    if len(reg.groups) > MAX_GROUPS:
        raise InvalidArgument(f"groups: at most {MAX_GROUPS} KV cache groups, got {len(reg.groups)}")
    for i, group in enumerate(reg.groups):
        _validate_group(f"groups[{i}]", group)
        if group.block_size % reg.block_size:
            raise InvalidArgument(
                f"groups[{i}].block_size {group.block_size} must be a multiple of block_size {reg.block_size} (the "
                "tokens each block hash covers)"
            )
    for i, g in enumerate(reg.eagle_groups):
        if not 0 <= g < max(len(reg.groups), 1) or g in reg.eagle_groups[:i]:
            raise InvalidArgument(f"eagle_groups[{i}] {g} must name a listed group, once")
        if reg.groups and reg.groups[g].kind == "chunked":
            raise InvalidArgument(f"eagle_groups[{i}] {g} is chunked local attention, which no drafter reads in vLLM")
    seen: set[str] = set()
    for i, layer in enumerate(reg.layers):
        _validate_layer(f"layers[{i}]", layer)
        if layer.geometry.name in seen:
            raise InvalidArgument(f"layers[{i}].name {layer.geometry.name!r} is listed twice")
        seen.add(layer.geometry.name)
        if layer.geometry.group_id >= max(len(reg.groups), 1):
            raise InvalidArgument(
                f"layers[{i}].group_id {layer.geometry.group_id} names no group: {len(reg.groups)} listed"
                + ("" if reg.groups else " (none listed: one full-attention group, id 0)")
            )
        if not 0 <= layer.table < MAX_GROUPS:
            raise InvalidArgument(f"layers[{i}].table must be in 0..{MAX_GROUPS - 1}, got {layer.table}")


def _validate_group(where: str, group: KvGroup) -> None:
    if group.kind not in GROUP_KINDS:
        raise InvalidArgument(f"{where}.kind must be one of {', '.join(GROUP_KINDS)}, got {quote(group.kind)}")
    if not 1 <= group.block_size <= MAX_BLOCK_SIZE:
        raise InvalidArgument(f"{where}.block_size must be in 1..{MAX_BLOCK_SIZE}, got {group.block_size}")
    # a window of one token reads no earlier token (no model has one; vLLM's hit rule would lease a block for it)
    least = 2 if group.kind == "sliding" else 1
    if group.kind in SPAN_KINDS and not least <= group.span <= MAX_SPAN:
        what = "window" if group.kind == "sliding" else "chunk"
        raise InvalidArgument(f"{where}.span (the {what}, in tokens) must be in {least}..{MAX_SPAN}, got {group.span}")
    if group.kind not in SPAN_KINDS and group.span != 0:
        raise InvalidArgument(f"{where}.span must be 0 for a {group.kind} group, got {group.span}")


def _check_text(field_name: str, value: str, pattern: re.Pattern[str]) -> None:
    if not value:
        raise InvalidArgument(f"{field_name} must not be empty")
    if len(value) > MAX_NAME_CHARS or not pattern.fullmatch(value):
        raise InvalidArgument(
            f"{field_name} {quote(value)} must be at most {MAX_NAME_CHARS} characters matching {pattern.pattern}"
        )


def _validate_layer(where: str, layer: LayerRegistration) -> None:
    g = layer.geometry
    _check_text(f"{where}.name", g.name, _NAME_RE)
    _check_text(f"{where}.dtype", g.dtype, _DTYPE_RE)
    _check_text(f"{where}.layout_tag", g.layout_tag, _NAME_RE)
    if not 1 <= g.segment_bytes <= MAX_SEGMENT_BYTES:
        raise InvalidArgument(f"{where}.segment_bytes must be in 1..{MAX_SEGMENT_BYTES}, got {g.segment_bytes}")
    if g.segments not in (1, 2):
        raise InvalidArgument(f"{where}.segments must be 1 (page) or 2 (split K/V), got {g.segments}")
    if not 0 <= g.group_id < 2**32:
        raise InvalidArgument(f"{where}.group_id must fit in 32 bits, got {g.group_id}")
    if layer.num_blocks < 1:
        raise InvalidArgument(f"{where}.num_blocks must be at least 1, got {layer.num_blocks}")
    if len(layer.strides) != g.segments:
        raise InvalidArgument(
            f"{where}.strides must hold {g.segments} value(s) (block stride"
            f"{', segment stride' if g.segments == 2 else ''}), got {len(layer.strides)}"
        )
    for k, stride in enumerate(layer.strides):
        if stride > MAX_STRIDE:
            raise InvalidArgument(f"{where}.strides[{k}] must be at most {MAX_STRIDE} bytes, got {stride}")
    if layer.num_blocks > 1 and layer.strides[0] < g.segment_bytes:
        raise InvalidArgument(
            f"{where}.strides[0] (block stride {layer.strides[0]}) is smaller than segment_bytes {g.segment_bytes}: "
            "blocks would overlap"
        )
    if g.segments == 2 and layer.strides[1] < g.segment_bytes:
        raise InvalidArgument(
            f"{where}.strides[1] (segment stride {layer.strides[1]}) is smaller than segment_bytes "
            f"{g.segment_bytes}: K and V would overlap"
        )


@dataclass(frozen=True, slots=True)
class Layout:
    """A sealed layout: everything two instances must share to exchange pages. Identified by its digest."""

    block_size: int
    tp_size: int
    layers: tuple[LayerGeometry, ...]  # in dense id order
    descriptor: bytes
    digest: bytes
    slot_offsets: tuple[int, ...]  # (layer_id * tp_size + tp_rank) -> byte offset in the page
    slot_sizes: tuple[int, ...]
    page_bytes: int
    groups: tuple[KvGroup, ...] = ()  # never empty when built by build_layout
    fingerprint: str = field(init=False, repr=False, compare=False)  # digest.hex()[:8], computed once

    def __post_init__(self) -> None:
        object.__setattr__(self, "fingerprint", self.digest.hex()[:FINGERPRINT_HEX_CHARS])

    @property
    def num_slots(self) -> int:
        return len(self.slot_sizes)

    def slot(self, layer_id: int, tp_rank: int) -> int:
        return layer_id * self.tp_size + tp_rank


def build_layout(
    block_size: int,
    tp_size: int,
    layers: list[LayerGeometry] | tuple[LayerGeometry, ...],
    groups: tuple[KvGroup, ...] = (),
) -> Layout:
    """The layout of `layers` (any order; ids come from the sorted names) in KV cache `groups` (none: one
    full-attention group of block_size, written as format 1)."""
    ordered = tuple(sorted(layers, key=lambda g: g.name))
    groups = groups or (KvGroup("full", block_size),)
    doc: dict[str, Any] = {
        "format": DESCRIPTOR_FORMAT,
        "block_size": block_size,
        "tp_size": tp_size,
        "layers": [g.as_descriptor_entry() for g in ordered],
    }
    if groups != (KvGroup("full", block_size),):
        doc |= {"format": GROUPS_FORMAT, "groups": [g.as_descriptor_entry() for g in groups]}
    descriptor = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    offsets, sizes = [], []
    offset = 0
    for g in ordered:
        for _ in range(tp_size):
            offsets.append(offset)
            sizes.append(g.slot_bytes)
            offset += g.slot_bytes
    return Layout(
        block_size=block_size,
        tp_size=tp_size,
        layers=ordered,
        descriptor=descriptor,
        digest=hashlib.sha256(descriptor).digest(),
        slot_offsets=tuple(offsets),
        slot_sizes=tuple(sizes),
        page_bytes=offset,
        groups=groups,
    )


def layout_from_descriptor(descriptor: bytes) -> Layout | None:
    """The layout a canonical descriptor describes, or None when it is not one this code writes (another format
    version, or bytes that do not rebuild to themselves): such a descriptor can never be matched to a layout."""
    try:
        doc = json.loads(descriptor)
        if doc.get("format") not in (DESCRIPTOR_FORMAT, GROUPS_FORMAT):
            return None
        layers = [LayerGeometry(str(n), str(d), int(b), int(s), int(g), str(t)) for n, d, b, s, g, t in doc["layers"]]
        groups = tuple(KvGroup(str(k), int(b), int(n)) for k, b, n in doc.get("groups", ()))
        layout = build_layout(int(doc["block_size"]), int(doc["tp_size"]), layers, groups)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return layout if layout.descriptor == descriptor else None


@dataclass(frozen=True, slots=True)
class LayoutDifference:
    """One way two layouts differ: a field of the layout (`layer` empty), of one layer, or a layer on one side only
    (field "layer", the missing side None)."""

    field: str
    layer: str
    left: Any
    right: Any

    def describe(self, left_name: str, right_name: str) -> str:
        if self.field == "layer":
            side = left_name if self.right is None else right_name
            return f"layer {self.layer!r} only in {side}"
        where = f"layer {self.layer!r} " if self.layer else ""
        return f"{where}{self.field}: {left_name} {self.left!r}, {right_name} {self.right!r}"


_LAYER_FIELDS = ("dtype", "segment_bytes", "segments", "group_id", "layout_tag")


def diff_layouts(left: Layout, right: Layout) -> list[LayoutDifference]:
    """Every difference between two layouts, by name (not by dense id: an extra layer shifts every id after it).
    Empty exactly when their descriptors, hence digests, are equal."""
    out = [
        LayoutDifference(name, "", getattr(left, name), getattr(right, name))
        for name in ("block_size", "tp_size")
        if getattr(left, name) != getattr(right, name)
    ]
    lgroups, rgroups = _listed_groups(left), _listed_groups(right)
    if len(lgroups) != len(rgroups):
        out.append(LayoutDifference("groups", "", _groups_text(lgroups), _groups_text(rgroups)))
    else:
        out += [
            LayoutDifference(f"group {i}", "", _group_text(a), _group_text(b))
            for i, (a, b) in enumerate(zip(lgroups, rgroups, strict=True))
            if a != b
        ]
    lefts = {g.name: g for g in left.layers}
    rights = {g.name: g for g in right.layers}
    for name in sorted(lefts.keys() | rights.keys()):
        a, b = lefts.get(name), rights.get(name)
        if a is None or b is None:
            out.append(LayoutDifference("layer", name, a and a.name, b and b.name))
            continue
        out += [
            LayoutDifference(f, name, getattr(a, f), getattr(b, f))
            for f in _LAYER_FIELDS
            if getattr(a, f) != getattr(b, f)
        ]
    return out


def _group_text(group: KvGroup) -> str:
    span = f" {group.span}" if group.kind in SPAN_KINDS else ""
    return f"{group.kind}{span} x{group.block_size}"


def _listed_groups(layout: Layout) -> tuple[KvGroup, ...]:
    """The groups a format 2 descriptor lists; none for format 1 (one full-attention group of block_size)."""
    return () if layout.groups == (KvGroup("full", layout.block_size),) else layout.groups


def _groups_text(groups: tuple[KvGroup, ...]) -> str:
    return ", ".join(map(_group_text, groups)) or "one full-attention group"


def explain_difference(left: Layout, right: Layout, left_name: str = "this", right_name: str = "that") -> str:
    """One line naming what differs ('' when nothing does): the layers present on one side only, then fields."""
    diffs = diff_layouts(left, right)
    diffs.sort(key=lambda d: d.field != "layer")  # the layers on one side first: an MTP drafter layer, usually
    return "; ".join(d.describe(left_name, right_name) for d in diffs)


def namespace_final(namespace: str, layout: Layout) -> str:
    return f"{namespace}.{layout.fingerprint}"


@dataclass(frozen=True, slots=True)
class SealedInstance:
    namespace: str
    layout: Layout
    layer_ids: dict[str, int]
    # worker key (tp_rank, pp_rank) -> the dense ids of the layers that worker holds, in its registration order
    worker_layer_ids: dict[tuple[int, int], tuple[int, ...]]
    eagle_groups: tuple[int, ...] = ()
    namespace_final: str = field(init=False, repr=False, compare=False)  # computed once: every RPC returns it
    parts: tuple[StoragePart, ...] = field(init=False, repr=False, compare=False)  # one per group

    def __post_init__(self) -> None:
        final = namespace_final(self.namespace, self.layout)
        object.__setattr__(self, "namespace_final", final)
        object.__setattr__(self, "parts", storage_parts(final, self.layout))

    def cell_mask(self, worker_key: tuple[int, int], group: int = 0) -> int:
        """Bit (layer_id * tp_size + tp_rank) of `group`'s page set for every slot that worker writes."""
        tp_rank = worker_key[0]
        part = self.parts[group]
        mask = 0
        for layer_id in self.worker_layer_ids[worker_key]:
            layer_in_part = part.layer_ids.get(self.layout.layers[layer_id].name)
            if layer_in_part is not None:
                mask |= 1 << part.layout.slot(layer_in_part, tp_rank)
        return mask


@dataclass(frozen=True, slots=True)
class StoragePart:
    """Where one KV cache group's blocks are kept: under store namespace `name`, as pages of `layout` (the group's
    layers only, its block size, the group alone). `layer_ids`: layer name -> its id in that layout."""

    group: int
    name: str
    layout: Layout
    layer_ids: dict[str, int]

    @property
    def kind(self) -> KvGroup:
        return self.layout.groups[0]


_PART_NAME_RE = re.compile(r"^(.+)/g(\d+)$")


def part_of(name: str) -> tuple[str, int] | None:
    """(namespace_final, group) of a group's store namespace `namespace_final/g<group>`; None for any other name
    (a layout of one group is stored under its namespace_final)."""
    m = _PART_NAME_RE.match(name)
    return (m.group(1), int(m.group(2))) if m else None


def storage_parts(namespace_final: str, layout: Layout) -> tuple[StoragePart, ...]:
    """The layout's groups as stored: one group is the layout itself under namespace_final (format 1 layouts are
    stored exactly as before groups existed); several are each a layout of their own layers, renumbered to group
    0, under namespace_final/g<index>."""
    if len(layout.groups) == 1:
        return (StoragePart(0, namespace_final, layout, {g.name: i for i, g in enumerate(layout.layers)}),)
    parts = []
    for index, group in enumerate(layout.groups):
        layers = [replace(g, group_id=0) for g in layout.layers if g.group_id == index]
        part = build_layout(group.block_size, layout.tp_size, layers, (group,))
        parts.append(
            StoragePart(index, f"{namespace_final}/g{index}", part, {g.name: i for i, g in enumerate(part.layers)})
        )
    return tuple(parts)


class InstanceRegistry:
    """The registrations of one inference instance, and its seal once all workers are in."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.workers: dict[tuple[int, int], WorkerRegistration] = {}
        self.sealed: SealedInstance | None = None

    @property
    def world_size(self) -> int | None:
        first = next(iter(self.workers.values()), None)
        return first.world_size if first else None

    def progress(self) -> str:
        return f"{len(self.workers)}/{self.world_size or '?'} workers registered"

    def add(self, reg: WorkerRegistration) -> SealedInstance | None:
        """Adds (or replaces) one worker's registration and seals when all are in.

        On any error the registry is left exactly as it was and the error names the field, layer or rank.
        """
        validate_registration(reg)
        if reg.instance_id != self.instance_id:
            raise InvalidArgument(f"instance_id {reg.instance_id!r} does not match {self.instance_id!r}")
        others = {k: w for k, w in self.workers.items() if k != reg.key}
        for other in others.values():
            _check_agreement(reg, other)
        candidate = {**others, reg.key: reg}
        sealed = seal(list(candidate.values())) if len(candidate) == reg.world_size else None
        self.workers = candidate
        self.sealed = sealed
        return sealed

    def remove(self, key: tuple[int, int]) -> bool:
        """Drops a worker; the instance is unsealed until it (or a replacement) registers again."""
        if self.workers.pop(key, None) is None:
            return False
        self.sealed = None
        return True


def _check_agreement(reg: WorkerRegistration, other: WorkerRegistration) -> None:
    for name in ("namespace", "tp_size", "world_size", "block_size", "groups", "eagle_groups"):
        mine, theirs = getattr(reg, name), getattr(other, name)
        if mine != theirs:
            raise FailedPrecondition(
                f"{name} {mine!r} of {reg.describe()} disagrees with {theirs!r} registered by "
                f"{other.describe()} of instance {reg.instance_id!r}"
            )
    theirs_by_name = {layer.geometry.name: layer.geometry for layer in other.layers}
    for i, layer in enumerate(reg.layers):
        g = layer.geometry
        t = theirs_by_name.get(g.name)
        if t is None:
            continue
        for attr in ("dtype", "segment_bytes", "segments", "group_id", "layout_tag"):
            if getattr(g, attr) != getattr(t, attr):
                raise FailedPrecondition(
                    f"layers[{i}] {g.name!r}: {attr} {getattr(g, attr)!r} of {reg.describe()} disagrees with "
                    f"{getattr(t, attr)!r} registered by {other.describe()}"
                )
        if reg.pp_rank != other.pp_rank:
            raise FailedPrecondition(
                f"layers[{i}] {g.name!r} is registered by pp_rank {reg.pp_rank} and pp_rank {other.pp_rank}: "
                "replicas of a layer are allowed only within one pipeline stage"
            )


def seal(workers: list[WorkerRegistration]) -> SealedInstance:
    """Seals a complete set of registrations (already checked pairwise by InstanceRegistry.add)."""
    first = workers[0]
    geometry: dict[str, LayerGeometry] = {}
    owners: dict[str, set[int]] = {}
    for w in workers:
        for layer in w.layers:
            geometry[layer.geometry.name] = layer.geometry
            owners.setdefault(layer.geometry.name, set()).add(w.tp_rank)
    layout = build_layout(first.block_size, first.tp_size, list(geometry.values()), first.groups)
    layer_ids = {g.name: i for i, g in enumerate(layout.layers)}
    empty = set(range(len(layout.groups))) - {g.group_id for g in layout.layers}
    if empty:
        raise FailedPrecondition(
            f"group {min(empty)} ({_group_text(layout.groups[min(empty)])}) has no layer: every KV cache group "
            f"listed must hold a layer of instance {first.instance_id!r}"
        )
    for g in layout.layers:
        missing = [r for r in range(first.tp_size) if r not in owners[g.name]]
        if missing:
            raise FailedPrecondition(
                f"layer {g.name!r} (id {layer_ids[g.name]}) has no owner for tp_rank {missing[0]}: every "
                f"(layer, tp_rank) cell must be registered by some worker of instance {first.instance_id!r}"
            )
    return SealedInstance(
        namespace=first.namespace,
        layout=layout,
        layer_ids=layer_ids,
        worker_layer_ids={w.key: tuple(layer_ids[layer.geometry.name] for layer in w.layers) for w in workers},
        eagle_groups=first.eagle_groups,
    )
