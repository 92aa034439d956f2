"""`kvseal serve`'s command line: bad values stop it at start with one line and exit status 2; defaults in --help."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import os
import re
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from conftest import REPO, EngineProcess, Meta, free_port, wait_until

from kvseal import cli
from kvseal.client import EngineClient
from kvseal.server.config import physical_memory
from kvseal.units import format_size


def _serve(
    *extra: str, env: dict[str, str] | None = None, wrapper: Sequence[str] = ()
) -> subprocess.CompletedProcess[str]:
    """`python -m kvseal serve` on unused ports, `extra` last (a flag given twice takes its last value); `wrapper`:
    a command line that execs the serve command appended to it."""
    base = os.environ | (env or {})
    if env is None or "KVSEAL_TOKEN" not in env:
        base.pop("KVSEAL_TOKEN", None)
    cmd = [
        *wrapper,
        sys.executable,
        "-m",
        "kvseal",
        "serve",
        "--listen",
        f"127.0.0.1:{free_port()}",
        "--http-listen",
        f"127.0.0.1:{free_port()}",
        "--pool-size",
        "64MiB",
        "--slab-size",
        "8MiB",
        "--no-prefault",
        *extra,
    ]
    return subprocess.run(cmd, cwd=REPO, env=base, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


BAD = [
    (["--lease-ttl", "0"], "--lease-ttl"),
    (["--lease-ttl", "-1"], "--lease-ttl"),
    (["--lease-ttl", "nan"], "--lease-ttl"),
    (["--lease-ttl", "inf"], "--lease-ttl"),
    (["--lease-ttl", "soon"], "--lease-ttl"),
    (["--inflight-timeout", "0"], "--inflight-timeout"),
    (["--inflight-timeout", "-2.5"], "--inflight-timeout"),
    (["--pool-size", "0"], "--pool-size"),
    (["--pool-size", "0.1"], "--pool-size"),  # 0 bytes
    (["--pool-size", "12parsecs"], "--pool-size"),
    (["--pool-size", "9" * 400], "--pool-size"),  # was an OverflowError traceback
    (["--slab-size", "0"], "--slab-size"),
    (["--pool-size", "8MiB", "--slab-size", "16MiB"], "--pool-size"),
    (["--lane-max-connections", "0"], "--lane-max-connections"),
    (["--lane-max-connections", "-1"], "--lane-max-connections"),
    (["--lane-max-connections", "1.5"], "--lane-max-connections"),
    (["--lane-idle-timeout", "0"], "--lane-idle-timeout"),
    (["--lane-idle-timeout", "nan"], "--lane-idle-timeout"),
    (["--lane-group", "no-such-group-kvseal"], "--lane-group"),
    (["--lane-socket", ""], "--lane-socket"),
    (["--token", ""], "--token"),
    (["--listen", "nowhere"], "--listen"),
    (["--listen", "unix:"], "--listen"),
    (["--http-listen", "127.0.0.1:99999"], "--http-listen"),
    (["--log-level", "loud"], "--log-level"),
]


@pytest.mark.parametrize(("extra", "flag"), BAD, ids=[" ".join(extra) for extra, _ in BAD])
def test_bad_value_exits_2_with_one_line_naming_the_flag(extra: Sequence[str], flag: str) -> None:
    r = _serve(*extra)
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""  # it never got to serving
    assert "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.endswith("\n"), r.stderr
    assert r.stderr.startswith("kvseal serve: error: ") and flag in r.stderr, r.stderr


def test_empty_kvseal_token_is_refused() -> None:
    r = _serve(env={"KVSEAL_TOKEN": ""})
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "KVSEAL_TOKEN" in r.stderr and "Traceback" not in r.stderr


def test_help_shows_defaults_and_token_variable() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvseal", "serve", "--help"],
        cwd=REPO,
        env=os.environ | {"KVSEAL_TOKEN": "s3cret-in-env"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())  # argparse wraps lines
    for default in ("127.0.0.1:50055", "127.0.0.1:9091", "1GiB", "64MiB", "30", "4096", "auto", "INFO"):
        assert f"(default: {default})" in text
    assert "$KVSEAL_TOKEN" in text
    assert "s3cret-in-env" not in text  # the help never prints the token
    assert "capped" in text  # --lease-ttl is the most a client may ask for
    assert "0660" in text and "--lane-idle-timeout" in text and "--lane-max-connections" in text


def test_edge_values_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSEAL_TOKEN", raising=False)
    args = cli.parse_args(
        ["serve", "--pool-size", "8MiB", "--slab-size", "8MiB", "--lease-ttl", "0.001", "--inflight-timeout", "1"]
        + ["--lane-max-connections", "1", "--lane-idle-timeout", "0.5", "--lane-group", "root", "--http-listen", ""]
    )
    assert (args.pool_size, args.slab_size, args.lease_ttl, args.inflight_timeout) == (8 << 20, 8 << 20, 0.001, 1.0)
    assert (args.lane_max_connections, args.lane_idle_timeout, args.lane_group) == (1, 0.5, "root")
    assert args.token is None and args.http_listen == ""
    defaults = cli.parse_args(["serve"])
    assert (defaults.pool_size, defaults.slab_size, defaults.lease_ttl) == (1 << 30, 64 << 20, 30.0)
    assert (defaults.lane_group, defaults.lane_max_connections, defaults.lane_idle_timeout) == (None, 4096, 60.0)
    monkeypatch.setenv("KVSEAL_TOKEN", "from-env")
    assert cli.parse_args(["serve"]).token == "from-env"
    assert cli.parse_args(["serve", "--token", "from-flag"]).token == "from-flag"


def test_serve_config_gets_every_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvseal.server.app import ServeConfig

    fields = {f.name for f in dataclasses.fields(ServeConfig)}
    new = {"lane_group", "lane_max_connections", "lane_idle_timeout_s"}
    assert new <= fields
    monkeypatch.delenv("KVSEAL_TOKEN", raising=False)
    argv = ["serve", "--listen", "unix:/tmp/kvseal-test.sock", "--http-listen", "127.0.0.1:0", "--pool-size", "16MiB"]
    argv += ["--slab-size", "2MiB", "--lease-ttl", "5", "--inflight-timeout", "7", "--token", "t", "--no-prefault"]
    argv += ["--lane-socket", "/tmp/l.sock", "--lane-group", "root", "--lane-max-connections", "9"]
    argv += ["--lane-idle-timeout", "11"]
    cfg = cli.serve_config(cli.parse_args(argv))
    assert cfg == dataclasses.replace(
        ServeConfig(),
        listen="unix:/tmp/kvseal-test.sock",
        http_listen="127.0.0.1:0",
        pool_bytes=16 << 20,
        slab_bytes=2 << 20,
        lease_ttl_s=5.0,
        inflight_timeout_s=7.0,
        token="t",
        prefault=False,
        lane_socket="/tmp/l.sock",
        lane_group="root",
        lane_max_connections=9,
        lane_idle_timeout_s=11.0,
    )
    assert cli.serve_config(cli.parse_args(["serve"])) == ServeConfig()  # the CLI's defaults are ServeConfig's


def _one_error_line(r: subprocess.CompletedProcess[str]) -> str:
    """The one line a refused start prints (it never got to serving, and printed no traceback)."""
    assert r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.endswith("\n"), r.stderr
    return r.stderr.removesuffix("\n")


def test_usage_errors_of_a_first_hour_say_what_to_do() -> None:
    """The lines of issue 12: each names the flag, what is wrong and the fix, and exits 2 before binding anything."""
    port = free_port()
    see = " (see kvseal serve --help)"
    memory = format_size(physical_memory())
    cases = [
        (
            ["--listen", str(port)],
            f"argument --listen: '{port}' is a bare port, and the engine listens on loopback only: pass "
            f"127.0.0.1:{port}",
        ),
        (
            ["--http-listen", str(port)],
            f"argument --http-listen: '{port}' is a bare port, and the engine listens on loopback only: pass "
            f"127.0.0.1:{port}",
        ),
        (
            ["--listen", f"0.0.0.0:{port}"],
            f"argument --listen: '0.0.0.0:{port}' is not a loopback address, and the engine listens on loopback only: "
            f"pass 127.0.0.1:{port} (for other machines to reach it, add --allow-remote and --token)",
        ),
        (
            ["--listen", f"0.0.0.0:{port}", "--allow-remote"],
            f"argument --allow-remote: listening on '0.0.0.0:{port}' needs a shared token too: pass --token or set "
            "$KVSEAL_TOKEN",
        ),
        (
            ["--pool-size", "100TiB"],
            f"argument --pool-size: 100 TiB is more than this machine's memory ({memory}): pass a smaller size, such "
            "as 1GiB",
        ),
        (["--pool-size", "0"], "argument --pool-size: must be more than 0 bytes, not '0'"),
        (
            ["--pool-size", "1", "--slab-size", "1"],
            "argument --slab-size: must be at least 64 bytes, pages are aligned to that",
        ),
        (
            ["--pool-size", "8MiB", "--slab-size", "16MiB"],
            "argument --pool-size: 8 MiB is less than one slab (--slab-size 16 MiB): pass --pool-size 16MiB or more, "
            "or a smaller --slab-size (the largest page must fit in a slab)",
        ),
        (
            ["--peer-listen", f"127.0.0.1:{port}"],
            "argument --peer-listen/--advertise/--peer-transport: peers find this node through a MetaServer: pass "
            "--metaserver HOST:PORT too",
        ),
        (
            ["--metaserver", "127.0.0.1:1", "--peer-listen", f"0.0.0.0:{port}"],
            f"argument --peer-listen: '0.0.0.0:{port}' is not a loopback address, and the engine listens on loopback "
            f"only: pass 127.0.0.1:{port} (for other machines to reach it, add --allow-remote and --token)",
        ),
        (
            ["--metaserver", "127.0.0.1:1", "--peer-listen", f"0.0.0.0:{port}", "--allow-remote", "--token", "t"],
            f"argument --peer-listen: other nodes cannot reach '0.0.0.0:{port}', a wildcard address: pass "
            "--advertise HOST:PORT too, the address they reach this node at",
        ),
        (
            ["--metaserver", "127.0.0.1:1", "--peer-transport", "mooncake"],
            "argument --peer-transport: Mooncake's transport listens on every interface of this machine and lets "
            "whoever reaches its ports read and write the pool, without the token: pass --allow-remote to accept "
            "that (only where every host that can reach this one is trusted), or use --peer-transport tcp",
        ),
        (
            ["--lane-socket", ""],
            "argument --lane-socket: the lane cannot be off, workers register, save and load over it: leave "
            "--lane-socket out (auto) or pass a path",
        ),
    ]
    for extra, expected in cases:
        r = _serve(*extra)
        assert (r.returncode, _one_error_line(r)) == (2, f"kvseal serve: error: {expected}{see}"), extra


def _kvseal(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`python -m kvseal ARGV` as a newcomer runs it: no $KVSEAL_TOKEN, none of _serve's flags added."""
    env = {k: v for k, v in os.environ.items() if k != "KVSEAL_TOKEN"}
    return subprocess.run(
        [sys.executable, "-m", "kvseal", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def test_a_pool_smaller_than_the_default_slab_names_pool_size() -> None:
    """--slab-size was not passed: the line blames --pool-size and says the minimum is the default slab size."""
    r = _kvseal("serve", "--pool-size", "10MiB", "--listen", f"127.0.0.1:{free_port()}")
    assert (r.returncode, _one_error_line(r)) == (
        2,
        "kvseal serve: error: argument --pool-size: 10 MiB is less than one slab, 64 MiB (the default --slab-size): "
        "pass --pool-size 64MiB or more, or lower the slab size, e.g. --slab-size 8MiB (the largest page must fit in "
        "a slab) (see kvseal serve --help)",
    )


def test_an_ssd_capacity_past_the_free_space_is_refused(tmp_path: Path) -> None:
    """The tier directory does not exist yet: its nearest existing parent's filesystem is the one measured."""
    ssd = tmp_path / "not" / "yet"
    r = _serve("--ssd-path", str(ssd), "--ssd-capacity", "1PiB")
    line = _one_error_line(r)
    assert r.returncode == 2, line
    assert re.fullmatch(
        r"kvseal serve: error: argument --ssd-capacity: 1 PiB is more than the [0-9.]+ ([KMGTP]iB|bytes) free on the "
        rf"filesystem of --ssd-path '{re.escape(str(ssd))}': pass a smaller --ssd-capacity or free space there "
        r"\(see kvseal serve --help\)",
        line,
    ), line
    assert not (tmp_path / "not").exists()  # refused before touching anything
    two = [str(tmp_path / "a"), str(tmp_path / "b")]
    r = _serve("--ssd-path", two[0], "--ssd-path", two[1], "--ssd-capacity", "1PiB")
    line = _one_error_line(r)
    assert r.returncode == 2 and line.startswith(
        f"kvseal serve: error: argument --ssd-capacity: 1 PiB for each of --ssd-path '{two[0]}', '{two[1]}' (2 PiB "
        "in all) is more than the "
    ), line


def test_an_ssd_capacity_within_the_free_space_starts(
    tmp_path: Path, engine_factory: Callable[..., EngineProcess]
) -> None:
    ssd = tmp_path / "ssd"
    engine = engine_factory("--ssd-path", str(ssd), "--ssd-capacity", "32MiB", "--ssd-segment-size", "16MiB")
    wait_until(lambda: engine.stdout_path.read_text().endswith("\n"), 10, "the startup line")
    assert engine.stdout_path.read_text().endswith(f", SSD {ssd} (32 MiB each)\n")


def test_a_directory_holding_segments_is_left_to_the_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restart of an engine whose disk filled: the flags are not refused for want of room, the start measures the
    engine's own segments (fit_ssd_capacity) once it holds the directory."""
    from kvseal.server import config

    ssd = tmp_path / "ssd"
    ssd.mkdir()
    with open(ssd / "seg-00000001.kvs", "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 8 << 20)
    real = os.statvfs(ssd)
    full = os.statvfs_result((*real[:4], 0, *real[5:]))  # f_bavail: 0 bytes free
    monkeypatch.setattr(config.os, "statvfs", lambda _: full)
    cfg = config.ServeConfig(pool_bytes=64 << 20, slab_bytes=2 << 20, ssd_paths=(str(ssd),), ssd_segment_bytes=4 << 20)
    config.check_config(dataclasses.replace(cfg, ssd_capacity_bytes=1 << 40))


def test_the_capacity_that_fits_counts_the_engines_segments_and_the_free_space() -> None:
    from kvseal.errors import ConfigError
    from kvseal.server.config import ServeConfig, fit_ssd_capacity
    from kvseal.ssd.device import DirectorySpace

    mib = 1 << 20
    one = ServeConfig(ssd_paths=("/a",), ssd_capacity_bytes=40 * mib, ssd_segment_bytes=4 * mib)
    assert fit_ssd_capacity(one, [DirectorySpace(1, 8 * mib, 64 * mib)]) == [40 * mib]  # it fits: as asked
    assert fit_ssd_capacity(one, [DirectorySpace(1, 8 * mib, 9 * mib)]) == [16 * mib]  # whole segments
    with pytest.raises(
        ConfigError,
        match=r"^argument --ssd-capacity: 40 MiB does not fit on the filesystem of "
        r"--ssd-path '/a': its segments take 4 MiB and 3 MiB is free for it, less than the two "
        r"segments a path needs \(8 MiB\): free space there$",
    ):
        fit_ssd_capacity(one, [DirectorySpace(1, 4 * mib, 3 * mib)])
    with pytest.raises(ConfigError, match=r"^argument --ssd-capacity: 40 MiB is more than the 9 MiB free on the "):
        fit_ssd_capacity(one, [DirectorySpace(1, 0, 9 * mib)])  # none of the engine's segments: refused as fresh
    two = dataclasses.replace(one, ssd_paths=("/a", "/b", "/c"))
    spaces = [DirectorySpace(1, 12 * mib, 20 * mib), DirectorySpace(1, 0, 20 * mib), DirectorySpace(2, 0, 99 * mib)]
    assert fit_ssd_capacity(two, spaces) == [20 * mib, 8 * mib, 40 * mib]  # one filesystem's free space is shared


HTTP_PORT_HINT = "pass --http HOST:PORT, the engine's HTTP address (kvseal serve --http-listen, default 127.0.0.1:9091)"


@contextlib.contextmanager
def _answering(reply: bytes) -> Iterator[str]:
    """A TCP server on loopback that reads what comes, answers `reply` and closes; yields its HOST:PORT."""
    server = _listener()

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return  # closed at the end of the test
            with conn:
                conn.recv(4096)
                conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.shutdown(socket.SHUT_RDWR)
        server.close()
        thread.join(5)


# what the engine's gRPC port answers an HTTP/1.1 request: an HTTP/2 SETTINGS frame, then GOAWAY
H2_REPLY = bytes.fromhex("000006040000000000000500004000") + bytes.fromhex("0000080700000000000000000000000001")


@pytest.mark.parametrize("reply", [H2_REPLY, b"", b"SSH-2.0-OpenSSH_9.6\r\n"], ids=["http2", "close", "ssh"])
def test_namespaces_at_a_port_that_speaks_no_http_says_which_port(reply: bytes) -> None:
    with _answering(reply) as address:
        r = _kvseal("namespaces", "--http", address)
    assert (r.returncode, r.stdout, r.stderr) == (
        1,
        "",
        f"kvseal: {address} did not answer HTTP: {HTTP_PORT_HINT}, not its gRPC --listen address\n",
    )


def test_namespaces_at_the_engines_grpc_port_says_which_port(engine: EngineProcess) -> None:
    r = _kvseal("namespaces", "--http", engine.target)
    assert (r.returncode, r.stdout, r.stderr) == (
        1,
        "",
        f"kvseal: {engine.target} did not answer HTTP: {HTTP_PORT_HINT}, not its gRPC --listen address\n",
    )


def test_namespaces_at_a_closed_port_names_the_address() -> None:
    with _listener() as closed:  # closed on leaving: nothing listens at its port any more
        address = f"127.0.0.1:{closed.getsockname()[1]}"
    r = _kvseal("namespaces", "--http", address)
    assert (r.returncode, r.stdout, r.stderr) == (
        1,
        "",
        f"kvseal: no engine answers at {address}: Connection refused: start one (kvseal serve) or {HTTP_PORT_HINT}\n",
    )


def test_namespaces_at_an_http_server_that_is_no_engine_says_so() -> None:
    reply = b"HTTP/1.0 200 OK\r\nContent-Type: text/html\r\n\r\n<html>hello</html>"
    with _answering(reply) as address:
        r = _kvseal("namespaces", "--http", address)
    assert (r.returncode, r.stdout, r.stderr) == (
        1,
        "",
        f"kvseal: {address} answered http://{address}/v1/namespaces with something that is not JSON, so it is not a "
        f"kvseal engine: {HTTP_PORT_HINT}\n",
    )


AS_LIMIT = 1 << 30
AS_POOL = "2GiB"


def _pool_cannot_be_allocated() -> list[str]:
    """A wrapper command under which allocating a 2 GiB pool fails (RLIMIT_AS of 1 GiB); with AS_POOL, a start that
    allocated the pool before checking its addresses prints the pool's error instead of the address's."""
    code = "import os, resource, sys; n = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_AS, (n, n)); "
    code += "os.execv(sys.argv[2], sys.argv[2:])"
    return [sys.executable, "-c", code, str(AS_LIMIT)]


@pytest.fixture
def short_tmp() -> Iterator[str]:
    """A directory under /tmp: unix socket paths must stay under 108 bytes, which pytest's tmp_path may not."""
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="kvseal-") as tmp:
        yield tmp


def _listener() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def _refused(*extra: str) -> str:
    """Starts serve with a 2 GiB pool that cannot be allocated: the address must be refused first, with exit 1."""
    r = _serve("--pool-size", AS_POOL, *extra, wrapper=_pool_cannot_be_allocated())
    line = _one_error_line(r)
    assert r.returncode == 1, line
    return line


def test_peer_port_in_use_is_named_before_the_pool_is_allocated() -> None:
    with _listener() as taken:
        port = taken.getsockname()[1]
        line = _refused("--metaserver", "127.0.0.1:1", "--peer-listen", f"127.0.0.1:{port}")
    assert line == (
        f"kvseal serve: error: cannot listen on '127.0.0.1:{port}' (--peer-listen): the address is in use: stop what "
        "listens there or pass another --peer-listen"
    )


def test_grpc_port_in_use_is_named_before_the_pool_is_allocated() -> None:
    with _listener() as taken:
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        assert _refused("--listen", address) == (
            f"kvseal serve: error: cannot listen on '{address}' (--listen): the address is in use: stop what listens "
            "there or pass another --listen"
        )


def test_http_port_in_use_is_named_before_the_pool_is_allocated() -> None:
    with _listener() as taken:
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        assert _refused("--http-listen", address) == (
            f"kvseal serve: error: cannot listen on '{address}' (--http-listen): the address is in use: stop what "
            "listens there or pass another --http-listen"
        )


def test_unix_socket_in_a_missing_directory_is_named(short_tmp: str) -> None:
    missing = os.path.join(short_tmp, "no", "such")
    assert _refused("--listen", f"unix:{missing}/x.sock") == (
        f"kvseal serve: error: cannot listen on 'unix:{missing}/x.sock' (--listen): directory '{missing}' does not "
        "exist: create it or pass another --listen"
    )
    assert _refused("--lane-socket", f"{missing}/x.lane") == (
        f"kvseal serve: error: cannot listen on '{missing}/x.lane' (--lane-socket): directory '{missing}' does not "
        "exist: create it or pass another --lane-socket"
    )
    assert os.listdir(short_tmp) == []


def test_a_path_that_is_not_a_socket_is_left_alone(short_tmp: str) -> None:
    path = os.path.join(short_tmp, "notes.txt")
    with open(path, "w") as f:
        f.write("mine")
    assert _refused("--lane-socket", path) == (
        f"kvseal serve: error: cannot listen on '{path}' (--lane-socket): '{path}' is not a socket: remove it or pass "
        "another --lane-socket"
    )
    with open(path) as f:
        assert f.read() == "mine"


def test_a_failed_start_leaves_a_running_engines_sockets_alone(
    short_tmp: str, engine_factory: Callable[..., EngineProcess]
) -> None:
    grpc_path = os.path.join(short_tmp, "engine.sock")
    lane_path = f"{grpc_path}.lane"
    running = engine_factory(listen=f"unix:{grpc_path}")
    inodes = {p: os.stat(p).st_ino for p in (grpc_path, lane_path)}
    assert _refused("--listen", f"unix:{grpc_path}") == (
        f"kvseal serve: error: cannot listen on 'unix:{grpc_path}' (--listen): another engine serves it: stop that "
        "engine or pass another --listen"
    )
    assert _refused("--lane-socket", lane_path) == (
        f"kvseal serve: error: cannot listen on '{lane_path}' (--lane-socket): another engine serves it: stop that "
        "engine or pass another --lane-socket"
    )
    assert {p: os.stat(p).st_ino for p in inodes} == inodes
    with EngineClient(running.target) as client:
        assert client.info().lane_socket == lane_path  # still the running engine's, over its own gRPC socket


def test_a_stale_socket_is_replaced(short_tmp: str, engine_factory: Callable[..., EngineProcess]) -> None:
    """A socket nobody serves (an engine that was killed) is no reason to refuse a start."""
    grpc_path = os.path.join(short_tmp, "engine.sock")
    for path in (grpc_path, f"{grpc_path}.lane"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
            stale.bind(path)
    engine = engine_factory(listen=f"unix:{grpc_path}")
    assert stat.S_ISSOCK(os.stat(grpc_path).st_mode) and engine.alive()


def test_a_pool_the_machine_cannot_allocate_is_named() -> None:
    r = _serve("--pool-size", AS_POOL, wrapper=_pool_cannot_be_allocated())
    line = _one_error_line(r)
    assert r.returncode == 1, line
    assert re.fullmatch(
        r"kvseal serve: error: cannot allocate the 2 GiB pool: Cannot allocate memory: pass a smaller --pool-size "
        r"\([0-9.]+ [KMGT]iB of memory is available now; the address-space limit \(ulimit -v\) is 1 GiB\)",
        line,
    ), line


def test_startup_line_names_every_address(engine: EngineProcess) -> None:
    lane = os.path.join(tempfile.gettempdir(), f"kvseal-{engine.target.rsplit(':', 1)[1]}.lane.sock")
    expected = (
        f"kvseal engine serving gRPC on {engine.target}, HTTP on 127.0.0.1:{engine.http_port}, lane {lane}, "
        "pool 67108864 bytes (64 MiB)"
    )
    wait_until(lambda: engine.stdout_path.read_text().endswith("\n"), 10, "the startup line")
    assert engine.stdout_path.read_text() == expected + "\n"


def test_startup_line_names_the_peer_port(
    meta: Callable[..., Meta], engine_factory: Callable[..., EngineProcess]
) -> None:
    peer = f"127.0.0.1:{free_port()}"
    engine = engine_factory("--metaserver", f"127.0.0.1:{meta().port}", "--peer-listen", peer)
    wait_until(lambda: engine.stdout_path.read_text().endswith("\n"), 10, "the startup line")
    line = engine.stdout_path.read_text()
    assert f", HTTP on 127.0.0.1:{engine.http_port}, peer fetches on {peer}, lane " in line, line


def test_a_metaserver_name_that_does_not_resolve_is_named(engine_factory: Callable[..., EngineProcess]) -> None:
    """`--metaserver meta:50056` where `meta` is no host name here: the engine serves, and its one warning says
    the name does not resolve (not only UNAVAILABLE)."""
    engine = engine_factory("--metaserver", "nosuchhost.invalid:50056")
    wait_until(lambda: "does not resolve" in engine.stderr_path.read_text(), 20, "the MetaServer warning")
    (line,) = [line for line in engine.stderr_path.read_text().splitlines() if "MetaServer" in line]
    assert "MetaServer nosuchhost.invalid:50056 unavailable (UNAVAILABLE: the name 'nosuchhost.invalid' does " in line


def test_version_is_the_package_version() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvseal", "--version"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert (r.returncode, r.stdout, r.stderr) == (0, f"kvseal {importlib.metadata.version('kvseal')}\n", "")


def test_sizes_read_as_written_and_written_as_read() -> None:
    from kvseal.units import parse_size

    assert [parse_size(t) for t in ("1GiB", "512MiB", " 64m ", "1073741824", "1.5k", "2tb")] == [
        1 << 30,
        512 << 20,
        64 << 20,
        1 << 30,
        1536,
        2 * 10**12,
    ]
    for n in (0, 1000, 3 << 10, 7 << 20, 3 << 30, 2 << 40, 5 << 50):
        assert parse_size(format_size(n)) == n
    with pytest.raises(ValueError, match=r"^'1 parsec' is not a size such as 1GiB"):
        parse_size("1 parsec")
    assert parse_size(format_size(1 << 60)) == 1 << 60
    with pytest.raises(ValueError, match=r"\(400 characters\) is more than 1 EiB$"):
        parse_size("9" * 400)  # exact arithmetic: no float overflow, and the message quotes a few dozen bytes
