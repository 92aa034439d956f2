"""Helpers for tests of kvseal and of code that uses it: a fake clock, an in-memory SSD device, a real `kvseal serve`
subprocess (EngineProcess, free_port), one worker rank's registration (register_one_rank), another node in process
(FakePeerSource), and the Device conformance suite (device_checks)."""

from kvseal.testing.clock import FakeClock
from kvseal.testing.device import MemoryDevice
from kvseal.testing.peers import FakePeerSource
from kvseal.testing.process import EngineProcess, EngineStartFailed, free_port, http_get, serve_command, stop_process
from kvseal.testing.worker import register_one_rank

__all__ = [
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
]
