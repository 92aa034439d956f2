"""`--config FILE` of the servers and `kvseal config print` (docs/configuration.md): the file's table under the
command line's flags, one line and status 2 for a bad file, and the printed configuration read back."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, free_port, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from test_cli import _kvseal

from kvseal import cli
from kvseal.cli import config_file
from kvseal.server.config import ServeConfig
from kvseal.testing.process import http_get, stop_process

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def _error_line(r: subprocess.CompletedProcess[str]) -> str:
    """The one line of a refused command line: status 2, nothing on stdout, no traceback."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.endswith("\n"), r.stderr
    return r.stderr.removesuffix("\n")


def _write(tmp_path: Path, text: str, name: str = "kvseal.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _parser(name: str) -> argparse.ArgumentParser:
    return config_file.subcommands(cli.build_parser())[name]


@pytest.fixture(autouse=True)
def _no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSEAL_TOKEN", raising=False)


def test_a_file_sets_the_flags_and_a_flag_wins_over_it(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        '[serve]\npool-size = "16MiB"\nslab-size = "8MiB"\nlease-ttl = 5\nno-prefault = true\n'
        'lane-max-connections = 9\nlog-level = "debug"\ntoken = "from-file"\n',
    )
    args = cli.parse_args(["serve", "--config", path])
    assert (args.pool_size, args.slab_size, args.lease_ttl, args.no_prefault) == (16 << 20, 8 << 20, 5.0, True)
    assert (args.lane_max_connections, args.log_level, args.token) == (9, "DEBUG", "from-file")
    assert cli.serve_config(args) == ServeConfig(
        pool_bytes=16 << 20,
        slab_bytes=8 << 20,
        lease_ttl_s=5.0,
        prefault=False,
        lane_max_connections=9,
        token="from-file",
    )
    flags = cli.parse_args(["serve", "--pool-size", "24MiB", "--config", path, "--lease-ttl=7", "--token", "t"])
    assert (flags.pool_size, flags.lease_ttl, flags.token, flags.slab_size) == (24 << 20, 7.0, "t", 8 << 20)


def test_a_repeated_flag_replaces_the_files_list(tmp_path: Path) -> None:
    path = _write(
        tmp_path, '[router]\nprefill = ["http://127.0.0.1:1", "http://127.0.0.1:2"]\ndecode = ["http://d:3"]\n'
    )
    args = cli.parse_args(["router", "--config", path])
    assert (args.prefill, args.decode) == (["http://127.0.0.1:1", "http://127.0.0.1:2"], ["http://d:3"])
    args = cli.parse_args(["router", "--config", path, "--prefill", "http://p:9"])
    assert (args.prefill, args.decode) == (["http://p:9"], ["http://d:3"])


def test_one_file_serves_every_server(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        '[serve]\npool-size = "16MiB"\nslab-size = "8MiB"\n\n[metaserver]\nmax-nodes = 7\nstale-after = 2.5\n\n'
        '[router]\nprefill = ["http://127.0.0.1:1"]\ndecode = ["http://127.0.0.1:2"]\npolicy = "least_inflight"\n'
        'max-body-size = "1MiB"\n',
    )
    assert cli.parse_args(["serve", "--config", path]).pool_size == 16 << 20
    meta = cli.parse_args(["metaserver", "--config", path])
    assert (meta.max_nodes, meta.stale_after, meta.store) == (7, 2.5, "memory")
    router = cli.parse_args(["router", "--config", path])
    assert (router.policy, router.max_body_size) == ("least_inflight", 1 << 20)
    assert router.router_config.policy == "least_inflight"  # checked after the merge


def test_every_flag_is_a_key_a_flag_added_later_too() -> None:
    for name in config_file.COMMANDS:
        parser = _parser(name)
        flags = {s for a in parser._actions for s in a.option_strings if s.startswith("--")}
        assert {f"--{key}" for key in config_file.keys(parser)} == flags - {"--help", "--config"}
    parser = _parser("serve")
    parser.add_argument("--added-later", choices=["lru", "fifo"], default="lru")
    assert config_file.merge(parser, {"added-later": "fifo"}, []).added_later == "fifo"
    assert config_file.merge(parser, {"added-later": "fifo"}, ["--added-later", "lru"]).added_later == "lru"


LONG = "x" * 300

# (file, argv after the command, the error line less its "kvseal CMD: error: " and " (see kvseal CMD --help)";
# {path}: the file)
BAD_FILES = [
    ('[serve]\npool_size = "1GiB"\n', [], "{path} [serve]: unknown key 'pool_size' (did you mean 'pool-size'?)"),
    ("[serve]\nlane-sockt = 'x'\n", [], "{path} [serve]: unknown key 'lane-sockt' (did you mean 'lane-socket'?)"),
    (
        "[serve]\npool-size = true\n",
        [],
        "{path} [serve] pool-size: expected a string or a number, got true (a boolean)",
    ),
    ("[serve]\nnode-id = 3\n", [], "{path} [serve] node-id: expected a string, got 3 (an integer)"),
    (
        "[serve]\nno-prefault = 'yes'\n",
        [],
        "{path} [serve] no-prefault: expected true or false, got 'yes' (a string)",
    ),
    (
        '[serve]\nssd-path = "/a"\n',
        [],
        "{path} [serve] ssd-path: expected an array of strings, got '/a' (a string)",
    ),
    ("[serve]\nssd-path = ['/a', 2]\n", [], "{path} [serve] ssd-path[1]: expected a string, got 2 (an integer)"),
    (
        f"[serve]\nallow-remote = '{LONG}'\n",
        [],
        f"{{path}} [serve] allow-remote: expected true or false, got '{'x' * 32}'... (300 characters) (a string)",
    ),
    (
        f"[serve]\nlisten = ['{LONG}']\n",
        [],
        f"{{path}} [serve] listen: expected a string or a number, got ['{'x' * 38}... (an array)",
    ),
    (
        '[serve]\npool-size = "12parsecs"\n',
        [],
        "{path} [serve] pool-size: '12parsecs' is not a size such as 1GiB, 512MiB or 1048576",
    ),
    (
        '[serve]\nssd-recovery = "fast"\n',
        [],
        "{path} [serve] ssd-recovery: expected one of 'scan', 'strict', 'none', got 'fast'",
    ),
    (b"[serve]\nnode-id = '\xff'\n", [], "argument --config: {path} is not TOML: it is not UTF-8 text"),
    (
        "[router]\npolicy = 'round_robin'\n",
        [],
        "argument --config: {path} has no [serve] table, where kvseal serve reads its settings",
    ),
    ('pool-size = "1GiB"\n', [], "{path}: key 'pool-size' is outside any table: put it in the [serve] table"),
    (
        "[serv]\n",
        [],
        "{path}: unknown key 'serv' at the top level (did you mean 'serve'?): a key goes in the table of its "
        "command, [serve], [metaserver] or [router]",
    ),
    ("serve = 1\n", [], "{path}: serve: expected a table, [serve], got 1 (an integer)"),
    # a bad file is refused even where the command line gives the flag
    (
        '[serve]\npool-size = "0"\n',
        ["--pool-size", "1GiB"],
        "{path} [serve] pool-size: must be more than 0 bytes, not '0'",
    ),
    # the flags are checked together after the merge, as without a file
    (
        '[serve]\npool-size = "8MiB"\nslab-size = "16MiB"\n',
        [],
        "argument --pool-size: 8 MiB is less than one slab (--slab-size 16 MiB): pass --pool-size 16MiB or more, or "
        "a smaller --slab-size (the largest page must fit in a slab)",
    ),
]


@pytest.mark.parametrize(("text", "argv", "expected"), BAD_FILES, ids=[e[:40] for _, _, e in BAD_FILES])
def test_a_bad_file_exits_2_with_one_line(tmp_path: Path, text: str | bytes, argv: list[str], expected: str) -> None:
    path = tmp_path / "kvseal.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    line = _error_line(_kvseal("serve", "--config", str(path), *argv))
    assert line == f"kvseal serve: error: {expected.format(path=path)} (see kvseal serve --help)"


def test_the_example_file_holds_only_keys_and_values_its_commands_take() -> None:
    path = str(REPO / "deploy" / "kvseal.toml")
    document = config_file.load(path)
    assert list(document) == list(config_file.COMMANDS)
    for name in config_file.COMMANDS:
        config_file.merge(_parser(name), config_file.table(document, name, path), [], f"{path} [{name}]")


def test_a_file_that_is_not_toml_exits_2_saying_where(tmp_path: Path) -> None:
    path = _write(tmp_path, "[serve]\npool-size = \n")
    line = _error_line(_kvseal("serve", "--config", path))
    assert line.startswith(f"kvseal serve: error: argument --config: {path} is not TOML: ") and "line 2" in line


def test_a_missing_file_exits_2_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.toml"
    line = _error_line(_kvseal("metaserver", "--config", str(path)))
    assert line == (
        f"kvseal metaserver: error: argument --config: cannot read {path}: No such file or directory "
        "(see kvseal metaserver --help)"
    )
    line = _error_line(_kvseal("serve", "--config", str(tmp_path)))
    assert (
        line
        == f"kvseal serve: error: argument --config: cannot read {tmp_path}: Is a directory (see kvseal serve --help)"
    )


def test_router_and_metaserver_keys_are_checked(tmp_path: Path) -> None:
    path = _write(tmp_path, "[router]\npolcy = 'least_inflight'\n\n[metaserver]\nmax-nodes = 0\n")
    assert _error_line(_kvseal("router", "--config", path)) == (
        f"kvseal router: error: {path} [router]: unknown key 'polcy' (did you mean 'policy'?) "
        "(see kvseal router --help)"
    )
    assert _error_line(_kvseal("metaserver", "--config", path)) == (
        f"kvseal metaserver: error: {path} [metaserver] max-nodes: must be at least 1, not '0' "
        "(see kvseal metaserver --help)"
    )


def test_a_flag_fixes_what_the_file_gets_wrong_together(tmp_path: Path) -> None:
    path = _write(tmp_path, '[serve]\npool-size = "8MiB"\nslab-size = "16MiB"\n')
    assert cli.parse_args(["serve", "--config", path, "--slab-size", "8MiB"]).slab_size == 8 << 20


def _print(*argv: str) -> str:
    r = _kvseal("config", "print", *argv)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    return r.stdout


def test_config_print_round_trips(tmp_path: Path) -> None:
    ssd = tmp_path / "ssd"
    path = _write(
        tmp_path,
        f'[serve]\npool-size = "16MiB"\nslab-size = "8MiB"\nssd-path = ["{ssd}"]\nssd-capacity = "512MiB"\n'
        'lease-ttl = 2.5\nno-prefault = true\ntoken = "a \\"quoted\\" token\\n"\n',
    )
    argv = ["--config", path, "--pool-size", "24MiB", "--lane-socket", "/tmp/l.sock"]
    printed = _print("serve", *argv)
    table = tomllib.loads(printed)["serve"]
    assert table["pool-size"] == "24MiB" and table["slab-size"] == "8MiB" and table["ssd-path"] == [str(ssd)]
    assert table["lease-ttl"] == 2.5 and table["no-prefault"] is True and table["allow-remote"] is False
    assert table["token"] == 'a "quoted" token\n' and table["listen"] == "127.0.0.1:50055"
    unset = {line.split(":")[0].removeprefix("# ") for line in printed.splitlines() if line.endswith(": not set")}
    assert set(table) | unset == set(config_file.keys(_parser("serve")))  # every key, defaults included
    again = _write(tmp_path, printed, "printed.toml")
    assert _print("serve", "--config", again) == printed
    ours, theirs = cli.parse_args(["serve", "--config", again]), cli.parse_args(["serve", *argv])
    assert vars(ours) | {"config": None} == vars(theirs) | {"config": None}


def test_config_print_without_a_command_prints_every_table(tmp_path: Path) -> None:
    path = _write(tmp_path, '[router]\nprefill = ["http://127.0.0.1:1"]\ndecode = ["http://127.0.0.1:2"]\n')
    printed = _print("--config", path)
    document = tomllib.loads(printed)
    assert list(document) == ["serve", "metaserver", "router"]
    assert document["router"]["prefill"] == ["http://127.0.0.1:1"] and document["serve"]["pool-size"] == "1GiB"
    again = _write(tmp_path, printed, "printed.toml")
    for name in config_file.COMMANDS:
        assert tomllib.loads(_print(name, "--config", again)) == {name: document[name]}


def test_config_print_checks_as_the_command_does() -> None:
    line = _error_line(_kvseal("config", "print", "serve", "--pool-size", "8MiB", "--slab-size", "16MiB"))
    assert line.startswith("kvseal config print serve: error: argument --pool-size: 8 MiB is less than one slab")
    line = _error_line(_kvseal("config", "print", "router"))
    assert line.startswith("kvseal config print router: error: argument --prefill: no instance given")


# what a file may hold for some of serve's flags and what the flag then holds, and the same for the command line
FILE_VALUES: dict[str, list[tuple[Any, Any]]] = {
    "pool-size": [("16MiB", 16 << 20), (1 << 30, 1 << 30)],
    "lease-ttl": [(5, 5.0), (2.5, 2.5), ("7", 7.0)],
    "no-prefault": [(True, True), (False, False)],
    "ssd-path": [(["/a"], ["/a"]), (["/a", "/b"], ["/a", "/b"]), ([], [])],
    "log-level": [("debug", "DEBUG")],
    "node-id": [("n1", "n1")],
}
FLAG_VALUES: dict[str, list[tuple[list[str], Any]]] = {
    "pool-size": [(["--pool-size", "32MiB"], 32 << 20)],
    "lease-ttl": [(["--lease-ttl", "9"], 9.0)],
    "no-prefault": [(["--no-prefault"], True)],
    "ssd-path": [(["--ssd-path", "/c"], ["/c"]), (["--ssd-path", "/c", "--ssd-path=/d"], ["/c", "/d"])],
    "log-level": [(["--log-level", "error"], "ERROR")],
    "node-id": [(["--node-id=n2"], "n2")],
}
SERVE = _parser("serve")
DEFAULTS = SERVE.parse_args([])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_merge_takes_the_flag_else_the_file_else_the_default(data: st.DataObject) -> None:
    in_file = data.draw(st.sets(st.sampled_from(sorted(FILE_VALUES))))
    in_argv = data.draw(st.sets(st.sampled_from(sorted(FLAG_VALUES))))
    file_picks = {key: data.draw(st.sampled_from(FILE_VALUES[key])) for key in sorted(in_file)}
    flag_picks = {key: data.draw(st.sampled_from(FLAG_VALUES[key])) for key in sorted(in_argv)}
    chunks = data.draw(st.permutations([argv for argv, _ in flag_picks.values()]))
    args = config_file.merge(SERVE, {k: raw for k, (raw, _) in file_picks.items()}, [a for c in chunks for a in c])
    for key in FILE_VALUES:
        dest = key.replace("-", "_")
        if key in flag_picks:
            assert getattr(args, dest) == flag_picks[key][1]
        elif key in file_picks:
            assert getattr(args, dest) == file_picks[key][1]
        else:
            assert getattr(args, dest) == getattr(DEFAULTS, dest)
    assert args.slab_size == DEFAULTS.slab_size


@given(st.text())
def test_a_printed_string_reads_back(text: str) -> None:
    assert tomllib.loads(f"key = {config_file.toml_string(text)}") == {"key": text}


@pytest.mark.process
def test_serve_runs_with_the_files_settings(tmp_path: Path) -> None:
    """The file's ports and pool serve; --slab-size on the command line wins over the file's 64MiB slab, which a
    16 MiB pool could not hold."""
    for _attempt in range(3):  # a port from free_port() may be taken before the engine binds it: new ones
        grpc_port, http_port = free_port(), free_port()
        path = _write(
            tmp_path,
            f'[serve]\nlisten = "127.0.0.1:{grpc_port}"\nhttp-listen = "127.0.0.1:{http_port}"\n'
            'pool-size = "16MiB"\nslab-size = "64MiB"\nno-prefault = true\n',
        )
        env = {k: v for k, v in os.environ.items() if k != "KVSEAL_TOKEN"}
        with open(tmp_path / "engine.stderr", "w+") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvseal", "serve", "--config", path, "--slab-size", "8MiB"],
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
            try:
                assert proc.stdout is not None
                line = proc.stdout.readline()  # the serving line, or "" when it exited
                if not line and proc.wait() == 1 and "cannot listen" in (tmp_path / "engine.stderr").read_text():
                    continue
                assert line.startswith(
                    f"kvseal engine serving gRPC on 127.0.0.1:{grpc_port}, HTTP on 127.0.0.1:{http_port}, lane "
                ), (line, (tmp_path / "engine.stderr").read_text())
                assert line.endswith(", pool 16777216 bytes (16 MiB)\n"), line
                health, metrics = (f"http://127.0.0.1:{http_port}{p}" for p in ("/health", "/metrics"))
                wait_until(lambda: http_get(health)[0] == 200, 30, "/health")  # noqa: B023 (called here)
                status, body = http_get(metrics)
                families = text_string_to_metric_families(body.decode())
                pool = [s.value for f in families for s in f.samples if s.name == "kvseal_pool_bytes"]
                assert status == 200 and pool == [16 << 20], pool
                assert stop_process(proc) and proc.returncode == 0
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                proc.stdout.close()
        assert "Traceback" not in (tmp_path / "engine.stderr").read_text()
        return
    pytest.fail("three starts lost a port to another process")
