"""The `kvseal` command: `kvseal serve` runs the engine; `kvseal bench engine` runs the engine benchmark."""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}


def parse_size(text: str) -> int:
    """'1GiB', '512MiB', '64m', '1073741824' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 1GiB, 512MiB or 1048576")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvseal", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the engine")
    serve.add_argument("--listen", default="127.0.0.1:50055", help="gRPC address: HOST:PORT or unix:/path")
    serve.add_argument("--http-listen", default="127.0.0.1:9091", help="HTTP address for /health, /metrics, /v1/*")
    serve.add_argument("--pool-size", type=parse_size, default=parse_size("1GiB"), help="host memory pool")
    serve.add_argument("--slab-size", type=parse_size, default=parse_size("64MiB"), help="pool slab size")
    serve.add_argument("--lease-ttl", type=float, default=30.0, help="seconds a query's lease pins its blocks")
    serve.add_argument("--inflight-timeout", type=float, default=60.0, help="seconds before incomplete pages go")
    serve.add_argument("--allow-remote", action="store_true", help="allow non-loopback addresses (needs a token)")
    serve.add_argument("--token", default=os.environ.get("KVSEAL_TOKEN"), help="shared bearer token")
    serve.add_argument(
        "--lane-socket",
        default="auto",
        help="unix socket of the local lane for Query/Release/Save/Load ('auto': beside --listen or in the temp dir; "
        "'' = off)",
    )
    serve.add_argument("--no-prefault", action="store_true", help="do not fault the pool in at start")
    serve.add_argument("--log-level", default="INFO")

    bench = sub.add_parser("bench", help="benchmarks")
    bench.add_argument("what", choices=["engine"])
    bench.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")

    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    from kvseal.bench import engine as bench_engine

    return bench_engine.main(quick=args.quick)


def _serve(args: argparse.Namespace) -> int:
    from kvseal.server.serve import EngineServer, ServeConfig

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = ServeConfig(
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
    )
    server = EngineServer(cfg)
    server.start()
    signal.signal(signal.SIGTERM, lambda *_: server.request_stop())
    signal.signal(signal.SIGINT, lambda *_: server.request_stop())
    where = cfg.listen if cfg.listen.startswith("unix:") else f"{cfg.listen.rsplit(':', 1)[0]}:{server.port}"
    print(
        f"kvseal engine serving gRPC on {where}, HTTP on port {server.http_port}, pool {cfg.pool_bytes} bytes",
        flush=True,
    )
    server.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
