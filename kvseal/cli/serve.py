"""`kvseal serve`: its flags, their checks together (kvseal.server.config.check_config), the ServeConfig they make,
and the engine's process: signals, the start line, the wait for SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import threading

from kvseal.cli.parsing import (
    LOG_LEVELS,
    SIGNAL_POLL_S,
    HelpFormatter,
    at_least_one,
    group,
    grpc_address,
    http_address,
    parse_size,
    positive_seconds,
    positive_size,
)
from kvseal.core.eviction import EVICTION_POLICIES
from kvseal.errors import ConfigError
from kvseal.server.config import ServeConfig, check_config
from kvseal.units import format_size


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Adds `kvseal serve` and its flags to the `kvseal` subcommands; returns its parser (its usage errors)."""
    serve = sub.add_parser(
        "serve",
        help="run the engine",
        formatter_class=HelpFormatter,
        epilog="A start that cannot work prints one line saying why and exits: 2 when the command line cannot run, "
        "1 when this machine refuses it (an address in use, a socket path it cannot create, too little memory).",
    )
    serve.add_argument(
        "--listen", type=grpc_address, default="127.0.0.1:50055", help="gRPC address: HOST:PORT or unix:/path"
    )
    serve.add_argument(
        "--http-listen",
        type=http_address,
        default="127.0.0.1:9091",
        help="HTTP address (HOST:PORT) for /health, /metrics, /v1/*; '' = off",
    )
    serve.add_argument(
        "--pool-size",
        type=positive_size,
        default="1GiB",
        help="host memory pool, pre-faulted at start; rounded down to whole slabs",
    )
    serve.add_argument(
        "--slab-size", type=positive_size, default="64MiB", help="pool slab; the largest page must fit in one"
    )
    serve.add_argument(
        "--eviction",
        choices=EVICTION_POLICIES,
        default=EVICTION_POLICIES[0],
        help="which blocks leave a full pool: prefix-slru (prefix-lru in two segments: blocks a query hit are "
        "kept in up to half the pool, and go after the blocks never hit), prefix-lru (least recently used "
        "requests, a prompt's last blocks before its first, re-saves refresh) or lru (least recently used blocks, "
        "in prompt order); docs/benchmarks.md compares them",
    )
    serve.add_argument(
        "--lease-ttl",
        type=positive_seconds,
        default=30.0,
        help="maximum seconds a query's lease pins its blocks: a client's lease_ttl_ms is capped to it",
    )
    serve.add_argument(
        "--inflight-timeout",
        type=positive_seconds,
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
        type=group,
        default=None,
        help="make the lane socket mode 0660 with this group, so that its members can connect; default: the "
        "socket is mode 0600, only the engine's user connects",
    )
    serve.add_argument(
        "--lane-max-connections",
        type=at_least_one,
        default=4096,
        help="the most lane connections open at once",
    )
    serve.add_argument(
        "--lane-idle-timeout",
        type=positive_seconds,
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
        "--ssd-capacity",
        type=positive_size,
        default=None,
        help="bytes the SSD tier may use in each --ssd-path; a restart on a disk that filled runs with what the "
        "path's segments take plus the free space (one warning)",
    )
    serve.add_argument(
        "--ssd-segment-size",
        type=positive_size,
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
        type=grpc_address,
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
        type=grpc_address,
        default=None,
        help="HOST:PORT where other nodes fetch this node's blocks (with --metaserver); default: 127.0.0.1, a free "
        "port",
    )
    serve.add_argument(
        "--advertise",
        type=grpc_address,
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
        type=positive_seconds,
        default=10.0,
        help="seconds a fetch from another node may take, and a serving node keeps the pages pinned",
    )
    serve.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default="INFO", help="logging level")
    return serve


def check_args(serve: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The token from the flag or $KVSEAL_TOKEN, and every flag checked against the others (check_config); a bad
    value exits with status 2 and one line from `serve`'s parser."""
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


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig that `kvseal serve` runs with, from parse_args()'s result."""
    return ServeConfig(
        listen=args.listen,
        http_listen=args.http_listen,
        pool_bytes=args.pool_size,
        slab_bytes=args.slab_size,
        lease_ttl_s=args.lease_ttl,
        inflight_timeout_s=args.inflight_timeout,
        eviction=args.eviction,
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


def run(args: argparse.Namespace) -> int:
    """Runs the engine until SIGTERM or SIGINT; 1 when this machine refuses the start (a line says why)."""
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
    peers = f"peer fetches on {server.peer_address}, " if server.peer_address else ""  # only with a MetaServer
    print(
        f"kvseal engine serving gRPC on {server.grpc_address}, HTTP on {server.http_address or 'nothing (off)'}, "
        f"{peers}lane {server.lane_socket}, pool {pool} bytes ({format_size(pool)})"
        + _ssd_line(cfg, server.ssd_capacities),
        flush=True,
    )
    # in short waits: a process-wide signal may be delivered to any thread, and a main thread blocked in one long
    # wait would not run the handler until something woke it (engines ignored SIGTERM for 15 s that way)
    while not stop.wait(SIGNAL_POLL_S):
        pass
    server.stop()
    return 0


def _ssd_line(cfg: ServeConfig, capacities: tuple[int, ...]) -> str:
    """The start line's SSD part: the paths and --ssd-capacity, or per path what it got where its disk was full."""
    if not cfg.ssd_paths:
        return ""
    whole = cfg.ssd_capacity_bytes // cfg.ssd_segment_bytes * cfg.ssd_segment_bytes
    if all(c >= whole for c in capacities):
        return f", SSD {', '.join(cfg.ssd_paths)} ({format_size(cfg.ssd_capacity_bytes)} each)"
    asked = format_size(cfg.ssd_capacity_bytes)
    return ", SSD " + ", ".join(
        f"{path} ({format_size(c)}" + (f" of the {asked} asked: its disk is full)" if c < whole else ")")
        for path, c in zip(cfg.ssd_paths, capacities, strict=True)
    )
