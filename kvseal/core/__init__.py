"""The pure core: seal and layout (layout.py), pool, index, leases and eviction (store.py). No I/O."""
