"""Whose SSD directory it is: the engine believes the records of a tier directory only when it is the engine's user's
alone, opens every file in it with O_NOFOLLOW under the directory's descriptor, and is the only engine on it (a lock).

The attacker is uid/gid nobody (65534): a real process dropped to it plants a directory with segment files forged
with the public record format (kvseal.ssd.format), carrying the final namespace and layout digest root's instance
uses. Symlinks and hard links named like segments point at a root-owned victim file, which must never change. These
tests need root (CI runs as root) and fail otherwise. The in-process tests check the same rules on FileDevice and the
tier directly; the process tests check what `kvseal serve` does with them.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_until
from test_ssd_process import (
    LAYER0,
    NAMESPACE,
    SLOT,
    TAG,
    WAIT_S,
    EngineFactory,
    SsdWorker,
    block_hashes,
    load_all,
    metric,
    one_error_line,
    recovery,
    segment_files,
    serve_fails,
    ssd_args,
    stop,
)

from kvseal.core.layout import LayerGeometry, build_layout, namespace_final
from kvseal.ssd import format as fmt
from kvseal.ssd.device import LOCK_FILE, FileDevice, TierDirectoryError, TierDirectoryInUse, user_name
from kvseal.ssd.tier import DiskTier, WriteItem

NOBODY = 65534
# the layout of test_ssd_process.SsdWorker's one layer, as root's engine seals it (checked against the engine below)
LAYOUT = build_layout(16, 1, [LayerGeometry(LAYER0, "bfloat16", SLOT, 1, 0, TAG)])
FINAL = namespace_final(NAMESPACE, LAYOUT)
FORGED = b"\xee" * SLOT  # what the attacker wants root's instance to load


def forged_segment(seq: int, hashes: list[bytes]) -> bytes:
    """A segment being written (so recovery scans and then seals it), of records in root's final namespace, with
    root's uid, layout digest and descriptor, whose every block is FORGED: all of it public."""
    out = bytearray(fmt.encode_segment_header(fmt.SegmentHeader(seq, 0.0, False)))
    out += fmt.encode_record(fmt.LAYOUT, 0, FINAL, LAYOUT.digest, b"", LAYOUT.descriptor)
    for h in hashes:
        out += fmt.encode_record(fmt.BLOCK, 0, FINAL, LAYOUT.digest, h, FORGED)
    return bytes(out + bytes(fmt.align(len(out), 4096) - len(out)))


def as_nobody(script: str, *args: str, data: bytes = b"") -> None:
    """Runs a shell script as nobody:nogroup, with no supplementary groups (a real process of another user)."""
    subprocess.run(
        ["/bin/sh", "-c", script, "sh", *args],
        input=data,
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        check=True,
        capture_output=True,
        timeout=30,
    )


def snapshot(d: Path) -> dict[str, tuple[int, int, int, str]]:
    """Every entry of d and d itself: (uid, gid, mode, sha256 of a regular file's bytes or a link's target)."""
    out = {}
    for p in [d, *sorted(d.iterdir())]:
        st = p.lstat()
        if stat.S_ISLNK(st.st_mode):
            what = os.readlink(p)
        elif stat.S_ISREG(st.st_mode):
            what = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            what = ""
        out[p.name] = (st.st_uid, st.st_gid, st.st_mode, what)
    return out


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory like /tmp (root's, mode 1777): another user can make entries in it, not replace root's."""
    d = Path(tempfile.mkdtemp(prefix="kvseal-trust-", dir="/tmp"))
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d)


@pytest.fixture
def workers() -> Iterator[Callable[..., SsdWorker]]:
    """make(engine, instance_id) -> an SsdWorker (test_ssd_process's), closed at teardown."""
    made: list[SsdWorker] = []

    def make(engine: Any, instance_id: str) -> SsdWorker:
        made.append(SsdWorker(engine, instance_id))
        return made[-1]

    yield make
    for w in made:
        w.close()


@pytest.fixture(autouse=True)
def _needs_root() -> None:
    assert os.geteuid() == 0, "these tests play another user against the engine: they need root (CI runs as root)"


# -------------------------------------------------------------------- in process: the directory's rules


def refusal(path: Path) -> str:
    with pytest.raises(TierDirectoryError) as e:
        FileDevice(path, 8 << 20, 1 << 20)
    return str(e.value)


def test_a_directory_another_user_made_is_refused_and_left_as_it_is(shared_tmp: Path) -> None:
    d = shared_tmp / "ssd"
    as_nobody('umask 077 && mkdir "$1" && cat > "$1/seg-00000001.kvs"', str(d), data=forged_segment(1, [b"h" * 32]))
    before = snapshot(d)
    assert refusal(d).startswith(f"it is owned by {user_name(NOBODY, NOBODY)}, mode 0700, not by root (uid 0)")
    assert snapshot(d) == before  # neither re-owned nor chmod-ed, no lock file: nothing of the engine's


@pytest.mark.parametrize(
    ("mode", "who"), [(0o777, "its group and other users"), (0o770, "its group"), (0o703, "other users")]
)
def test_a_directory_others_can_write_to_is_refused(tmp_path: Path, mode: int, who: str) -> None:
    d = tmp_path / "ssd"
    d.mkdir()
    os.chmod(d, mode)
    assert refusal(d).startswith(f"its mode {mode:04o} lets {who} write to it (owner root:root (uid 0))")
    assert (stat.S_IMODE(d.stat().st_mode), os.listdir(d)) == (mode, [])


def test_the_path_to_it_must_be_one_nobody_else_can_change(tmp_path: Path, shared_tmp: Path) -> None:
    open_parent = tmp_path / "open"
    open_parent.mkdir(mode=0o777)
    os.chmod(open_parent, 0o777)  # world-writable without the sticky bit: anyone could rename ssd away
    assert "open on its path has mode 0777" in refusal(open_parent / "ssd")
    assert not (open_parent / "ssd").exists()

    theirs = shared_tmp / "theirs"
    as_nobody('mkdir -m 755 "$1"', str(theirs))
    assert f"theirs on its path is owned by {user_name(NOBODY)}" in refusal(theirs / "ssd")

    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    as_nobody('ln -s "$1" "$2"', str(mine), str(shared_tmp / "link"))  # in /tmp, a symlink anyone could make
    assert f"link on its path is a symlink owned by {user_name(NOBODY)}" in refusal(shared_tmp / "link" / "ssd")
    assert list(mine.iterdir()) == []


def test_a_directory_it_makes_is_0700_and_roots_symlinks_and_sticky_parents_are_fine(
    tmp_path: Path, shared_tmp: Path
) -> None:
    old = os.umask(0o777)  # even a umask that takes every bit gives the engine's own directory 0700
    try:
        made = FileDevice(shared_tmp / "a" / "ssd", 8 << 20, 1 << 20)
    finally:
        os.umask(old)
    made.close()
    assert stat.S_IMODE((shared_tmp / "a" / "ssd").stat().st_mode) == 0o700
    (tmp_path / "link").symlink_to(shared_tmp / "a")  # root's symlink: followed
    dev = FileDevice(tmp_path / "link" / "ssd", 8 << 20, 1 << 20)
    dev.create(1)
    dev.close()
    assert [p.name for p in (shared_tmp / "a" / "ssd").iterdir() if p.name.startswith("seg-")] == ["seg-00000001.kvs"]


def test_one_device_per_directory_until_it_closes(tmp_path: Path) -> None:
    d = tmp_path / "ssd"
    first = FileDevice(d, 8 << 20, 1 << 20)
    assert (d / LOCK_FILE).read_text() == f"{os.getpid()}\n"
    with pytest.raises(TierDirectoryInUse) as e:
        FileDevice(d, 8 << 20, 1 << 20)
    assert e.value.pid == os.getpid() and f"another kvseal engine (pid {os.getpid()}) uses it" in str(e.value)
    first.close()
    FileDevice(d, 8 << 20, 1 << 20).close()
    (d / LOCK_FILE).unlink()
    (d / LOCK_FILE).symlink_to(tmp_path / "victim")
    assert "its lock file kvseal.lock is a symlink" in refusal(d) and not (tmp_path / "victim").exists()


# -------------------------------------------------------------------- in process: segment files


def write_blocks(tier: DiskTier, hashes: list[bytes], payload: bytes) -> None:
    done = threading.Event()
    page = memoryview(payload)
    assert tier.write((0, FINAL), LAYOUT, [WriteItem(h, page) for h in hashes], lambda ok: done.set())
    assert done.wait(30)


def read_blocks(tier: DiskTier, hashes: list[bytes]) -> list[bytes | str]:
    dst = [memoryview(bytearray(SLOT)) for _ in hashes]
    return [r or bytes(b) for r, b in zip(tier.read((0, FINAL), LAYOUT, hashes, dst), dst, strict=True)]


def test_segment_files_that_are_not_the_engines_own_are_never_read_nor_written(tmp_path: Path) -> None:
    d = tmp_path / "ssd"
    real = block_hashes("real", 8)
    tier = DiskTier([FileDevice(d, 4 << 20, 1 << 20)])
    tier.open()
    write_blocks(tier, real, b"\x11" * SLOT)
    tier.close()
    forged = forged_segment(5, real)  # the same hashes: trusted, its records would replace the real ones
    (d / "seg-00000005.kvs").write_bytes(forged)
    os.chown(d / "seg-00000005.kvs", NOBODY, NOBODY)
    victim = tmp_path / "victim"
    victim.write_bytes(forged)  # root's file: followed, it would be believed, and sealing it would overwrite it
    (d / "seg-00000006.kvs").symlink_to(victim)
    os.link(victim, d / "seg-00000007.kvs")
    os.mkfifo(d / "seg-00000008.kvs")
    planted = ["seg-00000005.kvs", "seg-00000006.kvs", "seg-00000007.kvs", "seg-00000008.kvs"]
    before = {name: snapshot(d)[name] for name in planted} | {"victim": snapshot(tmp_path)["victim"]}

    tier = DiskTier([FileDevice(d, 4 << 20, 1 << 20)])
    report = tier.open()
    assert (report.records, report.bad) == (8, {"untrusted": 4})
    assert read_blocks(tier, real) == [b"\x11" * SLOT] * 8
    more = block_hashes("more", 1000)  # past the capacity: new segments, the oldest reclaimed
    for i in range(0, len(more), 100):
        write_blocks(tier, more[i : i + 100], b"\x22" * SLOT)
    tier.close()
    after = {name: snapshot(d)[name] for name in planted} | {"victim": snapshot(tmp_path)["victim"]}
    assert after == before
    mine = [p.name for p in segment_files(d) if p.name not in planted]
    assert mine and min(mine) > "seg-00000008.kvs"  # the first one reclaimed, new ones numbered after theirs

    os.chown(d / "seg-00000005.kvs", 0, 0)  # the control: root's own file with these records is believed
    for name in ("seg-00000006.kvs", "seg-00000007.kvs", "seg-00000008.kvs"):
        (d / name).unlink()
    tier = DiskTier([FileDevice(d, 4 << 20, 1 << 20)])
    tier.open()
    assert tier.prefix((0, FINAL), real) == 8 and read_blocks(tier, real) == [FORGED] * 8
    tier.close()


def test_the_room_a_restart_counts_is_the_engines_own_segments_only(tmp_path: Path) -> None:
    """On a full disk a restart runs with what its segments take (kvseal.server.config.fit_ssd_capacity): a planted
    file named like a segment (another user's, a symlink, a hard link) is no room of the engine's."""
    d = tmp_path / "ssd"
    device = FileDevice(d, 4 << 20, 1 << 20)
    device.create(1)
    device.close()
    victim = tmp_path / "victim"
    with open(victim, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 8 << 20)
    (d / "seg-00000005.kvs").write_bytes(victim.read_bytes())
    os.chown(d / "seg-00000005.kvs", NOBODY, NOBODY)
    (d / "seg-00000006.kvs").symlink_to(victim)
    os.link(victim, d / "seg-00000007.kvs")
    device = FileDevice(d, 4 << 20, 1 << 20)
    try:
        space = device.space()
        vfs = os.statvfs(d)
        assert (space.held, space.filesystem) == (1 << 20, os.stat(d).st_dev)
        assert abs(space.free - vfs.f_bavail * vfs.f_frsize) < 1 << 20
        assert sorted(device.untrusted) == [5, 6, 7]
    finally:
        device.close()


# -------------------------------------------------------------------- kvseal serve


@pytest.mark.process
def test_serve_refuses_a_directory_another_user_planted_with_forged_records(shared_tmp: Path) -> None:
    d = shared_tmp / "ssd"
    as_nobody(
        'umask 077 && mkdir "$1" && cat > "$1/seg-00000001.kvs"', str(d), data=forged_segment(1, block_hashes("p", 8))
    )
    before = snapshot(d)
    r = serve_fails(*ssd_args(d))
    line = one_error_line(r)
    assert r.returncode == 1, r.stderr
    assert line.startswith(
        f"kvseal serve: error: cannot use --ssd-path {str(d)!r}: it is owned by {user_name(NOBODY, NOBODY)}, "
        "mode 0700, not by root (uid 0), the user this engine runs as"
    ), line
    assert "remove it" in line
    assert snapshot(d) == before


@pytest.mark.process
def test_serve_refuses_a_world_writable_directory(tmp_path: Path) -> None:
    d = tmp_path / "ssd"
    d.mkdir()
    os.chmod(d, 0o777)
    r = serve_fails(*ssd_args(d))
    line = one_error_line(r)
    assert r.returncode == 1, r.stderr
    assert f"cannot use --ssd-path {str(d)!r}: its mode 0777 lets its group and other users write to it" in line
    assert "chmod 700" in line and os.listdir(d) == [] and stat.S_IMODE(d.stat().st_mode) == 0o777


@pytest.mark.process
def test_serve_never_reads_nor_writes_through_a_segment_that_is_not_its_own_file(
    tmp_path: Path, engine_factory: EngineFactory, workers: Any
) -> None:
    """Another user's segment file and a symlink and a hard link to root's victim file, each holding records
    forged for root's instance and numbered after the real ones, in the engine's own directory: across restarts,
    saves that evict to SSD and reclaim whole segments, the victim never changes and every load is byte-exact."""
    d = tmp_path / "ssd"
    args = ssd_args(d, capacity="8MiB", segment="2MiB", pool="8MiB")
    real = block_hashes("real", 64)
    e1 = engine_factory(*args)
    w1 = workers(e1, "i1")
    assert w1.save(real) == FINAL  # the forgery carries the final namespace root's instance gets
    wait_until(lambda: metric(e1, "kvseal_ssd_records") == len(real), WAIT_S, "the blocks on SSD")
    w1.close()
    stop(e1)

    forged = forged_segment(5, real)
    (d / "seg-00000005.kvs").write_bytes(forged)
    os.chown(d / "seg-00000005.kvs", NOBODY, NOBODY)
    victim = tmp_path / "victim"
    victim.write_bytes(forged)
    (d / "seg-00000006.kvs").symlink_to(victim)
    os.link(victim, d / "seg-00000007.kvs")
    planted = {k: v for k, v in snapshot(d).items() if k in ("seg-00000005.kvs", "seg-00000006.kvs")}
    victim_sha = hashlib.sha256(forged).hexdigest()

    e2 = engine_factory(*args)
    assert recovery(e2)["bad"] == "{'untrusted': 3}", e2.stderr()
    w2 = workers(e2, "i2")
    load_all(w2, real, first_loading=True)  # the real bytes, never the forged ones
    more = block_hashes("more", 2048)  # 4 pools' worth: evicted from memory, 8 MiB to a disk of 8 MiB
    base = metric(e2, "kvseal_ssd_write_bytes_total")
    for i in range(0, len(more), 256):  # a chunk at a time, each on disk before the next: none is skipped
        w2.save(more[i : i + 256])
        target = base + (i + 256) * SLOT
        wait_until(lambda t=target: metric(e2, "kvseal_ssd_write_bytes_total") >= t, WAIT_S, "the chunk on SSD")
    assert metric(e2, "kvseal_ssd_skipped_total") == 0
    w2.close()
    stop(e2)
    assert hashlib.sha256(victim.read_bytes()).hexdigest() == victim_sha and victim.stat().st_nlink == 2
    assert {k: v for k, v in snapshot(d).items() if k in planted} == planted
    mine = [p.name for p in segment_files(d) if p.name > "seg-00000007.kvs"]
    assert mine and "seg-00000001.kvs" not in [p.name for p in segment_files(d)]  # new numbers; the oldest reclaimed

    e3 = engine_factory(*args)
    assert recovery(e3)["bad"] == "{'untrusted': 3}", e3.stderr()
    load_all(workers(e3, "i3"), more[-256:], first_loading=True)
    assert hashlib.sha256(victim.read_bytes()).hexdigest() == victim_sha


@pytest.mark.process
def test_a_second_engine_on_a_directory_exits_naming_the_first_and_a_killed_engine_frees_it(
    tmp_path: Path, engine_factory: EngineFactory, workers: Any
) -> None:
    d = tmp_path / "ssd"
    e1 = engine_factory(*ssd_args(d))
    r = serve_fails(*ssd_args(d))
    line = one_error_line(r)
    assert r.returncode == 1 and line == (
        f"kvseal serve: error: cannot use --ssd-path {str(d)!r}: another kvseal engine (pid {e1.pid}) uses it: "
        "one engine per directory: stop that engine or pass another --ssd-path"
    ), r.stderr
    hashes = block_hashes("lock", 64)
    w = workers(e1, "i1")  # the first keeps serving
    w.save(hashes)
    wait_until(lambda: metric(e1, "kvseal_ssd_records") == len(hashes), WAIT_S, "the blocks on SSD")
    w.close()
    e1.kill()  # SIGKILL: the kernel drops its lock with its descriptors
    e2 = engine_factory(*ssd_args(d))
    assert recovery(e2)["records"] == len(hashes)
    assert (d / LOCK_FILE).read_text() == f"{e2.pid}\n"
    load_all(workers(e2, "i2"), hashes, first_loading=True)
