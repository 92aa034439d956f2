"""What every `kvseal` subcommand's parser shares: the parser and help formatter classes, the value types of its
flags (sizes, seconds, counts, groups, addresses) and the logging levels."""

from __future__ import annotations

import argparse
import grp
import math
from typing import NoReturn

from kvseal import units

SIGNAL_POLL_S = 0.2  # how often a server command's main thread wakes to run a signal's handler


def parse_size(text: str) -> int:
    """A size flag's value in bytes, or the usage error naming it (kvseal.units.parse_size)."""
    try:
        return units.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage itself is one `--help` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default as docs/reference.md's flag tables write it (30, not 30.0), except where there is none to
    show (None, on/off switches)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or isinstance(action.default, bool):
            return action.help or ""
        if isinstance(action.default, float):
            return f"{action.help} (default: {action.default:g})"
        return super()._get_help_string(action) or ""


def positive_size(text: str) -> int:
    size = parse_size(text)
    if size <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes, not {text!r}")
    return size


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds more than 0, not {text!r}")
    return value


def at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {text!r}")
    return value


def group(text: str) -> str:
    try:
        grp.getgrnam(text)
    except KeyError:
        raise argparse.ArgumentTypeError(f"no such group {text!r}") from None
    return text


def host_port(text: str, forms: str = "HOST:PORT") -> str:
    bare = text.removeprefix(":")
    if bare.isdecimal():
        # elsewhere a bare port often means every interface; this engine serves loopback unless told otherwise
        raise argparse.ArgumentTypeError(
            f"{text!r} is a bare port, and the engine listens on loopback only: pass 127.0.0.1:{bare}"
        )
    host, sep, port = text.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdecimal() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not {forms}")
    return text


def grpc_address(text: str) -> str:
    if text.startswith("unix:"):
        if not text.removeprefix("unix:").removeprefix("//"):
            raise argparse.ArgumentTypeError(f"{text!r} names no socket path")
        return text
    return host_port(text, "HOST:PORT or unix:/path")


def http_address(text: str) -> str:
    return text if text == "" else host_port(text)


LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
