"""The MetaServer's checks of its requests' fields. Every request is validated (kvseal.meta.service) before the
store is touched, with the field named in the error (a client's value is quoted a few dozen characters at most:
kvseal.errors.quote); the store sees only well-formed input."""

from __future__ import annotations

import re
from typing import Any

from kvseal.errors import InvalidArgument, quote
from kvseal.limits import (
    MAX_ADDRESS_CHARS,
    MAX_BLOCKS_PER_REQUEST,
    MAX_HASH_BYTES,
    MAX_NAMESPACE_FINAL_CHARS,
    MAX_NAMESPACES_PER_REQUEST,
    MAX_NODE_ID_CHARS,
)
from kvseal.meta.store import Block
from kvseal.proto import kvseal_pb2 as pb

_ID_RE = re.compile(r"^[A-Za-z0-9._:@+=/-]+$")  # lengths are checked first
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9._:/@+=-]+$")


def check_id(field: str, value: str) -> None:
    if len(value) > MAX_NODE_ID_CHARS or not _ID_RE.match(value):
        raise InvalidArgument(
            f"{field} must be 1..{MAX_NODE_ID_CHARS} characters of [A-Za-z0-9._:@+=/-], got {quote(value)}"
        )


def check_node(node_id: str, session: str) -> None:
    check_id("node_id", node_id)
    check_id("session", session)


def check_address(address: str) -> None:
    host, _, port = address.rpartition(":")
    if len(address) > MAX_ADDRESS_CHARS or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(
            f"address must be HOST:PORT of at most {MAX_ADDRESS_CHARS} characters, got {quote(address)}"
        )


def check_hashes(field: str, hashes: Any) -> list[bytes]:
    if len(hashes) > MAX_BLOCKS_PER_REQUEST:
        raise InvalidArgument(f"{field}: at most {MAX_BLOCKS_PER_REQUEST} per request, got {len(hashes)}")
    out = list(hashes)  # a repeated field builds a new bytes object at every access: walked once
    if out and (min(map(len, out)) == 0 or max(map(len, out)) > MAX_HASH_BYTES):
        i = next(i for i, h in enumerate(out) if not 0 < len(h) <= MAX_HASH_BYTES)
        raise InvalidArgument(f"{field}[{i}] must be 1..{MAX_HASH_BYTES} bytes, got {len(out[i])}")
    return out


def check_namespace(field: str, namespace: str) -> None:
    if len(namespace) > MAX_NAMESPACE_FINAL_CHARS or not _NAMESPACE_RE.match(namespace):
        raise InvalidArgument(f"{field} must be a final namespace (namespace.fingerprint), got {quote(namespace)}")


def check_blocks(request: pb.BlocksRequest) -> list[Block]:
    """An Announce's or a Withdraw's node, session and blocks, as (namespace_final, hash) pairs."""
    check_node(request.node_id, request.session)
    groups = request.blocks
    if len(groups) > MAX_NAMESPACES_PER_REQUEST:
        raise InvalidArgument(f"blocks: at most {MAX_NAMESPACES_PER_REQUEST} namespaces per request, got {len(groups)}")
    total = sum(len(group.block_hashes) for group in groups)
    if total > MAX_BLOCKS_PER_REQUEST:
        raise InvalidArgument(f"blocks: at most {MAX_BLOCKS_PER_REQUEST} hashes per request, got {total}")
    out: list[Block] = []
    for i, group in enumerate(groups):
        ns = group.namespace_final
        check_namespace(f"blocks[{i}].namespace_final", ns)
        out += [(ns, h) for h in check_hashes(f"blocks[{i}].block_hashes", group.block_hashes)]
    return out
