"""vLLM integration: `KVSealConnector`, loaded by vLLM with kv_connector_module_path="kvseal.vllm".

Imported lazily so that `kvseal.vllm.identity` works without vLLM installed.
"""

from typing import Any

__all__ = ["KVSealConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVSealConnector":
        from kvseal.vllm.connector import KVSealConnector

        return KVSealConnector
    raise AttributeError(name)
