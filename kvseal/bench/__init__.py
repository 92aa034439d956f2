"""Benchmarks. They print figures and ratios against a ceiling measured in the same run; they never assert. Each is
run by `kvseal bench NAME` (kvseal/bench/README.md says what each measures):

kvseal bench engine [--quick] [--plot FILE.png]   # kvseal.bench.engine: save/load GB/s vs memcpy, query latency
kvseal bench ssd [--quick] [--dir DIR]            # kvseal.bench.ssd: the SSD tier vs dd, recovery time
kvseal bench peer [--quick]                       # kvseal.bench.peer: peer fetch vs memcpy, Mooncake, loopback TCP
kvseal bench cuda [--quick]                       # kvseal.bench.cuda: CUDA KV vs pinned cudaMemcpy (a GPU)
kvseal bench store_ops [--quick]                  # kvseal.bench.store_ops: the store's hot calls, in-process
kvseal bench hitrate [--quick]                    # kvseal.bench.hitrate: eviction policies' hit ratios, offline
kvseal bench ops [--quick] [--baseline REV]       # kvseal.bench.ops: the control plane over the lane, vs its floor
kvseal bench vllm_ttft [...]                      # kvseal.bench.vllm_ttft: vLLM TTFT with kvseal, none, Example
kvseal bench pd [...]                             # kvseal.bench.pd: prefill/decode through kvseal router
kvseal bench mooncake [NBYTES]                    # kvseal.bench.mooncake: Mooncake's own TCP read

Processes they run separately: `python -m kvseal.bench.vllm_ttft_run` (one vLLM run), `python -m
kvseal.bench.vllm_ttft_model OUTDIR` (builds the model), `python -m kvseal.bench.mooncake --serve NBYTES`,
`python -m kvseal.bench.ops --client SPEC` (one client of the ops benchmark). Modules that are no benchmark of their
own: kvseal.bench.harness (what several benchmarks share: the engine subprocess, a worker's KV memory and its
registration, block hashes, the memcpy ceiling, CPU accounting), kvseal.bench.engine_cases (the engine benchmark's
cases), kvseal.bench.workload (replayable prefix-cache workloads), kvseal.bench.hitsim (the hit-ratio simulator)
and kvseal.bench.baseline (an earlier revision's engine in a temporary venv).
"""
