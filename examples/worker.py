"""A worker of one inference instance, end to end: share KV memory, register, save, query, load.

kvseal serve &                      # the engine, on its defaults
python examples/worker.py           # needs torch (pip install -e '.[torch]')
"""

import hashlib
import sys

import torch

from kvseal.client import EngineClient, layer_from_tensor

target = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50055"
num_layers, num_blocks = 4, 64
kv = torch.randn(num_layers, num_blocks, 2, 16, 128).to(torch.float16)  # [layer][block][kv_heads, block_size, 2*head]
block_hashes = [hashlib.sha256(f"block {i}".encode()).digest() for i in range(8)]

with EngineClient(target, timeout=10.0) as client:
    layers = [
        layer_from_tensor(f"model.layers.{i}.self_attn.attn", kv[i], layout_tag="cpu-LBHNC-fp16")
        for i in range(num_layers)
    ]  # moves kv's storage into a sealed memfd in place; kv keeps working
    status = client.register(
        instance_id="example-0", namespace="tiny-llama", tp_rank=0, tp_size=1, pp_rank=0,
        world_size=1, block_size=16, layers=layers,
    )  # fmt: skip
    print("namespace_final:", status.namespace_final)  # tiny-llama.<fingerprint>: every worker is in

    saved = client.save(("example-0", 0, 0), block_hashes, list(range(8)))  # blocks 0..7 into pool pages
    print("saved:", saved.written, "completed:", saved.completed)

    q = client.query("example-0", block_hashes)  # leading resident blocks, pinned by a lease
    free_blocks = list(range(32, 32 + q.hits))
    loaded = client.load(("example-0", 0, 0), block_hashes[: q.hits], free_blocks, lease_id=q.lease_id)
    print("hits:", q.hits, "loaded:", loaded.loaded)
    assert torch.equal(kv[:, 32:40], kv[:, 0:8]), "the loaded blocks must equal the saved ones"
    print("ok: blocks 32..39 now hold the bytes saved from 0..7")
# closing the client ends its lane session: the engine drops the worker and its leases
