"""The pure core (no I/O, no threads): the seal, layout descriptor and fingerprint (layout.py); the pool's page
table and its one state table (pages.py), the block index and namespaces (index.py), leases (leases.py), eviction
(eviction.py), slabs (slabs.py), behind the BlockStore facade (store.py)."""
