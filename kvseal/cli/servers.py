"""The cluster's servers beside the engine: `kvseal metaserver` (which node holds which block) and `kvseal router`
(an OpenAI-compatible prefill/decode router in front of vLLM instances): their flags, checks and processes."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from kvseal.auth import is_loopback
from kvseal.cli.parsing import (
    LOG_LEVELS,
    SIGNAL_POLL_S,
    HelpFormatter,
    at_least_one,
    grpc_address,
    host_port,
    http_address,
    positive_seconds,
    positive_size,
)
from kvseal.errors import ConfigError

if TYPE_CHECKING:
    from kvseal.router import RouterConfig


def add_metaserver_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds `kvseal metaserver` and its flags to the `kvseal` subcommands."""
    meta = sub.add_parser(
        "metaserver", help="run the MetaServer: which node holds which block", formatter_class=HelpFormatter
    )
    meta.add_argument("--listen", type=grpc_address, default="127.0.0.1:50056", help="gRPC address: HOST:PORT")
    meta.add_argument("--http-listen", type=http_address, default="127.0.0.1:9092", help="/health, /metrics; '' = off")
    meta.add_argument(
        "--store",
        default="memory",
        help="'memory' (embedded: a restart forgets, nodes announce again) or redis://HOST:PORT/DB (a real "
        "redis-server: several MetaServers on one Redis agree, a restart forgets nothing)",
    )
    meta.add_argument("--stale-after", type=positive_seconds, default=10.0, help="seconds a silent node stays visible")
    meta.add_argument(
        "--forget-after", type=positive_seconds, default=60.0, help="seconds after staleness a node is forgotten"
    )
    meta.add_argument("--max-nodes", type=at_least_one, default=4096, help="nodes known at once (live or stale)")
    meta.add_argument("--max-blocks-per-node", type=at_least_one, default=1 << 21, help="blocks one node may announce")
    meta.add_argument(
        "--max-blocks",
        type=at_least_one,
        default=1 << 23,
        help="blocks of every node together (the memory store needs ~0.6 KB per block)",
    )
    meta.add_argument("--allow-remote", action="store_true", help="allow non-loopback addresses (needs a token)")
    meta.add_argument("--token", default=None, help="shared bearer token; default: $KVSEAL_TOKEN, else none")
    meta.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default="INFO", help="logging level")


def check_metaserver_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The token from the flag or $KVSEAL_TOKEN; remote addresses only with --allow-remote and a token; a store
    the MetaServer knows. A bad value exits with status 2 and one line from `parser` (the `kvseal` parser)."""
    args.token = args.token or os.environ.get("KVSEAL_TOKEN") or None
    remote = [a for a in (args.listen, args.http_listen) if a and not is_loopback(a)]
    if remote and not (args.allow_remote and args.token):
        parser.error(
            f"argument --listen: {remote[0]!r} is not a loopback address: pass 127.0.0.1:PORT, or add "
            "--allow-remote and --token to open the MetaServer to other machines"
        )
    if not (args.store == "memory" or args.store.startswith("redis://")):
        parser.error(f"argument --store: 'memory' or redis://HOST:PORT/DB, got {args.store!r}")


def run_metaserver(args: argparse.Namespace) -> int:
    """Runs the MetaServer until SIGTERM or SIGINT; 1 when it cannot start (a line says why)."""
    from kvseal.errors import KvsealError
    from kvseal.meta.server import MetaConfig, MetaServer

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = MetaConfig(
        listen=args.listen,
        http_listen=args.http_listen,
        store=args.store,
        stale_after_s=args.stale_after,
        forget_after_s=args.forget_after,
        token=args.token,
        max_nodes=args.max_nodes,
        max_blocks_per_node=args.max_blocks_per_node,
        max_blocks=args.max_blocks,
    )
    try:
        server = MetaServer(cfg)
        server.start()
    except (KvsealError, ConnectionError) as e:
        print(f"kvseal metaserver: error: {e}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: server.request_stop())
    signal.signal(signal.SIGINT, lambda *_: server.request_stop())
    http = f"127.0.0.1:{server.http_port}" if server.http_port else "nothing (off)"
    print(
        f"kvseal metaserver serving gRPC on {args.listen.rsplit(':', 1)[0]}:{server.port}, HTTP on {http}, store "
        f"{args.store} (epoch {server.store.epoch})",
        flush=True,
    )
    while not server.wait(SIGNAL_POLL_S):  # short waits, so that the main thread runs the handler (kvseal serve's)
        pass
    server.stop()
    return 0


def add_router_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds `kvseal router` and its flags to the `kvseal` subcommands."""
    router = sub.add_parser(
        "router",
        help="run an OpenAI-compatible prefill/decode router in front of vLLM instances",
        formatter_class=HelpFormatter,
    )
    router.add_argument(
        "--prefill", action="append", default=None, help="http://HOST:PORT of a prefill instance (repeat for several)"
    )
    router.add_argument(
        "--decode", action="append", default=None, help="http://HOST:PORT of a decode instance (repeat for several)"
    )
    router.add_argument("--listen", type=host_port, default="127.0.0.1:8000", help="HTTP address: HOST:PORT")
    router.add_argument(
        "--policy",
        choices=["round_robin", "least_inflight"],
        default="round_robin",
        help="how an instance is picked: in turn, or the one with the fewest requests in flight at the router",
    )
    router.add_argument(
        "--metaserver",
        type=host_port,
        default=None,
        help="HOST:PORT of a kvseal metaserver: pick the decode instance whose node holds the longest prefix",
    )
    router.add_argument("--token", default=None, help="the MetaServer's token; default: $KVSEAL_TOKEN")
    router.add_argument(
        "--timeout",
        type=positive_seconds,
        default=300.0,
        help="seconds an instance may take to answer (a decode stream: to stay silent) before the client gets 504",
    )
    router.add_argument(
        "--max-requests",
        type=int,
        default=0,
        help="requests served at once; beyond them a client gets 503 at once (0: a quarter of the open-file limit, "
        "which the router raises to its hard limit, at most 8192)",
    )
    router.add_argument(
        "--max-body-size",
        type=positive_size,
        default="4MiB",
        help="the largest request body; a larger one gets 413",
    )
    router.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --listen address")
    router.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default="INFO", help="logging level")


def check_router_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Sets args.router_config, checked (kvseal.router.check_config); a bad value exits with status 2 and one line
    from `parser` (the `kvseal` parser)."""
    from kvseal.router import check_config as check_router

    try:
        args.router_config = check_router(router_config(args))
    except ConfigError as e:
        parser.error(str(e))


def router_config(args: argparse.Namespace) -> RouterConfig:
    """The RouterConfig that `kvseal router` runs with, from the parsed command line (before its checks)."""
    from kvseal.router import RouterConfig

    return RouterConfig(
        prefill=tuple(args.prefill or ()),
        decode=tuple(args.decode or ()),
        listen=args.listen,
        policy=args.policy,
        metaserver=args.metaserver or "",
        token=args.token or os.environ.get("KVSEAL_TOKEN") or None,
        timeout_s=args.timeout,
        allow_remote=args.allow_remote,
        max_requests=args.max_requests,
        max_body_bytes=args.max_body_size,
    )


def run_router(args: argparse.Namespace) -> int:
    """Runs the router with the configuration check_router_args() made."""
    from kvseal import router

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return router.run(args.router_config)
