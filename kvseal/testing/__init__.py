"""Helpers for tests of kvseal and of code that uses it: a fake clock, an in-memory SSD device."""

from kvseal.testing.clock import FakeClock
from kvseal.testing.device import MemoryDevice

__all__ = ["FakeClock", "MemoryDevice"]
