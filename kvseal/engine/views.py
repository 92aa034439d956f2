"""What the engine holds, as the HTTP endpoints and the admin commands show it: one view per (user, final
namespace) in memory or on SSD, and the layout a final namespace names. Read-only; the engine calls these under
its lock."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvseal.core.layout import Layout, layout_from_descriptor, part_of
from kvseal.core.store import BlockStore
from kvseal.errors import NotFound, quote
from kvseal.ssd.tier import NamespaceKey, Tier

NO_WHAT_IF = {
    "hit_ratio": 0.0,
    "hit_ratio_2x": 0.0,
    "hit_ratio_4x": 0.0,
    "hit_ratio_unbounded": 0.0,
    "distinct_blocks": 0,
    "ghost_blocks": 0,
}  # a namespace on SSD only: nothing asked of it since the engine started


def namespace_views(store: BlockStore, ssd: Tier) -> list[dict[str, Any]]:
    """One entry per (user, final namespace) held in memory or on SSD."""
    on_ssd = ssd.namespaces()
    out = []
    for ns, layout in store.namespace_stats():
        key = (ns.tenant, ns.namespace_final)
        ssd_blocks, ssd_bytes, _ = on_ssd.pop(key, (0, 0, b""))
        what_if = ns.what_if.estimates()
        out.append(
            namespace_view(key, layout)
            | {
                "resident_blocks": ns.resident_blocks,
                "resident_bytes": ns.resident_bytes,
                "ssd_blocks": ssd_blocks,
                "ssd_bytes": ssd_bytes,
                "hits": ns.hits,
                "misses": ns.misses,
                "refused": dict(ns.refused),
                "last_used": ns.last_used,
                "what_if": {
                    "hit_ratio": what_if.ratio,
                    "hit_ratio_2x": what_if.ratio_2x,
                    "hit_ratio_4x": what_if.ratio_4x,
                    "hit_ratio_unbounded": what_if.ratio_unbounded,
                    "distinct_blocks": round(what_if.distinct_estimate),
                    "ghost_blocks": len(ns.what_if),
                },
            }
        )
    for key, (ssd_blocks, ssd_bytes, descriptor) in on_ssd.items():  # on SSD only (e.g. after a restart)
        on_disk = layout_from_descriptor(descriptor)
        assert on_disk is not None  # the tier keeps only namespaces whose descriptor builds
        out.append(
            namespace_view(key, on_disk)
            | {
                "resident_blocks": 0,
                "resident_bytes": 0,
                "ssd_blocks": ssd_blocks,
                "ssd_bytes": ssd_bytes,
                "hits": 0,
                "misses": 0,
                "refused": {},
                "last_used": 0.0,
                "what_if": dict(NO_WHAT_IF),
            }
        )
    return out


def namespace_view(key: NamespaceKey, layout: Layout) -> dict[str, Any]:
    tenant, final = key
    return {
        "namespace": final,
        "client_namespace": final.rsplit(".", 1)[0],
        "uid": tenant,
        "fingerprint": layout.fingerprint,
        "digest": layout.digest.hex(),
        "block_size": layout.block_size,
        "tp_size": layout.tp_size,
        "num_layers": len(layout.layers),
        "page_bytes": layout.page_bytes,
        "descriptor": layout.descriptor.decode(),
    }


def layout_named(
    store: BlockStore, ssd: Tier, namespace_final: str, field: str, sealed: Mapping[str, Layout] | None = None
) -> Layout:
    """The layout of `namespace_final`: one sealed here since start (`sealed`: a layout of several groups is stored
    as one namespace per group, so only its seal names it whole), or one held in memory or on SSD; NotFound naming
    `field` otherwise."""
    if sealed and namespace_final in sealed:
        return sealed[namespace_final]
    for ns, layout in store.namespace_stats():
        if ns.namespace_final == namespace_final:
            return layout
    for (_, name), (_, _, descriptor) in ssd.namespaces().items():
        if name == namespace_final and (found := layout_from_descriptor(descriptor)) is not None:
            return found
    raise NotFound(f"{field} {quote(namespace_final)} is not held by this engine (see /v1/namespaces)")


def held_keys(store: BlockStore, ssd: Tier, namespace_final: str, uid: int | None) -> set[NamespaceKey]:
    """Every (user, final namespace) named `namespace_final` (of `uid` only, when given) in memory or on SSD, with
    the namespaces of its groups (namespace_final/g<i>)."""

    def named(name: str) -> bool:
        return name == namespace_final or (part_of(name) or ("",))[0] == namespace_final

    keys = {
        (ns.tenant, ns.namespace_final)
        for ns, _ in store.namespace_stats()
        if named(ns.namespace_final) and uid in (None, ns.tenant)
    }
    return keys | {k for k in ssd.namespaces() if named(k[1]) and uid in (None, k[0])}
