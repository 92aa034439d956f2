"""The Device contract (kvseal.ssd.device.Device), checked by the conformance suite (kvseal.testing.device_checks)
on every implementation: FileDevice on a real directory and kvseal.testing.MemoryDevice. Plus what only the
in-memory one can show: a full device (ENOSPC at create, nothing left behind)."""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path

import pytest

from kvseal.ssd.device import FileDevice
from kvseal.testing import MemoryDevice
from kvseal.testing.device_checks import DEVICE_CHECKS, OpenDevice

CAPACITY = 256 << 10
SEGMENT = 64 << 10


def memory_storage(tmp_path: Path) -> OpenDevice:
    device = MemoryDevice(CAPACITY, SEGMENT)  # its close changes nothing: reopening is the same object
    return lambda: device


def file_storage(tmp_path: Path) -> OpenDevice:
    directory = tmp_path / "tier"
    return lambda: FileDevice(directory, CAPACITY, SEGMENT)


STORAGES: dict[str, Callable[[Path], OpenDevice]] = {"memory": memory_storage, "file": file_storage}


@pytest.mark.parametrize("storage", sorted(STORAGES))
@pytest.mark.parametrize("check", DEVICE_CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_device_contract(storage: str, check: Callable[[OpenDevice], None], tmp_path: Path) -> None:
    check(STORAGES[storage](tmp_path))


def test_a_full_memory_device_refuses_a_segment_and_keeps_none() -> None:
    device = MemoryDevice(CAPACITY, SEGMENT)
    device.space_bytes = SEGMENT
    device.create(1)
    with pytest.raises(OSError) as e:
        device.create(2)
    assert e.value.errno == errno.ENOSPC and device.segments() == [1]
    device.remove(1)
    device.create(2)  # the space came back
    assert device.segments() == [2]
