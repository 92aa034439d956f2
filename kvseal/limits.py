"""Limits on what one request may carry, shared by the engine (which validates) and the lane codec (which refuses
oversized frames from their header, before reading a body); and the process's own open-file limit, which every
kvseal server raises at start."""

import logging
import resource
from collections.abc import Sized

from kvseal.errors import InvalidArgument

MAX_HASH_BYTES = 64
MAX_BLOCKS_PER_REQUEST = 1 << 17
MAX_LEASE_TTL_MS = 3_600_000
MAX_LAYERS = 4096
MAX_REGISTER_BYTES = 4 << 20  # MAX_LAYERS layers with 256-character names and tags fit in ~2.5 MiB
MAX_REQUEST_ID_CHARS = 256
MAX_INSTANCE_ID_CHARS = 256  # as kvseal.core.layout.MAX_NAME_CHARS, which a registration's names are checked against
MAX_NAMESPACE_FINAL_CHARS = 512  # a namespace (256) + "." + the fingerprint, with room
MAX_DESCRIPTOR_BYTES = MAX_REGISTER_BYTES  # a layout descriptor (Compare's other_descriptor)
MAX_TOKEN_BYTES = 4096  # the lane's HELLO
MAX_CUDA_HANDLE_BYTES = 1024  # each bytes field of a CudaIpcHandle (torch's are 64-byte handles and short names)
MAX_STRIDES = 2  # a layer's strides: [block_stride] or [block_stride, segment_stride]


def check_length(field: str, value: Sized, limit: int) -> None:
    """Raises InvalidArgument naming `field` when `value` is longer than `limit` characters (a str), bytes (bytes)
    or entries (a repeated field); the message never carries the value itself."""
    if len(value) > limit:
        unit = "bytes" if isinstance(value, bytes | bytearray) else "entries"
        unit = "characters" if isinstance(value, str) else unit
        raise InvalidArgument(f"{field} has {len(value)} {unit}; at most {limit}")


# the MetaServer (kvseal.meta.checks): fields of its requests (namespace_final: MAX_NAMESPACE_FINAL_CHARS)
MAX_NODE_ID_CHARS = 256  # node_id and session
MAX_ADDRESS_CHARS = 256
MAX_NAMESPACES_PER_REQUEST = 1024  # groups of one Announce / Withdraw


def raise_open_file_limit() -> int:
    """Raises the soft open-file limit to the hard one (default soft limits are often 1024, and every connection,
    lane session and mapped memfd holds a descriptor); returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            logging.getLogger("kvseal").warning("cannot raise the open-file limit from %d to %d", soft, hard)
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
