"""The README's own commands, run as written.

The fenced blocks that these tests run are marked by an HTML comment on the line before the fence (invisible on
GitHub): `<!-- test: NAME -->`, optionally `<!-- test: NAME vary: TOKEN | TOKEN -->`. A block's TOKENs name the
parts of its expected output that differ from machine to machine: the whole token, or only its `[bracketed]` part
with the rest as context that must match (e.g. `4598  [0]`: the uid after a namespace). Runs of spaces match any
run of spaces, so a table whose columns widen still matches.

- `quickstart` and `cluster` are shell scripts, run by bash with `set -euo pipefail`; their stdout must be exactly
  the lines of the `quickstart-output` and `cluster-output` blocks.
- `troubleshooting` blocks are console transcripts: every `$ ` line is a command, the lines after it its expected
  output (stdout and stderr together). Their commands are meant to fail, so the transcript runs with
  `set -uo pipefail` (no `-e`), each command in the same shell, in order.

Each block runs in a temporary directory (with `examples/` linked in: the README runs from the repository root), with
the venv's bin directory first on PATH, TMPDIR in that directory (lane sockets), and in a process group of its own
that is killed afterwards, whatever the block left behind. The ports a block names must be free when it starts; a
taken one fails the test at once, naming it. Every `kvseal ...` command line of the README and of
docs/reference.md is checked against `kvseal <command> --help`, and the MetaServer's and router's flag tables in
docs/reference.md against their `--help` (the engine's table: tests/test_cli.py).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from kvseal.cli import build_parser

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
REFERENCE = REPO / "docs" / "reference.md"
BIN = Path(sys.executable).parent  # the venv's bin directory: kvseal, python
KNOWN_BLOCKS = {"quickstart", "quickstart-output", "cluster", "cluster-output", "troubleshooting"}
MARKER = re.compile(r"^<!-- test: (?P<name>[\w-]+)(?: vary: (?P<vary>.+?))? -->$")
FENCE = re.compile(r"^```(?P<lang>\w*)$")
LOCAL_PORT = re.compile(r"127\.0\.0\.1:(\d{4,5})\b")
SHELL_SEPARATORS = {";", "&", "&&", "|", "||", "(", ")"}


@dataclass(frozen=True)
class Block:
    """One fenced block of a markdown file: its language, its text, and the marker above it if it has one."""

    lang: str
    text: str
    line: int  # 1-based line of the opening fence
    name: str | None = None
    vary: tuple[str, ...] = ()


def fenced_blocks(path: Path) -> list[Block]:
    """Every fenced block of `path`, with the test marker on the line before its fence, if any."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j] == "```")
        marker = MARKER.match(lines[i - 1]) if i else None
        vary = tuple(t.strip() for t in marker["vary"].split(" | ")) if marker and marker["vary"] else ()
        text = "\n".join(lines[i + 1 : end]) + "\n"
        blocks.append(Block(fence["lang"], text, i + 1, marker["name"] if marker else None, vary))
        i = end + 1
    return blocks


def marked(name: str) -> list[Block]:
    """The README's blocks marked `<!-- test: name ... -->`, in order."""
    return [b for b in fenced_blocks(README) if b.name == name]


def the_block(name: str) -> Block:
    (block,) = marked(name)
    return block


def _literal(text: str) -> str:
    """A regex matching `text`, any run of spaces in it matching any run of spaces."""
    return " +".join(re.escape(part) for part in re.split(r" +", text))


def split_token(token: str) -> tuple[str, str, str]:
    """A vary token's (context before, varying part, context after): its outermost [brackets], else all of it."""
    bracket = re.fullmatch(r"(?P<pre>[^\[]*)\[(?P<var>.+)\](?P<post>[^\]]*)", token)
    return (bracket["pre"], bracket["var"], bracket["post"]) if bracket else ("", token, "")


def line_pattern(expected: str, vary: Sequence[str]) -> re.Pattern[str]:
    """A regex for one expected output line: each vary token's context found in the line matches with its
    bracketed part (or all of it, without brackets) as any text; everything else literally."""
    spans: list[tuple[int, int, str, str]] = []  # start, end, prefix, suffix of each token occurrence
    for token in vary:
        pre, var, post = split_token(token)
        for m in re.finditer(re.escape(pre + var + post), expected):
            spans.append((m.start(), m.end(), pre, post))
    pattern, at = "", 0
    for start, end, pre, post in sorted(spans):
        if start < at:
            continue  # overlapping tokens: the first one wins
        pattern += _literal(expected[at:start]) + _literal(pre) + ".+?" + _literal(post)
        at = end
    return re.compile(pattern + _literal(expected[at:]))


def assert_lines(actual: str, expected: str, vary: Sequence[str], what: str) -> None:
    """`actual` has exactly the lines of `expected`, but for the parts `vary` marks."""
    got, want = actual.splitlines(), expected.splitlines()
    same = len(got) == len(want) and all(line_pattern(w, vary).fullmatch(g) for w, g in zip(want, got, strict=True))
    assert same, f"{what}: the output differs from what the README says\n--- README\n{expected}--- real\n{actual}"


def check_ports_free(text: str) -> None:
    """Fails at once, naming it, when a port the block names on 127.0.0.1 is taken (rather than hang on it)."""
    for port in sorted({int(p) for p in LOCAL_PORT.findall(text)}):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError as e:
                pytest.fail(f"port {port}, which the README's block uses, is taken here ({e}): stop what listens there")


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A directory to run a block in, laid out like the repository root where the README's commands run."""
    (tmp_path / "examples").symlink_to(REPO / "examples")
    return tmp_path


def block_env(workdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KVSEAL_TOKEN", "BASH_ENV", "ENV")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"
    env["TMPDIR"] = str(workdir)
    return env


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _kill_group(pgid: int) -> None:
    """SIGTERM to what the block left running, then SIGKILL to what is still there after 10 s."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not _group_alive(pgid):
                return
            time.sleep(0.05)  # poll interval of a bounded wait for the group to be gone


def logs(workdir: Path) -> str:
    """The logs a block wrote (its background servers'), for a failure's message."""
    return "".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(workdir.glob("*.log")))


def run_bash(
    script: str, workdir: Path, timeout: float, outputs: Path | None = None
) -> tuple[subprocess.CompletedProcess[str], bool]:
    """Runs `script` with bash in `workdir`, in a new process group that is killed afterwards; also says whether
    anything of the group was still running when bash exited. A block that outlives `timeout` fails the test with
    what it printed (and the outputs of a transcript's commands so far, when they go to `outputs`)."""
    proc = subprocess.Popen(
        ["bash", "-c", script],
        cwd=workdir,
        env=block_env(workdir),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        left_running = _group_alive(proc.pid)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        out, err = proc.communicate()
        steps = (
            "".join(f"--- $ command {p.name}\n{p.read_text()}" for p in sorted(outputs.iterdir())) if outputs else ""
        )
        pytest.fail(
            f"the block did not finish within {timeout} s\n--- stdout\n{out}--- stderr\n{err}{steps}{logs(workdir)}"
        )
    finally:
        _kill_group(proc.pid)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), left_running


def run_script_block(name: str, workdir: Path, timeout: float) -> str:
    """Runs the README's `name` block as a script (set -euo pipefail); returns its stdout."""
    block = the_block(name)
    check_ports_free(block.text)
    r, left_running = run_bash("set -euo pipefail\n" + block.text, workdir, timeout)
    assert r.returncode == 0, (
        f"README block {name!r} failed (exit {r.returncode})\n{r.stdout}\n{r.stderr}\n{logs(workdir)}"
    )
    assert not left_running, f"README block {name!r} left processes running: it must stop what it starts"
    return r.stdout


def test_the_first_lines_are_the_two_setup_commands() -> None:
    """The README opens with the two commands that work on a fresh machine (CI runs the second)."""
    head = README.read_text().splitlines()[:6]
    assert head == [
        "# kvseal",
        "",
        "```sh",
        "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/kvseal serve   # set up, run the engine on"
        " defaults",
        "./scripts/test                                                                    # set up, run the whole"
        " test suite",
        "```",
    ]
    assert os.access(REPO / "scripts" / "test", os.X_OK)


def test_the_markers_are_well_formed() -> None:
    """Every marker sits right above a fence and names a known block; every vary token occurs in its block."""
    lines = README.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("<!-- test:"):
            assert MARKER.match(line), f"README.md:{i + 1}: malformed marker {line!r}"
            assert FENCE.match(lines[i + 1]), f"README.md:{i + 1}: a marker must sit right above a fence"
    names = [b.name for b in fenced_blocks(README) if b.name]
    assert set(names) == KNOWN_BLOCKS, names
    for block in fenced_blocks(README):
        for token in block.vary:
            assert "".join(split_token(token)) in block.text, f"vary token {token!r} is not in its block"


def test_the_quickstart_runs_as_written(workdir: Path) -> None:
    """The quickstart starts an engine, runs examples/worker.py against it and stops it, printing what the README
    says the user should see."""
    out = run_script_block("quickstart", workdir, timeout=90)
    expected = the_block("quickstart-output")
    assert_lines(out, expected.text, expected.vary, "quickstart")


def test_the_cluster_recipe_runs_as_written(workdir: Path) -> None:
    """Two engines, a MetaServer and the router start on the ports the README names, all answer /health, the
    MetaServer learns of node-a's blocks, and all stop."""
    out = run_script_block("cluster", workdir, timeout=120)
    expected = the_block("cluster-output")
    assert_lines(out, expected.text, expected.vary, "cluster")


def transcript(block: Block) -> list[tuple[str, str]]:
    """A console block's (command, expected output) pairs."""
    steps: list[tuple[str, str]] = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], ""))
        else:
            assert steps, f"README.md:{block.line}: output before any command"
            steps[-1] = (steps[-1][0], steps[-1][1] + line + "\n")
    return steps


@pytest.mark.parametrize("index", range(len(marked("troubleshooting"))))
def test_each_troubleshooting_line_is_what_kvseal_prints(index: int, workdir: Path) -> None:
    """Each troubleshooting transcript, run command by command: every command prints exactly the lines the
    README quotes (the error line, then its `exit status N`), but for the parts its marker says vary."""
    block = marked("troubleshooting")[index]
    check_ports_free(block.text)
    steps = transcript(block)
    outputs = workdir.parent / f"{workdir.name}-outputs"
    outputs.mkdir()
    script = "set -uo pipefail\n" + "".join(
        f"{{ {command}\n}} > {shlex.quote(str(outputs / f'{i:02}'))} 2>&1\n" for i, (command, _) in enumerate(steps)
    )
    r, _ = run_bash(script, workdir, 120, outputs)  # `kill %1` without a wait: the engine may still be stopping
    for i, (command, expected) in enumerate(steps):
        actual = (outputs / f"{i:02}").read_text()
        assert_lines(actual, expected, block.vary, f"README.md:{block.line}: $ {command}\n{logs(workdir)}")
    assert r.returncode == 0, f"the transcript's shell failed (exit {r.returncode}): {r.stderr}"


# ---------------------------------------------------------------- every kvseal command line parses


def command_lines(path: Path) -> Iterator[str]:
    """The shell lines of `path`'s fenced blocks (a console block's `$ ` lines; continuations joined), and its
    inline code spans that start with `kvseal `."""
    text = path.read_text()
    for block in fenced_blocks(path):
        if block.lang == "console":
            yield from (line[2:] for line in block.text.splitlines() if line.startswith("$ "))
        elif block.lang in ("sh", "bash"):
            yield from logical_lines(block.text)
    prose = re.sub(r"^```.*?^```$", "", text, flags=re.S | re.M)
    yield from re.findall(r"`(kvseal [^`]+)`", prose)


def logical_lines(script: str) -> Iterator[str]:
    """A script's lines, a backslash continuation or a quote that spans lines joining them into one."""
    buffer = ""
    for line in script.replace("\\\n", " ").splitlines():
        buffer = f"{buffer}\n{line}" if buffer else line
        try:
            shlex.split(buffer, comments=True)
        except ValueError:
            continue  # a quote still open: the next line continues it
        yield buffer
        buffer = ""
    assert not buffer, f"unbalanced quotes in {buffer!r}"


def kvseal_commands(line: str) -> Iterator[list[str]]:
    """The words of every simple command in `line` that runs `kvseal`."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words: list[str] = []
    for token in [*lexer, ";"]:
        if token in SHELL_SEPARATORS:
            if words and words[0] == "kvseal":
                yield words
            words = []
        else:
            words.append(token)


def command_path(words: Sequence[str]) -> tuple[str, ...]:
    """The subcommands `words` (after `kvseal`) name, found by walking kvseal's own parser."""
    parser, path = build_parser(), []
    for word in words:
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subparsers:
            break
        if word in subparsers[0].choices:
            parser = subparsers[0].choices[word]
            path.append(word)
        elif not word.startswith("-"):
            break  # an option's value or a positional argument: the path ends here
    return tuple(path)


@cache
def help_flags(path: tuple[str, ...]) -> frozenset[str]:
    """The options `kvseal <path> --help` lists (it must run and exit 0)."""
    r = subprocess.run(
        [str(BIN / "kvseal"), *path, "--help"], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )
    assert r.returncode == 0, f"kvseal {' '.join(path)} --help failed: {r.stderr}"
    return frozenset(re.findall(r"^  (?:-\w, )?(--[a-z][a-z0-9-]*)", r.stdout, flags=re.M))


@pytest.mark.parametrize("path", [README, REFERENCE], ids=lambda p: p.name)
def test_every_kvseal_command_line_parses(path: Path) -> None:
    """Every `kvseal ...` command in the file names subcommands whose --help runs, and only their flags."""
    seen = 0
    for line in command_lines(path):
        for words in kvseal_commands(line):
            sub = command_path(words[1:])
            flags = help_flags(sub)
            used = {w.split("=", 1)[0] for w in words[1:] if w.startswith("--")}
            assert used <= flags, f"{path.name}: {line!r}: kvseal {' '.join(sub)} has no {sorted(used - flags)}"
            seen += 1
    assert seen >= 10, f"only {seen} kvseal commands found in {path.name}: is the parsing broken?"


def test_a_misspelled_flag_would_be_caught() -> None:
    """The check above can fail: a flag that kvseal serve does not have is not among its --help flags."""
    (words,) = kvseal_commands("kvseal serve --pool-sise 1GiB > engine.log 2>&1 &")
    assert command_path(words[1:]) == ("serve",)
    assert "--pool-sise" not in help_flags(("serve",)) and "--pool-size" in help_flags(("serve",))
    (words,) = kvseal_commands("timeout 5 x; kvseal config print serve --config FILE | head")
    assert command_path(words[1:]) == ("config", "print", "serve")


# ---------------------------------------------------------------- docs/reference.md's flag tables


def reference_table(section: str) -> dict[str, str]:
    """The flag table under docs/reference.md's heading `section`: each flag of a row's first cell -> the row's
    default cell."""
    text = REFERENCE.read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    table = text.split("| flag | default | meaning |\n| --- | --- | --- |\n", 1)[1].split("\n\n", 1)[0]
    rows: dict[str, str] = {}
    for line in table.splitlines():
        flags_cell, default_cell = line.split(" | ")[:2]
        for flag in re.findall(r"`(--[a-z][a-z-]*)`", flags_cell):
            rows[flag] = default_cell.replace("`", "")
    return rows


def help_defaults(command: str) -> dict[str, str | None]:
    """`kvseal <command> --help`'s options (--help aside) and the default each shows (None: it shows none)."""
    r = subprocess.run(
        [str(BIN / "kvseal"), command, "--help"],
        # unwrapped: argparse would break a default such as prefix-slru at its hyphen
        env={**{k: v for k, v in os.environ.items() if k != "KVSEAL_TOKEN"}, "COLUMNS": "10000"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    options = r.stdout.split("\noptions:\n", 1)[1]
    found: dict[str, str | None] = {}
    for entry in re.split(r"\n(?=  -)", options):
        flag = re.match(r"\s*(?:-\w, )?(--[a-z][a-z-]*)", entry)
        assert flag, entry
        default = re.search(r"\(default: (.*)\)$", " ".join(entry.split()))
        found[flag.group(1)] = default.group(1) if default else None
    found.pop("--help")
    return found


@pytest.mark.parametrize(
    "command, section",
    [
        ("serve", "`kvseal serve`: the engine"),
        ("metaserver", "`kvseal metaserver`"),
        ("router", "`kvseal router`"),
    ],
)
def test_the_reference_flag_tables_are_the_help(command: str, section: str) -> None:
    """docs/reference.md's table for each server lists exactly its flags, with the defaults its --help shows."""
    table, shown = reference_table(section), help_defaults(command)
    assert sorted(table) == sorted(shown)
    assert {f: table[f] for f, d in shown.items() if d is not None} == {f: d for f, d in shown.items() if d}


# ---------------------------------------------------------------- links stay inside the repository


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown file."""
    found = set()
    for heading in re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        found.add(slug)
    return found


@pytest.mark.parametrize("path", [README, REFERENCE], ids=lambda p: p.name)
def test_links_stay_inside_the_repo_and_resolve(path: Path) -> None:
    """Every markdown link is relative, names a file of the repository, and an anchor that file has."""
    text = re.sub(r"^```.*?^```$", "", path.read_text(), flags=re.S | re.M)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        assert "://" not in link, f"{path.name}: {link} leaves the repository"
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        assert file.exists() and REPO in file.parents, f"{path.name}: {link} names no file of the repository"
        if anchor and file.suffix == ".md":
            assert anchor in anchors(file), f"{path.name}: {link}: {file.name} has no heading {anchor!r}"
