"""Benchmarks. They print figures and ratios against a ceiling measured in the same run; they never assert.

kvseal bench engine [--quick]      # kvseal.bench.engine: save/load GB/s vs memcpy, query latency, metadata
"""
