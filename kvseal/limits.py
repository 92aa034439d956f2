"""Limits on what one request may carry, shared by the engine (which validates) and the lane codec (which refuses
oversized frames from their header, before reading a body)."""

MAX_HASH_BYTES = 64
MAX_BLOCKS_PER_REQUEST = 1 << 17
MAX_LEASE_TTL_MS = 3_600_000
MAX_LAYERS = 4096
MAX_REGISTER_BYTES = 4 << 20  # MAX_LAYERS layers with 256-character names and tags fit in ~2.5 MiB
MAX_REQUEST_ID_CHARS = 256
