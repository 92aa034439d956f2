"""The `kvseal` command: `kvseal serve` runs the engine; `kvseal namespaces` shows (or purges) what it holds;
`kvseal ssd inspect` reads an SSD tier directory offline; `kvseal bench NAME` runs a benchmark of kvseal/bench
(engine, ssd, peer, ops, hitrate, cuda, store_ops, vllm_ttft, hybrid, pd, mooncake). The servers read --config
FILE (TOML); `kvseal config print` shows the configuration they run with."""

from __future__ import annotations

import argparse

import kvseal
from kvseal.cli import bench, config_file, inventory, serve, servers
from kvseal.cli.parsing import Parser, parse_size
from kvseal.cli.serve import serve_config
from kvseal.cli.servers import router_config

__all__ = ["build_parser", "main", "parse_args", "parse_size", "router_config", "serve_config"]


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The `kvseal` parser and its `serve` subparser."""
    parser = Parser(prog="kvseal", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {kvseal.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = serve.add_parser(sub)
    bench.add_parser(sub)
    inventory.add_namespaces_parser(sub)
    servers.add_metaserver_parser(sub)
    servers.add_router_parser(sub)
    inventory.add_ssd_parser(sub)
    config_file.add_parsers(sub)  # --config of the servers, `kvseal config print`
    return parser, serve_parser


def build_parser() -> argparse.ArgumentParser:
    """The `kvseal` command's parser (parse_args() also checks what one flag cannot check alone)."""
    return _parsers()[0]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses and checks the command line; a bad value exits with status 2 and one line naming the flag."""
    parser, serve_parser = _parsers()
    args = parser.parse_args(argv)
    config_file.apply(parser, args, argv)  # --config FILE's values, under the flags given (then checked below)
    if args.command == "metaserver":
        servers.check_metaserver_args(parser, args)
    if args.command == "router":
        servers.check_router_args(parser, args)
    if args.command == "namespaces":
        inventory.check_namespaces_args(parser, args)
    if args.command == "serve":
        serve.check_args(serve_parser, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "serve":
        return serve.run(args)
    if args.command == "namespaces":
        return inventory.run_namespaces(args)
    if args.command == "metaserver":
        return servers.run_metaserver(args)
    if args.command == "router":
        return servers.run_router(args)
    if args.command == "ssd":
        return inventory.run_ssd(args)
    if args.command == "config":
        return config_file.run(args)
    return bench.run(args)
