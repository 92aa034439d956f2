"""Helpers for tests of kvseal and of code that uses it: a fake clock, registration builders."""

from kvseal.testing.clock import FakeClock

__all__ = ["FakeClock"]
