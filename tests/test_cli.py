"""`kvseal serve`'s command line: bad values stop it at start with one line and exit status 2; defaults in --help."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Sequence

import pytest
from conftest import REPO, free_port

from kvseal import cli


def _serve(*extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m kvseal serve` on unused ports (nothing is bound: these values are refused before)."""
    base = os.environ | (env or {})
    if env is None or "KVSEAL_TOKEN" not in env:
        base.pop("KVSEAL_TOKEN", None)
    cmd = [
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
    (["--slab-size", "0"], "--slab-size"),
    (["--pool-size", "8MiB", "--slab-size", "16MiB"], "--slab-size"),
    (["--lane-max-connections", "0"], "--lane-max-connections"),
    (["--lane-max-connections", "-1"], "--lane-max-connections"),
    (["--lane-max-connections", "1.5"], "--lane-max-connections"),
    (["--lane-idle-timeout", "0"], "--lane-idle-timeout"),
    (["--lane-idle-timeout", "nan"], "--lane-idle-timeout"),
    (["--lane-group", "no-such-group-kvseal"], "--lane-group"),
    (["--lane-group", "root", "--lane-socket", ""], "--lane-group"),
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
    for default in ("127.0.0.1:50055", "127.0.0.1:9091", "1GiB", "64MiB", "30.0", "4096", "auto", "INFO"):
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
    from kvseal.server.serve import ServeConfig

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
