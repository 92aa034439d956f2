"""A real `kvseal serve` in a subprocess, for tests and benchmarks: started on free loopback ports, waited for until
it serves, read over HTTP, and stopped (SIGTERM, then SIGKILL) with what went wrong reported.

    engine = EngineProcess(workdir, ["--ssd-path", d])   # returns at once
    engine.wait_ready()                                  # /health answers 200 and gRPC accepts connections
    with engine.client() as client: ...
    problems = engine.stop()                             # [] when it ran and stopped cleanly

The engine's stdout and stderr go to files in `workdir` (NAME.stdout and NAME.stderr, or one NAME.log with
merge_output); stderr() reads them back.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvseal.client import EngineClient
from kvseal.errors import KvsealError, Unavailable

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
STACK_DUMP_S = 1.0  # what faulthandler gets to write every thread's stack after SIGUSR1


def free_port() -> int:
    """A TCP port nobody listens on right now (bind port 0, read it, close). Another process may take it before
    the caller binds it: EngineProcess.lost_port() tells that case apart."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, token: str | None = None, timeout: float = 10.0) -> tuple[int, bytes]:
    """(status, body) of a GET; an HTTP error status is returned, not raised (OSError still is)."""
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read()


def serve_command(
    listen: str,
    http_listen: str,
    extra: Sequence[str] = (),
    *,
    pool_size: str | int | None = "64MiB",
    slab_size: str | int | None = "8MiB",
    log_level: str | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The `python -m kvseal serve` command line; None leaves a flag at the engine's default. `extra` comes last,
    so a flag in it wins over the same flag here. `python`: the interpreter (another environment's engine)."""
    argv = [python, "-m", "kvseal", "serve", "--listen", listen, "--http-listen", http_listen]
    for flag, value in (("--pool-size", pool_size), ("--slab-size", slab_size), ("--log-level", log_level)):
        if value is not None:
            argv += [flag, str(value)]
    return [*argv, *extra]


def stop_process(proc: subprocess.Popen[Any], timeout: float = STOP_TIMEOUT_S, dump_stacks: bool = False) -> bool:
    """SIGTERM, then SIGKILL if it has not exited after `timeout` seconds (with dump_stacks, SIGUSR1 first: a
    kvseal process writes every thread's stack to its stderr). True when it exited on its own or on SIGTERM."""
    if proc.poll() is not None:
        return True
    proc.send_signal(signal.SIGTERM)
    return _wait_or_kill(proc, timeout, dump_stacks)


def _wait_or_kill(proc: subprocess.Popen[Any], timeout: float, dump_stacks: bool) -> bool:
    try:
        proc.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        if dump_stacks:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(STACK_DUMP_S)  # for faulthandler to write it
        proc.kill()
        proc.wait(timeout=timeout)
        return False


class EngineStartFailed(Unavailable, RuntimeError):
    """The engine exited while starting, or did not serve in time; the message carries its stderr."""


class EngineProcess:
    """A running `kvseal serve`. `target` is its gRPC address, `http` its HTTP base URL, `token` the --token in
    its arguments (None without one).

    `extra`: more `kvseal serve` arguments (they win over pool_size, slab_size and log_level). `listen`: the gRPC
    address (HOST:PORT or unix:PATH; default a free loopback port), `http_port` likewise. `wrapper`: a command
    line the serve command is appended to; it must exec its arguments (`taskset -c 1`, a shell that sets a
    resource limit first). `env`: variables set for the engine on top of this process's environment. `cwd`: its
    working directory (default this process's). `python`: the interpreter that runs it (an engine installed in
    another environment). `name`: the log files' names in `workdir`; with merge_output
    stdout and stderr go to one NAME.log."""

    def __init__(
        self,
        workdir: Path,
        extra: Sequence[str] = (),
        listen: str | None = None,
        wrapper: Sequence[str] = (),
        *,
        http_port: int | None = None,
        name: str = "engine",
        pool_size: str | int | None = "64MiB",
        slab_size: str | int | None = "8MiB",
        log_level: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        merge_output: bool = False,
        python: str = sys.executable,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.target = listen or f"127.0.0.1:{free_port()}"
        self.http_port = http_port or free_port()
        self.http = f"http://127.0.0.1:{self.http_port}"
        self.token = _token_of(extra)
        if merge_output:
            self.stdout_path = self.stderr_path = workdir / f"{name}.log"
        else:
            self.stdout_path, self.stderr_path = workdir / f"{name}.stdout", workdir / f"{name}.stderr"
        command = serve_command(
            self.target,
            f"127.0.0.1:{self.http_port}",
            extra,
            pool_size=pool_size,
            slab_size=slab_size,
            log_level=log_level,
            python=python,
        )
        self.args = [*wrapper, *command]
        environment = dict(os.environ, **env) if env else None
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                self.args,
                cwd=cwd,
                env=environment,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT if merge_output else err,
            )
        self.expect_exit = False
        self._terminated = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def log_path(self) -> Path:
        """Where its stderr (its log) goes."""
        return self.stderr_path

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.stderr().splitlines()[-lines:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def lost_port(self) -> bool:
        """It exited because a port free_port() gave was taken meanwhile (by another process)."""
        return not self.alive() and "cannot listen" in self.stderr()

    def kill(self) -> None:
        """SIGKILL, as a crash would; stop() then expects the engine gone."""
        self.expect_exit = True
        self.proc.kill()
        self.proc.wait()

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> float:
        """Returns the seconds since the call when GET /health answers 200 and gRPC accepts connections; raises
        EngineStartFailed if the engine exits or does not get ready in time.

        /health is polled first: the engine starts HTTP after gRPC, and polling a refused HTTP port is cheap,
        whereas a gRPC channel that found nobody listening backs off for a second before trying again."""
        start = time.monotonic()
        deadline = start + timeout
        while True:
            if not self.alive():
                self.expect_exit = True
                raise EngineStartFailed(f"engine exited with {self.proc.returncode} while starting:\n{self.stderr()}")
            if time.monotonic() > deadline:
                raise EngineStartFailed(f"engine HTTP not ready after {timeout}s:\n{self.stderr()}")
            try:
                if http_get(f"{self.http}/health", timeout=1.0)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.02)  # poll interval of a bounded wait on a real condition
        with EngineClient(self.target, token=self.token) as client:
            try:
                client.wait_ready(timeout=max(1.0, deadline - time.monotonic()))
            except KvsealError as e:
                raise EngineStartFailed(f"engine gRPC not ready: {e}\n{self.stderr()}") from None
        return time.monotonic() - start

    def client(self, **kwargs: Any) -> EngineClient:
        kwargs.setdefault("token", self.token)
        return EngineClient(self.target, **kwargs)

    def get(self, path: str, token: str | None = None) -> tuple[int, bytes]:
        return http_get(self.http + path, token=token if token is not None else self.token)

    def get_json(self, path: str) -> Any:
        status, body = self.get(path)
        if status != 200:
            raise AssertionError((path, status, body))
        return json.loads(body)

    def metrics_text(self) -> str:
        status, body = self.get("/metrics")
        if status != 200:
            raise AssertionError((status, body))
        return body.decode()

    def metric(self, name: str, **labels: str) -> float | None:
        """The value of one sample of /metrics (None when absent)."""
        for family in text_string_to_metric_families(self.metrics_text()):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return None

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by its exposition name, labels included (counters carry their _total suffix)."""
        out = {}
        for line in self.metrics_text().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def rss(self) -> dict[str, int]:
        """VmRSS, VmHWM, RssAnon, RssFile and RssShmem of the engine process, in bytes."""
        out = {}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.startswith(("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM")):
                out[key] = int(value.split()[0]) * 1024
        return out

    def terminate(self) -> None:
        """SIGTERM without waiting (stop() waits for it later): engines stop side by side."""
        if self.alive() and not self._terminated:
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = True

    def stop(self, timeout: float = STOP_TIMEOUT_S, dump_stacks: bool = False) -> list[str]:
        """Stops the engine (SIGTERM, SIGKILL after `timeout` s; with dump_stacks SIGUSR1 first, so that its stderr
        shows where it hung); returns what went wrong, empty when it ran and stopped cleanly: it died on its own
        (unless expect_exit), ignored SIGTERM, exited non-zero, or printed a Traceback."""
        problems = []
        if not self.alive() and not self._terminated:
            if not self.expect_exit:
                problems.append(f"engine died unexpectedly with exit code {self.proc.returncode}")
        else:
            self.terminate()
            if not _wait_or_kill(self.proc, timeout, dump_stacks):
                problems.append(f"engine ignored SIGTERM for {timeout}s and was killed")
            elif self.proc.returncode != 0:
                problems.append(f"engine exited with {self.proc.returncode} after SIGTERM")
        err = self.stderr()
        if "Traceback" in err:
            problems.append("engine printed a Traceback")
        if problems:
            problems.append(f"--- engine stderr ---\n{err}")
        return problems


def _token_of(extra: Sequence[str]) -> str | None:
    args = list(extra)
    for i, a in enumerate(args):
        if a == "--token" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--token="):
            return a.split("=", 1)[1]
    return None
