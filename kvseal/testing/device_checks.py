"""The Device conformance suite: checks that any implementation of kvseal.ssd.device.Device keeps the contract
written in that protocol's docstrings. Each check takes an `open_device` callable that opens a device over one
storage: the first call finds it empty; a later call, made after the previous device was closed, finds what that
one left (the same object again is fine for an in-memory device whose close changes nothing). Give each check its
own fresh storage, with room for at least 4 segments.

    @pytest.mark.parametrize("check", DEVICE_CHECKS, ids=lambda c: c.__name__)
    def test_my_device(check, tmp_path):
        check(lambda: MyDevice(tmp_path, 4 << 20, 64 << 10))
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvseal.ssd.device import ALIGN, Device, aligned_buffer

OpenDevice = Callable[[], Device]


def _pattern(n: int, seed: int) -> bytes:
    """n bytes that differ per seed and per position (a misplaced byte shows)."""
    return bytes((i * 7 + seed * 131 + (i >> 8)) % 251 + 1 for i in range(n))


def _write(device: Device, seq: int, offset: int, data: bytes) -> None:
    """Writes `data` (a multiple of ALIGN) from page-aligned memory, as the tier does."""
    buf = aligned_buffer(len(data))
    buf[: len(data)] = data
    device.write(seq, offset, memoryview(buf)[: len(data)])


def check_geometry(open_device: OpenDevice) -> None:
    """Segment size a positive multiple of ALIGN, room for at least 2 segments, a name, `direct` a bool."""
    device = open_device()
    try:
        assert device.segment_bytes > 0 and device.segment_bytes % ALIGN == 0, device.segment_bytes
        assert device.max_segments >= 2, device.max_segments
        assert isinstance(device.name, str) and device.name
        assert isinstance(device.direct, bool)
    finally:
        device.close()


def check_new_storage_is_empty(open_device: OpenDevice) -> None:
    device = open_device()
    try:
        assert device.segments() == []
        assert device.notes() == []
    finally:
        device.close()


def check_a_created_segment_is_listed_and_reads_as_zeros(open_device: OpenDevice) -> None:
    device = open_device()
    try:
        device.create(3)
        assert device.segments() == [3]
        assert bytes(device.read(3, 0, device.segment_bytes)) == bytes(device.segment_bytes)
    finally:
        device.close()


def check_segments_are_listed_in_order_and_removed(open_device: OpenDevice) -> None:
    """Listed ascending whatever the order of creation; a removed one is gone; removing it again does nothing."""
    device = open_device()
    try:
        for seq in (7, 2, 5, 11):
            device.create(seq)
        assert device.segments() == [2, 5, 7, 11]
        device.remove(5)
        assert device.segments() == [2, 7, 11]
        device.remove(5)
        assert device.segments() == [2, 7, 11]
        device.create(5)  # its number may be created again (the tier never does, but the space is back)
        assert device.segments() == [2, 5, 7, 11]
    finally:
        device.close()


def check_every_segment_the_capacity_holds_can_be_created(open_device: OpenDevice) -> None:
    """`max_segments` segments fit; after removing them all, they fit again."""
    device = open_device()
    try:
        seqs = list(range(1, device.max_segments + 1))
        for seq in seqs:
            device.create(seq)
        assert device.segments() == seqs
        for seq in seqs:
            device.remove(seq)
        assert device.segments() == []
        for seq in seqs:
            device.create(seq + len(seqs))
        assert len(device.segments()) == len(seqs)
    finally:
        device.close()


def check_reads_return_what_was_written(open_device: OpenDevice) -> None:
    """Aligned writes read back exactly, at the same and at unaligned offsets; an overwrite replaces; writes to one
    segment leave the others alone."""
    device = open_device()
    try:
        size = device.segment_bytes
        device.create(1)
        device.create(2)
        first, second = _pattern(2 * ALIGN, 1), _pattern(ALIGN, 2)
        _write(device, 1, 0, first)
        _write(device, 1, size - ALIGN, second)
        assert bytes(device.read(1, 0, 2 * ALIGN)) == first
        assert bytes(device.read(1, size - ALIGN, ALIGN)) == second
        assert bytes(device.read(1, 100, 5000)) == first[100:5100]  # unaligned start and length
        assert bytes(device.read(1, ALIGN - 1, 2)) == first[ALIGN - 1 : ALIGN + 1]  # across an ALIGN boundary
        assert bytes(device.read(1, 2 * ALIGN, ALIGN)) == bytes(ALIGN)  # never written: zeros
        third = _pattern(ALIGN, 3)
        _write(device, 1, ALIGN, third)
        assert bytes(device.read(1, 0, 2 * ALIGN)) == first[:ALIGN] + third
        assert bytes(device.read(2, 0, 2 * ALIGN)) == bytes(2 * ALIGN)
    finally:
        device.close()


def check_reads_end_at_the_segment_end(open_device: OpenDevice) -> None:
    """A read over the segment's end returns what is before it; at or past the end, nothing; of length 0, nothing.
    Never an error."""
    device = open_device()
    try:
        size = device.segment_bytes
        device.create(1)
        tail = _pattern(ALIGN, 4)
        _write(device, 1, size - ALIGN, tail)
        assert bytes(device.read(1, size - 100, 1000)) == tail[-100:]
        assert bytes(device.read(1, size - ALIGN, 8 * ALIGN)) == tail
        assert bytes(device.read(1, size, ALIGN)) == b""
        assert bytes(device.read(1, 0, 0)) == b""
    finally:
        device.close()


def check_sync_keeps_the_bytes(open_device: OpenDevice) -> None:
    device = open_device()
    try:
        device.create(1)
        data = _pattern(ALIGN, 5)
        _write(device, 1, 0, data)
        device.sync(1)
        assert bytes(device.read(1, 0, ALIGN)) == data
    finally:
        device.close()


def check_notes_are_kept_in_order(open_device: OpenDevice) -> None:
    device = open_device()
    try:
        lines = ["quarantine 3 4096 checksum", "purge 4 0 1000 llama.abc", "a line with  two spaces"]
        for line in lines:
            device.note(line)
        assert device.notes() == lines
    finally:
        device.close()


def check_everything_survives_close_and_reopen(open_device: OpenDevice) -> None:
    """Segments, their synced bytes and the notes are there after close and reopen; close is idempotent."""
    device = open_device()
    data = _pattern(2 * ALIGN, 6)
    device.create(4)
    device.create(9)
    _write(device, 9, ALIGN, data)
    device.sync(9)
    device.note("quarantine 9 4096 checksum")
    device.remove(4)
    device.close()
    device.close()
    again = open_device()
    try:
        assert again.segments() == [9]
        assert bytes(again.read(9, ALIGN, 2 * ALIGN)) == data
        assert bytes(again.read(9, 0, ALIGN)) == bytes(ALIGN)
        assert again.notes() == ["quarantine 9 4096 checksum"]
        again.note("purge 10 0 0 x.y")
        assert again.notes() == ["quarantine 9 4096 checksum", "purge 10 0 0 x.y"]
    finally:
        again.close()


def check_threads_read_at_once(open_device: OpenDevice) -> None:
    """Reads from several threads at once (the tier's read pool) each get their own bytes, while another segment
    is written."""
    device = open_device()
    try:
        device.create(1)
        device.create(2)
        chunks = [_pattern(ALIGN, 10 + i) for i in range(4)]
        for i, chunk in enumerate(chunks):
            _write(device, 1, i * ALIGN, chunk)
        wrong: list[str] = []

        def reader(i: int) -> None:
            for _ in range(200):
                view = device.read(1, i * ALIGN + 10, ALIGN - 20)
                if bytes(view) != chunks[i][10:-10]:
                    wrong.append(f"thread {i}")
                    return

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(len(chunks))]
        for t in threads:
            t.start()
        for n in range(50):
            _write(device, 2, (n % 4) * ALIGN, _pattern(ALIGN, n))
        for t in threads:
            t.join()
        assert not wrong, f"reads came back with other bytes: {wrong}"
    finally:
        device.close()


DEVICE_CHECKS: list[Callable[[OpenDevice], None]] = [
    check_geometry,
    check_new_storage_is_empty,
    check_a_created_segment_is_listed_and_reads_as_zeros,
    check_segments_are_listed_in_order_and_removed,
    check_every_segment_the_capacity_holds_can_be_created,
    check_reads_return_what_was_written,
    check_reads_end_at_the_segment_end,
    check_sync_keeps_the_bytes,
    check_notes_are_kept_in_order,
    check_everything_survives_close_and_reopen,
    check_threads_read_at_once,
]


def check_device(open_device_factory: Callable[[], OpenDevice]) -> None:
    """Runs every check, each on fresh storage from `open_device_factory()`."""
    for check in DEVICE_CHECKS:
        check(open_device_factory())
