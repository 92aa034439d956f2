"""What the router sends on each leg of a P/D request and what it reads from the answers. Pure: no I/O.

    client --body--> router --prefill_body--> prefill   (max_tokens 1, stream off, do_remote_decode)
                            <--kv_transfer_params--
                     router --decode_body---> decode    (the client's body + prefill's kv_transfer_params)
    client <==== the decode answer, relayed as it arrives

The kv_transfer_params convention is vLLM's (the prefill is asked to keep the KV for a remote decode and answers
where to find it); the `kvseal` part of it is the kvseal connector's: its final namespace, layout descriptor and,
for the MetaServer, the prompt's block hashes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvseal.core.layout import explain_difference, layout_from_descriptor
from kvseal.router.pool import Instance, KvLayout

KVSEAL_VERSION = 1

# vLLM's P/D convention: the prefill instance keeps the KV for a decode elsewhere
REMOTE_DECODE_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The client's body as the prefill leg sends it: one token, no stream, KV kept for a remote decode."""
    out = dict(body)
    out["max_tokens"] = 1
    if chat:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("min_tokens", None)  # vLLM refuses min_tokens above max_tokens; the decode leg keeps the client's
    out["kv_transfer_params"] = dict(REMOTE_DECODE_PARAMS)
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The client's body with what the prefill answered. Without kv_transfer_params (a prefill whose request ended
    before the length cap, e.g. on a stop token, hands nothing over) the decode instance computes the prompt."""
    out = dict(body)
    out.pop("kv_transfer_params", None)
    if kv_transfer_params:
        out["kv_transfer_params"] = kv_transfer_params
    return out


def probe_body(model: Any) -> dict[str, Any]:
    """A one-token request whose only purpose is the kvseal connector's description of its layout."""
    return {"model": model, "prompt": [0], "max_tokens": 1, "kv_transfer_params": {"kvseal_describe": True}}


def kv_transfer_params(answer: Any) -> dict[str, Any] | None:
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    return params if isinstance(params, dict) else None


def kvseal_layout(params: dict[str, Any] | None) -> KvLayout | None:
    """The layout the `kvseal` part of kv_transfer_params names, or None when there is none this router can read
    (no kvseal connector, another version, an instance not sealed yet)."""
    part = (params or {}).get("kvseal")
    if not isinstance(part, dict) or part.get("version") != KVSEAL_VERSION:
        return None
    ns, descriptor, node = part.get("namespace_final"), part.get("descriptor"), part.get("node_id")
    if not isinstance(ns, str) or not ns:
        return None
    return KvLayout(ns, descriptor if isinstance(descriptor, str) else "", node if isinstance(node, str) else "")


def is_definitive_description(params: dict[str, Any] | None) -> bool:
    """Whether a probe's answer is worth keeping: a sealed layout, or no kvseal connector at all. A kvseal connector
    whose engine has not sealed yet answers a version only, and is asked again next time."""
    return kvseal_layout(params) is not None or "kvseal" not in (params or {})


def block_hashes(params: dict[str, Any] | None) -> list[bytes]:
    """The prompt's block hashes the prefill handed over (hex in JSON); [] when absent or malformed."""
    part = (params or {}).get("kvseal")
    hashes = part.get("block_hashes") if isinstance(part, dict) else None
    if not isinstance(hashes, list):
        return []
    try:
        return [bytes.fromhex(h) for h in hashes]
    except (TypeError, ValueError):
        return []


def explain_incompatibility(prefill: KvLayout, decode: KvLayout) -> str:
    """Why the two cannot share KV, by layer name when both descriptors are readable."""
    left = layout_from_descriptor(prefill.descriptor.encode())
    right = layout_from_descriptor(decode.descriptor.encode())
    why = explain_difference(left, right, "prefill", "decode") if left and right else ""
    # equal layouts under different namespaces (another model, another --kv-namespace) differ in the name only
    return why or f"namespace_final: prefill {prefill.namespace_final!r}, decode {decode.namespace_final!r}"


def decode_candidates(prefill: KvLayout | None, pool: Sequence[Instance]) -> tuple[list[Instance], list[Instance]]:
    """(the decode instances to pick among, the ones known to be incompatible). Candidates are the compatible ones
    when there are any, else those whose layout is unknown; empty when every instance is known to be incompatible."""
    if prefill is None:
        return list(pool), []
    compatible, unknown, incompatible = [], [], []
    for instance in pool:
        if instance.layout is None:
            unknown.append(instance)
        elif instance.layout.namespace_final == prefill.namespace_final:
            compatible.append(instance)
        else:
            incompatible.append(instance)
    return compatible or unknown, incompatible


def error_body(message: str, kind: str, status: int) -> dict[str, Any]:
    """An OpenAI-style error."""
    return {"error": {"message": message, "type": kind, "code": status}}
