"""The names users meet stay where they meet them: `kvseal.client`'s and `kvseal.testing`'s public surfaces, the
vLLM connector's module path, the `kvseal` command. A change here is a change users see: change this test with it,
on purpose."""

from __future__ import annotations

import importlib
import sys
import types
import warnings
from pathlib import Path

import kvseal.client
import kvseal.testing

if sys.version_info >= (3, 11):
    import tomllib
else:  # the tomli backport, a dependency on 3.10
    import tomli as tomllib

CLIENT = {
    "BlockRun",
    "EngineClient",
    "cuda_handle",
    "layer_from_array",
    "layer_from_tensor",
    "share_tensor",
    "shm_handle",
}
TESTING = {
    "EngineProcess",
    "EngineStartFailed",
    "FakeClock",
    "FakePeerSource",
    "MemoryDevice",
    "free_port",
    "http_get",
    "register_one_rank",
    "serve_command",
    "stop_process",
}


def _public(module: types.ModuleType) -> set[str]:
    """The names a module defines itself (not what it imports)."""
    return {
        n for n, v in vars(module).items() if not n.startswith("_") and getattr(v, "__module__", "") == module.__name__
    }


def test_client_and_testing_export_exactly_their_names() -> None:
    assert set(kvseal.client.__all__) == CLIENT
    assert _public(kvseal.client) == CLIENT - {"BlockRun"}  # BlockRun is the lane codec's, re-exported
    assert set(kvseal.testing.__all__) == TESTING
    for module, names in ((kvseal.client, CLIENT), (kvseal.testing, TESTING)):
        assert all(getattr(module, name) is not None for name in names)


def test_vllm_loads_the_connector_from_its_module_path() -> None:
    with warnings.catch_warnings():  # vLLM's import-time deprecation warnings
        warnings.simplefilter("ignore")
        module = importlib.import_module("kvseal.vllm")
        connector = module.KVSealConnector
    assert connector.__name__ == "KVSealConnector" and module.__all__ == ["KVSealConnector"]
    assert importlib.import_module("kvseal.vllm.connector").KVSealConnector is connector


def test_the_kvseal_command_is_the_cli() -> None:
    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    assert project["project"]["scripts"] == {"kvseal": "kvseal.cli:main"}
    assert callable(importlib.import_module("kvseal.cli").main)
