"""Assembles a running engine: gRPC (engine API + grpc.health.v1), HTTP and the local lane, on the addresses asked
for. Every address is checked (kvseal.server.addresses) and gRPC's bound before the pool is allocated: a taken
port or an unusable path fails at once instead of after faulting gigabytes in."""

from __future__ import annotations

import logging
import os
import re
import resource
import socket
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvseal.auth import token_interceptor
from kvseal.engine.engine import Engine
from kvseal.errors import ConfigError
from kvseal.limits import raise_open_file_limit
from kvseal.proto import kvseal_pb2_grpc as pb_grpc
from kvseal.server.addresses import StartError, bind_failure, check_addresses, check_unix, lane_socket_path, unix_path
from kvseal.server.config import ServeConfig, check_config, fit_ssd_capacity, mapped_per_uid_cap
from kvseal.server.grpc_service import EngineService
from kvseal.server.http import HttpServer
from kvseal.server.lane_server import LaneServer
from kvseal.server.metrics import Metrics
from kvseal.ssd.device import FileDevice, TierDirectoryError
from kvseal.ssd.tier import DiskTier
from kvseal.units import format_size

__all__ = ["EngineServer", "ServeConfig", "StartError"]

log = logging.getLogger("kvseal.server")
MAX_MESSAGE_BYTES = 16 << 20  # the largest valid Query (131072 hashes of 64 bytes) is ~9 MiB


class EngineServer:
    """A running engine. `start()` binds and serves (StartError when this machine refuses); `stop()` ends sessions
    and shuts every server down."""

    engine: Engine
    metrics: Metrics
    service: EngineService

    def __init__(self, cfg: ServeConfig) -> None:
        check_config(cfg)
        self.cfg = cfg
        interceptors = [token_interceptor(cfg.token)] if cfg.token else []
        self._grpc = grpc.server(
            futures.ThreadPoolExecutor(max_workers=cfg.max_workers, thread_name_prefix="kvseal-rpc"),
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ],
            maximum_concurrent_rpcs=cfg.max_workers,
        )
        self._health = health.HealthServicer()
        for service in ("", "kvseal.v1.Engine"):  # SERVING once every listener serves
            self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        self._http: HttpServer | None = None
        self._lane: LaneServer | None = None
        self._grpc_socket: tuple[str, int] | None = None  # (path, inode) of the unix socket gRPC bound
        self._stop = threading.Event()
        self._announcer: Any = None
        self._peer_server: Any = None
        self._fetcher: Any = None
        self._plane: Any = None
        self.port = 0
        self.lane_socket = ""

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.stop(0)  # releases only what this engine bound
            raise

    def _start(self) -> None:
        cfg = self.cfg
        raise_open_file_limit()  # every lane session holds a descriptor, every mapped memfd one more
        check_addresses(cfg)
        grpc_path = unix_path(cfg.listen)
        self.port = self._bind_grpc(grpc_path)
        self.lane_socket = lane_socket_path(cfg, self.port)
        check_unix(self.lane_socket, self.lane_socket, "--lane-socket")  # its name may come from the port just bound

        self.engine = _allocate_engine(cfg, _open_ssd(cfg))
        self.metrics = Metrics(self.engine)
        self.service = EngineService(self.engine, self.metrics, token=cfg.token is not None, unix=bool(grpc_path))
        self.service.port = self.port
        pb_grpc.add_EngineServicer_to_server(self.service, self._grpc)
        if cfg.http_listen:  # bound now (a taken port fails the start), served last
            host, port = cfg.http_listen.rsplit(":", 1)
            try:
                self._http = HttpServer(host.strip("[]"), int(port), self.engine, self.metrics, cfg.token)
            except OSError as e:  # taken since check_addresses()
                raise bind_failure(cfg.http_listen, "--http-listen", e) from None
        # Ready means ready: a client that sees /health answer, or gets Info, finds the lane serving. So the lane
        # serves first, gRPC (bound above, its connections waiting in the backlog) starts once everything else
        # does, and HTTP, whose /health the orchestrators and tests poll, last.
        self._lane = LaneServer(
            self.lane_socket,
            self.engine,
            self.metrics,
            token=cfg.token,
            group=cfg.lane_group,
            max_connections=cfg.lane_max_connections,
            idle_timeout_s=cfg.lane_idle_timeout_s,
        )
        self._lane.start()
        self.service.lane_socket = self.lane_socket
        if cfg.metaserver:
            self._start_peers()
        threading.Thread(target=self._tick, name="kvseal-tick", daemon=True).start()
        self._grpc.start()
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._health.set("kvseal.v1.Engine", health_pb2.HealthCheckResponse.SERVING)
        if self._http is not None:
            self._http.start()

    def _start_peers(self) -> None:
        """Serves this node's blocks to other nodes, fetches theirs on a miss, and tells the MetaServer what it
        holds."""
        from kvseal.meta.announcer import Announcer, ClaimRefused
        from kvseal.peer.client import PeerFetcher
        from kvseal.peer.server import PeerServer

        cfg = self.cfg
        node_id = cfg.node_id or default_node_id(cfg.listen, self.port)
        self.service.node_id = node_id
        host, port = (cfg.peer_listen or "127.0.0.1:0").rsplit(":", 1)
        # Mooncake's offer names the host other nodes reach: the advertised one when there is one
        offered_host = (cfg.advertise.rsplit(":", 1)[0] if cfg.advertise else host).strip("[]")
        self._plane = _open_plane(cfg.peer_transport, self.engine, offered_host)
        try:
            self._peer_server = PeerServer(
                self.engine, host.strip("[]"), int(port), self._plane, token=cfg.token, timeout_s=cfg.peer_timeout_s
            )
        except OSError as e:
            raise bind_failure(cfg.peer_listen or f"{host}:{port}", "--peer-listen", e) from None
        self._peer_server.start()
        self._fetcher = PeerFetcher(
            cfg.metaserver,
            node_id,
            self._plane,
            token=cfg.token,
            timeout_s=cfg.peer_timeout_s,
            on_meta_rpc=self.metrics.observe_meta_rpc,
        )
        self.engine.use_peers(self._fetcher)
        announcer = Announcer(
            self.engine, cfg.metaserver, node_id, cfg.advertise or self._peer_server.address, token=cfg.token
        )
        try:
            announcer.claim()  # the node id is this engine's, or the start fails here
        except ClaimRefused as e:
            announcer.close()
            raise StartError(str(e)) from None
        self._announcer = announcer
        self._announcer.start()
        self.metrics.watch_peers(self._announcer, self._peer_server, self._fetcher)
        if self._http is not None:
            self._http.peers = self._fetcher

    @property
    def peer_address(self) -> str:
        """Where this node serves peer fetches ('' without a MetaServer)."""
        return self._peer_server.address if self._peer_server is not None else ""

    def _bind_grpc(self, grpc_path: str | None) -> int:
        listen = self.cfg.listen
        old_umask = os.umask(0o177) if grpc_path else None
        try:
            port = self._grpc.add_insecure_port(listen)
        except RuntimeError:
            port = 0  # taken since check_addresses(); gRPC logged why
        finally:
            if old_umask is not None:
                os.umask(old_umask)
        if port == 0:
            raise StartError(f"cannot listen on {listen!r} (--listen): gRPC could not bind it: pass another --listen")
        if grpc_path:
            os.chmod(grpc_path, 0o600)
            self._grpc_socket = (grpc_path, os.stat(grpc_path).st_ino)
        return port

    @property
    def grpc_address(self) -> str:
        """Where gRPC listens, with the port it got for a port 0."""
        listen = self.cfg.listen
        return listen if listen.startswith("unix:") else f"{listen.rsplit(':', 1)[0]}:{self.port}"

    @property
    def http_address(self) -> str:
        """Where HTTP listens ('' when off), with the port it got for a port 0."""
        return f"{self.cfg.http_listen.rsplit(':', 1)[0]}:{self._http.port}" if self._http else ""

    @property
    def pool_bytes(self) -> int:
        """The pool's size: --pool-size rounded down to whole slabs."""
        return self.engine.pool_bytes

    @property
    def ssd_capacities(self) -> tuple[int, ...]:
        """Per --ssd-path, the bytes its log may take: less than --ssd-capacity where its disk was full at start."""
        ssd = self.engine.statistics().ssd
        return ssd.capacities if ssd is not None else ()

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            self.engine.tick()
            if self._lane:
                self._lane.sweep()

    def wait(self) -> None:
        """Blocks until request_stop() (the CLI's SIGTERM/SIGINT handler) is called."""
        self._stop.wait()

    def request_stop(self) -> None:
        self._stop.set()

    def stop(self, grace: float = 1.0) -> None:
        self._stop.set()
        self._health.enter_graceful_shutdown()
        self._grpc.stop(grace).wait()
        if self._grpc_socket:  # gRPC removes its socket only if it got to serving
            _unlink_if_same(*self._grpc_socket)
        if self._announcer is not None:
            self._announcer.stop()  # the MetaServer stops offering this node's blocks
        if self._peer_server is not None:
            self._peer_server.stop()
        if self._fetcher is not None:
            self._fetcher.close()
        if self._lane:
            self._lane.stop()
        if self._http:
            self._http.stop()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()  # after the lane: no save comes any more; the SSD writers drain and seal
        if self._plane is not None:
            self._plane.close()


def default_node_id(listen: str, port: int) -> str:
    """The node id of an engine without --node-id: HOSTNAME:PORT of its gRPC --listen, HOSTNAME:PATH for a unix
    socket. Two engines on one host cannot share a port or a socket path, so their ids differ; one engine keeps its
    id across restarts (a restarted engine takes its id over once its predecessor unregistered or went stale)."""
    where = listen.removeprefix("unix:").removeprefix("//") if listen.startswith("unix:") else str(port)
    return re.sub(r"[^A-Za-z0-9._:@+=/-]", "_", f"{socket.gethostname()}:{where}")[:256]


def _unlink_if_same(path: str, inode: int) -> None:
    """Removes `path` if it is still the file this engine created (not another engine's since)."""
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except OSError:
        pass


def _open_plane(transport: str, engine: Engine, host: str) -> Any:
    """The data plane that moves pages between nodes (kvseal.peer)."""
    if transport == "mooncake":
        from kvseal.peer.mooncake import MooncakeDataPlane, MooncakeUnavailable

        try:
            plane = MooncakeDataPlane(engine.arena.bytes, host)
        except MooncakeUnavailable as e:
            raise StartError(f"--peer-transport mooncake: {e}") from None
        log.warning(
            "--peer-transport mooncake: Mooncake's ports (%s) listen on every interface and let whoever connects read "
            "and write the pool, without the token: firewall them to the cluster's hosts",
            plane.endpoint,
        )
        return plane
    from kvseal.peer.tcp import TcpDataPlane

    return TcpDataPlane()


def _open_ssd(cfg: ServeConfig) -> DiskTier | None:
    """The SSD tier on cfg.ssd_paths, its index recovered (None when off). Each directory must be this user's alone
    and is locked for this engine (kvseal.ssd.device): another user's, a writable-by-others or a locked one is a
    StartError naming the path, why and the fix."""
    if not cfg.ssd_paths:
        return None
    devices: list[FileDevice] = []
    try:
        for path in cfg.ssd_paths:
            try:
                device = FileDevice(path, cfg.ssd_capacity_bytes, cfg.ssd_segment_bytes)
            except TierDirectoryError as e:
                raise StartError(f"cannot use --ssd-path {path!r}: {e}") from None
            except OSError as e:
                raise StartError(
                    f"cannot use --ssd-path {path!r}: {e.strerror or e}: pass a directory this user owns"
                ) from None
            devices.append(device)
            if not device.direct:
                log.warning("ssd %s: O_DIRECT is not supported there: buffered I/O (the page cache holds a copy)", path)
        _fit_ssd(cfg, devices)
        # queued blocks stay pinned in the pool until written: a quarter of it at most, so Saves always find room
        tier = DiskTier(devices, max_pending_bytes=min(512 << 20, cfg.pool_bytes // 4))
        try:
            report = tier.open(cfg.ssd_recovery)
        except RuntimeError as e:  # --ssd-recovery strict found something bad
            raise StartError(f"{e}: repair or move the directory, or start with --ssd-recovery scan") from None
        except OSError as e:
            raise StartError(f"cannot recover the SSD tier: {e.strerror or e}") from None
    except BaseException:
        for device in devices:
            device.close()  # and with it the directory's lock
        raise
    log.info(
        "ssd: %d records in %d segments recovered in %.2f s (%d scanned, torn tails cut %d, bad %s, re-keyed %s, "
        "dropped namespaces %s)",
        report.records,
        report.segments,
        report.seconds,
        report.scanned_segments,
        report.torn_cut,
        report.bad or "none",
        report.rekeyed or "none",
        report.dropped_namespaces or "none",
    )
    return tier


def _fit_ssd(cfg: ServeConfig, devices: list[FileDevice]) -> None:
    """Sizes each (locked) device to the capacity that fits its disk now (kvseal.server.config.fit_ssd_capacity):
    after the disk filled, a restart keeps every record it has, with one warning per path naming the numbers."""
    spaces = [device.space() for device in devices]
    try:
        capacities = fit_ssd_capacity(cfg, spaces)
    except ConfigError as e:
        raise StartError(str(e)) from None
    for device, space, capacity in zip(devices, spaces, capacities, strict=True):
        device.resize(capacity)
        if device.max_segments < cfg.ssd_capacity_bytes // cfg.ssd_segment_bytes:
            log.warning(
                "ssd %s: --ssd-capacity %s does not fit there now: the engine's segments take %s and %s is free on "
                "its filesystem: running with %s (%d segments, kvseal_ssd_capacity_bytes) until space is freed and "
                "the engine restarted",
                device.name,
                format_size(cfg.ssd_capacity_bytes),
                format_size(space.held),
                format_size(space.free),
                format_size(device.max_segments * device.segment_bytes),
                device.max_segments,
            )


def _allocate_engine(cfg: ServeConfig, ssd: DiskTier | None = None) -> Engine:
    try:
        return Engine(
            cfg.pool_bytes,
            slab_bytes=cfg.slab_bytes,
            prefault=cfg.prefault,
            lease_ttl_s=cfg.lease_ttl_s,
            inflight_timeout_s=cfg.inflight_timeout_s,
            eviction=cfg.eviction,
            ssd=ssd,
            max_mapped_per_uid=mapped_per_uid_cap(cfg),
        )
    except OSError as e:  # mmap: ENOMEM past the overcommit or the address-space limit
        if ssd is not None:
            ssd.close()
        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        limit_note = (
            "" if limit == resource.RLIM_INFINITY else f"; the address-space limit (ulimit -v) is {format_size(limit)}"
        )
        raise StartError(
            f"cannot allocate the {format_size(cfg.pool_bytes)} pool: {e.strerror}: pass a smaller --pool-size "
            f"({format_size(_available_memory())} of memory is available now{limit_note})"
        ) from None


def _available_memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
