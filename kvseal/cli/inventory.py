"""What the engine holds, seen from outside it: `kvseal namespaces` (list, purge or compare the final namespaces of a
running engine, over its HTTP address) and `kvseal ssd inspect` (an SSD tier directory, offline). The work is
kvseal.inventory's; here are their flags and checks."""

from __future__ import annotations

import argparse
import os

from kvseal.cli.parsing import HelpFormatter, http_address


def add_namespaces_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds `kvseal namespaces [list | purge NAMESPACE_FINAL | compare NAMESPACE_FINAL OTHER]`."""
    names = sub.add_parser(
        "namespaces",
        help="what a running engine holds per final namespace and user; purge one",
        formatter_class=HelpFormatter,
    )
    names.add_argument(
        "action",
        nargs="?",
        choices=["list", "purge", "compare"],
        default="list",
        help="list, purge one, or compare two (why they cannot share blocks)",
    )
    names.add_argument("namespace", nargs="?", help="purge, compare: a final namespace (namespace.fingerprint)")
    names.add_argument("other", nargs="?", help="compare: the other final namespace")
    names.add_argument("--uid", type=int, default=None, help="purge: only this user's namespace of that name")
    names.add_argument("--http", type=http_address, default="127.0.0.1:9091", help="the engine's HTTP address")
    names.add_argument("--token", default=None, help="the engine's token; default: $KVSEAL_TOKEN")
    names.add_argument("--json", action="store_true", help="JSON instead of a table")


def check_namespaces_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """As many final namespaces as the action takes; else exits with status 2 and one line from `parser` (the
    `kvseal` parser)."""
    wanted = {"list": 0, "purge": 1, "compare": 2}[args.action]
    if [args.namespace, args.other].count(None) != 2 - wanted:
        parser.error(
            "kvseal namespaces purge NAMESPACE_FINAL | compare NAMESPACE_FINAL OTHER: name one final namespace to "
            "purge, two to compare, none to list"
        )


def run_namespaces(args: argparse.Namespace) -> int:
    from kvseal import inventory

    token = args.token or os.environ.get("KVSEAL_TOKEN") or None
    if args.action == "purge":
        return inventory.purge(args.http, token, args.namespace, args.uid, args.json)
    if args.action == "compare":
        return inventory.compare(args.http, token, args.namespace, args.other, args.json)
    return inventory.namespaces(args.http, token, args.json)


def add_ssd_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds `kvseal ssd inspect DIRECTORY...`."""
    ssd = sub.add_parser("ssd", help="offline tools for SSD tier directories")
    ssd.add_argument("what", choices=["inspect"])
    ssd.add_argument("directory", nargs="+", help="the tier's --ssd-path directories (a stopped engine's)")
    ssd.add_argument("--verify", action="store_true", help="read every record in full and check it")
    ssd.add_argument("--json", action="store_true", help="JSON instead of a table")


def run_ssd(args: argparse.Namespace) -> int:
    from kvseal import inventory

    return inventory.inspect_ssd(args.directory, args.verify, args.json)
