"""Whether this machine lets the engine listen where it is asked to: gRPC's and HTTP's addresses, the lane's socket
path. Checked before grpc, numpy and the engine are even imported, and again by EngineServer.start() before the
pool is allocated, so that a taken port or an unusable path fails at once with its cause, and so that a running
engine's unix sockets are never replaced (gRPC itself would unlink one and bind over it)."""

from __future__ import annotations

import errno
import os
import socket
import stat
import tempfile
from pathlib import Path

from kvseal.errors import FailedPrecondition
from kvseal.server.config import ServeConfig

UNIX_PATH_MAX = 107  # sun_path's 108 bytes, less the terminating NUL


class StartError(FailedPrecondition):
    """This machine refuses what the configuration asks: a taken port, an unusable path, too little memory. The
    message is one line naming the cause and the fix."""


def unix_path(listen: str) -> str | None:
    """The socket path of a `unix:` gRPC address; None for HOST:PORT."""
    return listen.removeprefix("unix:").removeprefix("//") if listen.startswith("unix:") else None


def lane_socket_path(cfg: ServeConfig, grpc_port: int) -> str:
    """--lane-socket's path: 'auto' puts it beside gRPC's unix socket, or names it after gRPC's TCP port."""
    if cfg.lane_socket != "auto":
        return cfg.lane_socket
    grpc_path = unix_path(cfg.listen)
    if grpc_path:
        return f"{grpc_path}.lane"
    return os.path.join(tempfile.gettempdir(), f"kvseal-{grpc_port}.lane.sock")


def check_addresses(cfg: ServeConfig) -> None:
    """Raises StartError when an address of `cfg` cannot be listened on now: gRPC's, HTTP's, peer fetch's, and the
    lane's unless
    it is named after a gRPC port 0 not bound yet."""
    grpc_path = unix_path(cfg.listen)
    if grpc_path is None:
        check_tcp(cfg.listen, "--listen")  # gRPC's own failure is a C++ log line that leaves the cause out
    else:
        check_unix(cfg.listen, grpc_path, "--listen")
    if cfg.http_listen:
        check_tcp(cfg.http_listen, "--http-listen")
    if cfg.peer_listen:
        check_tcp(cfg.peer_listen, "--peer-listen")
    port = 0 if grpc_path else int(cfg.listen.rsplit(":", 1)[1])
    if grpc_path or cfg.lane_socket != "auto" or port:
        lane = lane_socket_path(cfg, port)
        check_unix(lane, lane, "--lane-socket")


def check_tcp(address: str, flag: str) -> None:
    """Raises StartError naming the cause when nothing could bind `address` now (a probe socket binds and closes)."""
    host, port = address.rsplit(":", 1)
    try:
        candidates = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise bind_failure(address, flag, e) from None
    failure: OSError | None = None
    for family, kind, proto, _, sockaddr in candidates:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC and http.server bind
            try:
                probe.bind(sockaddr)
                return  # gRPC listens where one of the resolved addresses binds
            except OSError as e:
                failure = failure or e
    assert failure is not None
    raise bind_failure(address, flag, failure)


def check_unix(address: str, path: str, flag: str) -> None:
    """Raises StartError unless `path` is free or holds a stale socket nobody serves (which gRPC and the lane
    replace). A socket that answers belongs to a running engine, and a failed start must not take it away."""
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        raise _cannot_listen(address, flag, f"the path is longer than {UNIX_PATH_MAX} bytes", "pass a shorter path")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(path)  # learns whether this user may create a socket there
            except OSError as e:
                raise bind_failure(address, flag, e, path) from None
        os.unlink(path)
        return
    except OSError as e:
        raise bind_failure(address, flag, e, path) from None
    if not stat.S_ISSOCK(mode):
        raise _cannot_listen(address, flag, f"{path!r} is not a socket", f"remove it or pass another {flag}")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            return  # stale: left by an engine that is gone
        except PermissionError:
            raise _cannot_listen(address, flag, "the socket there is another user's", f"pass another {flag}") from None
        except OSError:
            pass  # a full backlog times out: someone serves it
    raise _cannot_listen(address, flag, "another engine serves it", f"stop that engine or pass another {flag}")


def bind_failure(address: str, flag: str, err: OSError, path: str | None = None) -> StartError:
    """The StartError of a failed bind of `address` (`path`: its unix socket path), naming the cause and the fix."""
    if isinstance(err, socket.gaierror):
        why, fix = "the host name does not resolve", "pass an IP address such as 127.0.0.1"
    elif err.errno == errno.EADDRINUSE:
        why, fix = "the address is in use", f"stop what listens there or pass another {flag}"
    elif err.errno == errno.EADDRNOTAVAIL:
        why, fix = "no interface of this machine has that address", f"pass another {flag}"
    elif err.errno in (errno.ENOENT, errno.ENOTDIR) and path is not None and not Path(path).parent.is_dir():
        why, fix = f"directory {str(Path(path).parent)!r} does not exist", f"create it or pass another {flag}"
    elif err.errno in (errno.EACCES, errno.EPERM):
        why = "permission denied"
        fix = "pass a path in a directory you may write" if path is not None else "pass a port from 1024 up"
    else:
        why, fix = err.strerror or str(err), f"pass another {flag}"
    return _cannot_listen(address, flag, why, fix)


def _cannot_listen(address: str, flag: str, why: str, fix: str) -> StartError:
    return StartError(f"cannot listen on {address!r} ({flag}): {why}: {fix}")
