"""What `kvseal serve` runs with, and the checks of it that need no engine: kept free of grpc, numpy and the engine
so that a wrong command line is refused at once."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass

from kvseal.auth import is_loopback
from kvseal.core.eviction import EVICTION_POLICIES
from kvseal.core.store import PAGE_ALIGN
from kvseal.errors import ConfigError
from kvseal.ssd.device import SEGMENT_NAME, DirectorySpace
from kvseal.units import format_size


@dataclass(frozen=True, slots=True)
class ServeConfig:
    listen: str = "127.0.0.1:50055"
    http_listen: str = "127.0.0.1:9091"
    pool_bytes: int = 1 << 30
    slab_bytes: int = 64 << 20
    lease_ttl_s: float = 30.0
    inflight_timeout_s: float = 60.0
    eviction: str = EVICTION_POLICIES[0]
    allow_remote: bool = False
    token: str | None = None
    max_workers: int = 128
    prefault: bool = True
    lane_socket: str = "auto"  # unix socket path of the local lane; "auto" derives one from `listen`
    lane_group: str | None = None  # the lane socket becomes 0660 with this group: other local users may connect
    lane_max_connections: int = 4096
    lane_idle_timeout_s: float = 60.0
    max_mapped_per_uid_bytes: int | None = None  # None: 4 x pool_bytes; 0: no cap (root and the engine's user: none)
    ssd_paths: tuple[str, ...] = ()  # directories of the SSD tier (off when empty); blocks stripe across them
    ssd_capacity_bytes: int = 0  # per path
    ssd_segment_bytes: int = 256 << 20
    ssd_recovery: str = "scan"
    metaserver: str = ""  # HOST:PORT of the MetaServer to announce this node's blocks to ('' = none)
    node_id: str = ""  # this node's name there (default: HOSTNAME:PORT of listen, kvseal.server.app.default_node_id)
    advertise: str = ""  # where peers reach this node (default: the peer listen address)
    peer_listen: str = ""  # HOST:PORT serving other nodes' fetches (default with a MetaServer: 127.0.0.1, any port)
    peer_transport: str = "tcp"  # tcp | mooncake
    peer_timeout_s: float = 10.0


DEFAULT_SLAB_BYTES: int = ServeConfig().slab_bytes


def _is_wildcard(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def physical_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def mapped_per_uid_cap(cfg: ServeConfig) -> int:
    """Bytes of worker memory one uid may have the engine map (0: no cap): --max-mapped-per-uid, else 4 x the pool.
    Mapping a worker's memfd costs the engine nothing where the worker's pages exist, but faults in the holes of a
    sparse one: the cap bounds what a tenant can make the engine allocate."""
    return 4 * cfg.pool_bytes if cfg.max_mapped_per_uid_bytes is None else cfg.max_mapped_per_uid_bytes


def check_config(cfg: ServeConfig) -> None:
    """Raises ConfigError naming the flag and the fix when `cfg` cannot run here."""
    if cfg.slab_bytes > cfg.pool_bytes:
        raise ConfigError(_pool_below_slab(cfg))
    if cfg.slab_bytes < PAGE_ALIGN:
        raise ConfigError(f"argument --slab-size: must be at least {PAGE_ALIGN} bytes, pages are aligned to that")
    if cfg.pool_bytes > physical_memory():
        # past the machine's memory, mmap refuses the pool or the OOM killer ends the engine while faulting it in
        raise ConfigError(
            f"argument --pool-size: {format_size(cfg.pool_bytes)} is more than this machine's memory "
            f"({format_size(physical_memory())}): pass a smaller size, such as 1GiB"
        )
    if not cfg.lane_socket:
        raise ConfigError(
            "argument --lane-socket: the lane cannot be off, workers register, save and load over it: leave "
            "--lane-socket out (auto) or pass a path"
        )
    _check_ssd(cfg)
    if (cfg.peer_listen or cfg.advertise or cfg.peer_transport != "tcp") and not cfg.metaserver:
        raise ConfigError(
            "argument --peer-listen/--advertise/--peer-transport: peers find this node through a MetaServer: pass "
            "--metaserver HOST:PORT too"
        )
    if cfg.peer_transport == "mooncake" and not cfg.allow_remote:
        raise ConfigError(
            "argument --peer-transport: Mooncake's transport listens on every interface of this machine and lets "
            "whoever reaches its ports read and write the pool, without the token: pass --allow-remote to accept "
            "that (only where every host that can reach this one is trusted), or use --peer-transport tcp"
        )
    remote = [
        (flag, a)
        for flag, a in (
            ("--listen", cfg.listen),
            ("--http-listen", cfg.http_listen),
            ("--peer-listen", cfg.peer_listen),
        )
        if a and not is_loopback(a)
    ]
    if remote and not cfg.allow_remote:
        flag, address = remote[0]
        # the local fix comes first: opening the engine to other machines exposes every tenant's KV
        raise ConfigError(
            f"argument {flag}: {address!r} is not a loopback address, and the engine listens on loopback only: "
            f"pass 127.0.0.1:{address.rsplit(':', 1)[1]} (for other machines to reach it, add --allow-remote and "
            "--token)"
        )
    if remote and not cfg.token:
        raise ConfigError(
            f"argument --allow-remote: listening on {remote[0][1]!r} needs a shared token too: pass --token or set "
            "$KVSEAL_TOKEN"
        )
    if cfg.peer_listen and _is_wildcard(cfg.peer_listen) and not cfg.advertise:
        raise ConfigError(
            f"argument --peer-listen: other nodes cannot reach {cfg.peer_listen!r}, a wildcard address: pass "
            "--advertise HOST:PORT too, the address they reach this node at"
        )


def _pool_below_slab(cfg: ServeConfig) -> str:
    """The line for a pool smaller than one slab. It names --pool-size, the flag a newcomer passes: the pool holds
    whole slabs, so one slab is its minimum; with the default slab size (likely not passed) it says so."""
    slab = format_size(cfg.slab_bytes)
    minimum = slab.replace(" ", "")
    if cfg.slab_bytes == DEFAULT_SLAB_BYTES:
        fits = format_size(1 << (cfg.pool_bytes.bit_length() - 1)).replace(" ", "")  # a power of two, <= the pool
        return (
            f"argument --pool-size: {format_size(cfg.pool_bytes)} is less than one slab, {slab} (the default "
            f"--slab-size): pass --pool-size {minimum} or more, or lower the slab size, e.g. --slab-size {fits} "
            "(the largest page must fit in a slab)"
        )
    return (
        f"argument --pool-size: {format_size(cfg.pool_bytes)} is less than one slab (--slab-size {slab}): pass "
        f"--pool-size {minimum} or more, or a smaller --slab-size (the largest page must fit in a slab)"
    )


def _check_ssd(cfg: ServeConfig) -> None:
    if not cfg.ssd_paths:
        if cfg.ssd_capacity_bytes:
            raise ConfigError("argument --ssd-capacity: no --ssd-path given: pass the SSD tier's directory too")
        return
    if len(set(map(os.path.realpath, cfg.ssd_paths))) != len(cfg.ssd_paths):
        raise ConfigError("argument --ssd-path: a directory is given twice: pass each disk's directory once")
    if cfg.ssd_segment_bytes % 4096 or cfg.ssd_segment_bytes < cfg.slab_bytes + (1 << 20):
        raise ConfigError(
            f"argument --ssd-segment-size: must be a multiple of 4 KiB and at least --slab-size + 1 MiB "
            f"({format_size(cfg.slab_bytes + (1 << 20))}), so that the largest page fits in a segment"
        )
    if cfg.ssd_capacity_bytes < 2 * cfg.ssd_segment_bytes:
        raise ConfigError(
            f"argument --ssd-capacity: {format_size(cfg.ssd_capacity_bytes) if cfg.ssd_capacity_bytes else 'missing'}"
            f"; each --ssd-path needs at least two segments ({format_size(2 * cfg.ssd_segment_bytes)}): pass e.g. "
            "--ssd-capacity 100GiB (per path)"
        )
    _check_ssd_space(cfg)


def _nearest_existing(path: str) -> str:
    """`path`, or its nearest parent that exists (the tier directory is created at start)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _holds_segments(directory: str) -> bool:
    """Whether `directory` has segment files (of whoever): a restart's, whose room the start measures."""
    try:
        return any(map(SEGMENT_NAME.match, os.listdir(directory)))
    except OSError:
        return False


def _check_ssd_space(cfg: ServeConfig) -> None:
    """--ssd-capacity must fit in the free space of each --ssd-path's filesystem (f_bavail: what this user may
    write), the capacities of the paths that share one filesystem added up. A filesystem where a path already has
    segment files is left to the start (fit_ssd_capacity), which counts the engine's own ones once it holds the
    directory's lock; so is a path that cannot be looked at (the start names what is wrong with it)."""
    filesystems: dict[int, tuple[int, list[str]]] = {}  # st_dev -> (free bytes, its paths)
    restarted: set[int] = set()
    for path in cfg.ssd_paths:
        where = _nearest_existing(path)
        try:
            vfs = os.statvfs(where)
            device = os.stat(where).st_dev
        except OSError:
            continue
        filesystems.setdefault(device, (vfs.f_bavail * vfs.f_frsize, []))[1].append(path)
        if os.path.isdir(path) and _holds_segments(path):
            restarted.add(device)
    for device, (free, paths) in filesystems.items():
        if device not in restarted and cfg.ssd_capacity_bytes * len(paths) > free:
            raise ConfigError(_no_room(cfg, paths, free))


def _no_room(cfg: ServeConfig, paths: Sequence[str], free: int) -> str:
    asked = format_size(cfg.ssd_capacity_bytes)
    if len(paths) == 1:
        return (
            f"argument --ssd-capacity: {asked} is more than the {format_size(free)} free on the filesystem of "
            f"--ssd-path {paths[0]!r}: pass a smaller --ssd-capacity or free space there"
        )
    return (
        f"argument --ssd-capacity: {asked} for each of --ssd-path {', '.join(map(repr, paths))} "
        f"({format_size(cfg.ssd_capacity_bytes * len(paths))} in all) is more than the {format_size(free)} free "
        "on their filesystem: pass a smaller --ssd-capacity (per path) or put the paths on different disks"
    )


def fit_ssd_capacity(cfg: ServeConfig, spaces: Sequence[DirectorySpace]) -> list[int]:
    """The capacity each --ssd-path runs with (`spaces` in their order, measured with the directories locked): the
    --ssd-capacity asked where it fits. Where the paths of a filesystem hold segments of this engine and it does
    not fit (the disk filled since), each gets what its segments take and its share of the free space, in whole
    segments: it keeps serving every record it has. ConfigError naming the numbers when that is less than the two
    segments a path needs, or, on a filesystem holding none of the engine's segments, the --ssd-capacity is more
    than is free there (check_config's refusal, for segment files the engine does not trust)."""
    segment = cfg.ssd_segment_bytes
    asked = cfg.ssd_capacity_bytes
    out = [asked] * len(spaces)
    for fs in {s.filesystem for s in spaces}:
        mine = [i for i, s in enumerate(spaces) if s.filesystem == fs]
        held, free = sum(spaces[i].held for i in mine), spaces[mine[0]].free
        if asked * len(mine) <= held + free:
            continue
        paths = [cfg.ssd_paths[i] for i in mine]
        if not held:
            raise ConfigError(_no_room(cfg, paths, free))
        for i in mine:
            room = spaces[i].held + free // len(mine)
            out[i] = min(asked, room // segment * segment)
            if out[i] < 2 * segment:
                raise ConfigError(
                    f"argument --ssd-capacity: {format_size(asked)} does not fit on the filesystem of --ssd-path "
                    f"{cfg.ssd_paths[i]!r}: its segments take {format_size(spaces[i].held)} and "
                    f"{format_size(free // len(mine))} is free for it, less than the two segments a path needs "
                    f"({format_size(2 * segment)}): free space there"
                )
    return out
