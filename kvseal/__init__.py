"""kvseal: a KV-cache storage engine for LLM inference whose namespaces are sealed by the KV layout."""

__version__ = "0.1.0"
