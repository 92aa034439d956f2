"""Who is calling: the checks every kvseal server (engine gRPC and HTTP, peer port, MetaServer) makes of a caller,
kept below all of them. A bearer token on gRPC (`token_interceptor`); without one, loopback only (`is_loopback`),
and there the uid that owns the client's socket (`tcp_peer_uid`), served only when it is this process's own or
root (`local_uid_allowed`); other local users use the token, or the lane's unix socket (SO_PEERCRED). TCP has no
SO_PEERCRED, but on loopback both ends of a connection live in this kernel, so the client's socket is in the
kernel's socket tables, with the uid of whoever created it.

How `tcp_peer_uid` reads it: an exact sock_diag netlink lookup (SOCK_DIAG_BY_FAMILY, inet_diag_req_v2 without
NLM_F_DUMP) of the client's socket by its 4-tuple; the kernel answers from its connection hash, about 20 µs. The
other way, reading /proc/net/tcp and /proc/net/tcp6, walks the whole connection hash on every read: 4-10 ms per
lookup on the project's machines even with a dozen sockets, too slow per RPC. So /proc is only the fallback: when
sock_diag does not work here (no tcp_diag, a sandbox without it: probed once, against a connection of our own), and
when the server's address is not given (grpc's `context.peer()` names only the client) and the client did not
connect to the usual loopback address of its family (127.0.0.1, ::1).

Why this is race-free while the connection is open: a TCP connection is named by its 4-tuple (client address and
port, server address and port). While the server holds its accepted socket, that 4-tuple stays in the kernel's
connection hash, so no other connection can take it: a new SYN with the same 4-tuple is answered by the existing
socket (a challenge ACK), it does not open a second connection. So the ESTABLISHED socket whose local end is the
client's address and port and whose remote end is the server's can only be the client we are talking to. If the
client closed its end in the meantime, its socket is no longer ESTABLISHED (FIN_WAIT*, TIME_WAIT, then gone) and
the answer is None, which refuses: it fails closed. Only ESTABLISHED sockets count; a TIME_WAIT entry is a kernel
remnant that shows uid 0 and must never be taken for root.

What the uid means: the socket's owner, fixed when the socket was created (like SO_PEERCRED, which records the
credentials at connect time). A socket created by root and handed to, or kept by, a process that later dropped
privileges still shows uid 0, as it would for SO_PEERCRED.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import sys
import threading
import urllib.parse
from typing import Any

_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_ESTABLISHED = 1  # TCP_ESTABLISHED, "01" in /proc/net/tcp
_LISTEN = 10

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_HEADER = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_DIAG_REQUEST = struct.Struct("=BBBxI")  # inet_diag_req_v2: family, protocol, ext, pad, states (then the sockid)
_DIAG_PORTS = struct.Struct("!HH")  # inet_diag_sockid: sport, dport (network order), src[16], dst[16] ...
_DIAG_TAIL = struct.Struct("=III")  # ... if, cookie[2] (INET_DIAG_NOCOOKIE: all ones, not checked)
_DIAG_UID_OFFSET = 4 + 48 + 12  # inet_diag_msg: family state timer retrans, sockid, expires rqueue wqueue, uid

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def parse_grpc_peer(peer: str) -> tuple[str, int] | None:
    """grpc's `context.peer()` -> (host, port) of a TCP client; None for unix sockets and anything else.

    grpcio 1.85 gives 'ipv4:127.0.0.1:44430' and 'ipv6:%5B::1%5D:42440' (brackets percent-encoded; IPv4 clients
    of a dual-stack server appear as 'ipv4:'), and 'unix:' (path empty) for a unix-socket client. 'ipv6:[::1]:p'
    is accepted too. The host comes back without brackets.
    """
    scheme, sep, rest = peer.partition(":")
    if not sep or scheme not in ("ipv4", "ipv6"):
        return None
    rest = urllib.parse.unquote(rest)
    if scheme == "ipv6":
        if not rest.startswith("["):
            return None
        host, sep, port_text = rest[1:].partition("]:")
        if not sep:
            return None
    else:
        host, sep, port_text = rest.rpartition(":")
        if not sep:
            return None
    if not port_text.isdecimal() or not 0 < int(port_text) < 65536:
        return None
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if (scheme == "ipv4") != (address.version == 4):
        return None
    return host, int(port_text)


def _address(host: str) -> Address:
    """An IP address, IPv4-mapped IPv6 as IPv4 (a dual-stack server's accept gives ::ffff:a.b.c.d); ValueError else."""
    address = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def tcp_peer_uid(host: str, port: int, server_port: int, *, server_host: str | None = None) -> int | None:
    """The uid owning the client socket host:port of a live loopback TCP connection to `server_port`, or None.

    `server_host` is the server's end of the connection (HTTP knows it from getsockname()); without it the
    client is looked up as connected to 127.0.0.1 or ::1 first, then in the /proc tables under any server address
    (slow, see the module's docstring). None when there is no such ESTABLISHED socket (not a local client,
    already closed, not an IP address), or when sockets of different uids match without `server_host`.
    """
    return _lookup(host, port, server_port, server_host, sock_diag=_sock_diag_works())


def _lookup(host: str, port: int, server_port: int, server_host: str | None, *, sock_diag: bool) -> int | None:
    try:
        client = _address(host)
        server = None if server_host is None else _address(server_host)
    except ValueError:
        return None
    if not (0 < port < 65536 and 0 < server_port < 65536):
        return None
    if server is not None and server.version != client.version:
        return None  # an IPv4 client end (mapped or not) belongs to a connection with an IPv4 server end
    if sock_diag:
        guess = server or ipaddress.ip_address("127.0.0.1" if client.version == 4 else "::1")
        try:
            found = _sock_diag(client, port, guess, server_port)
        except OSError:  # out of file descriptors, say: /proc may still answer
            found = None
        else:
            if found is None and server is not None:
                return None
        if found is not None:
            state, uid = found
            return uid if state == _ESTABLISHED else None
    return _proc_uid(client, port, server_port, server)


def _sock_diag(client: Address, port: int, server: Address, server_port: int) -> tuple[int, int] | None:
    """(state, uid) of the TCP socket whose local end is client:port and remote end server:server_port, or None.

    One exact lookup: the kernel looks the 4-tuple up in its connection hash. For IPv4 it also finds AF_INET6
    sockets connected to a mapped address, which share that hash. A listening socket answers when no connection
    matched (the kernel falls back to listeners): that is no match.
    """
    family = socket.AF_INET if client.version == 4 else socket.AF_INET6
    request = (
        _DIAG_REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0xFFFFFFFF)
        + _DIAG_PORTS.pack(port, server_port)
        + client.packed.ljust(16, b"\0")
        + server.packed.ljust(16, b"\0")
        + _DIAG_TAIL.pack(0, 0xFFFFFFFF, 0xFFFFFFFF)
    )
    seq = threading.get_ident() & 0xFFFFFFFF
    message = _NLMSG_HEADER.pack(_NLMSG_HEADER.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, seq, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(5.0)  # the kernel answers within sendto(); this only bounds a broken kernel
        nl.sendto(message + request, (0, 0))
        reply = nl.recv(65536)
    length, kind, _, reply_seq, _ = _NLMSG_HEADER.unpack_from(reply)
    if reply_seq != seq or kind != _SOCK_DIAG_BY_FAMILY:
        return None  # NLMSG_ERROR with ENOENT: no such socket
    body = reply[_NLMSG_HEADER.size : length]
    if len(body) < _DIAG_UID_OFFSET + 4 or _DIAG_PORTS.unpack_from(body, 4) != (port, server_port):
        return None
    state = body[1]
    if state == _LISTEN:
        return None
    (uid,) = struct.unpack_from("=I", body, _DIAG_UID_OFFSET)
    return state, uid


_sock_diag_ok: bool | None = None


def _sock_diag_works() -> bool:
    """Whether sock_diag finds a loopback connection of our own, with our uid (tried once per process)."""
    global _sock_diag_ok
    if _sock_diag_ok is None:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
                server.bind(("127.0.0.1", 0))
                server.listen(1)
                with socket.create_connection(server.getsockname(), timeout=5.0) as client:
                    accepted, _ = server.accept()
                    with accepted:
                        host, port = client.getsockname()
                        found = _sock_diag(_address(host), port, _address("127.0.0.1"), server.getsockname()[1])
            _sock_diag_ok = found == (_ESTABLISHED, os.geteuid())
        except OSError:
            _sock_diag_ok = False
    return _sock_diag_ok


def _encode(packed: bytes) -> str:
    """An address as /proc/net/tcp{,6} prints it: each 32-bit word in the kernel's (native) byte order, %08X."""
    return "".join(f"{int.from_bytes(packed[i : i + 4], sys.byteorder):08X}" for i in range(0, len(packed), 4))


def _proc_keys(address: Address) -> list[tuple[str, str]]:
    """(table, encoded address) pairs under which a socket's end at `address` can appear in /proc.

    An IPv4 end is in /proc/net/tcp if its socket is AF_INET, or in /proc/net/tcp6 as ::ffff:a.b.c.d if it is an
    AF_INET6 socket connected to a mapped address.
    """
    if isinstance(address, ipaddress.IPv4Address):
        mapped = ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + address.packed)
        return [(_TABLES[0], _encode(address.packed)), (_TABLES[1], _encode(mapped.packed))]
    return [(_TABLES[1], _encode(address.packed))]


def _proc_uid(client: Address, port: int, server_port: int, server: Address | None) -> int | None:
    """tcp_peer_uid from /proc/net/tcp{,6}: the ESTABLISHED (01) row whose local end is client:port and whose remote
    port is server_port (remote address `server`, when given); None if none, or rows of different uids, match."""
    servers = None if server is None else dict(_proc_keys(server))
    uids: set[int] = set()
    for table, local in _proc_keys(client):
        remote = None if servers is None else servers[table]
        needle = f" {local}:{port:04X} "
        try:
            with open(table) as f:
                text = f.read()
        except OSError:
            continue
        for line in _lines_with(text, needle):
            fields = line.split()
            # sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode ...
            if len(fields) < 8 or fields[1] != needle.strip() or int(fields[3], 16) != _ESTABLISHED:
                continue
            rem_address, _, rem_port = fields[2].rpartition(":")
            if int(rem_port, 16) != server_port or (remote is not None and rem_address != remote):
                continue
            uids.add(int(fields[7]))
    return uids.pop() if len(uids) == 1 else None


def _lines_with(text: str, needle: str) -> list[str]:
    """The lines of `text` that contain `needle` (found with str.find, so the other lines are never split)."""
    lines = []
    at = text.find(needle)
    while at >= 0:
        start = text.rfind("\n", 0, at) + 1
        end = text.find("\n", at)
        end = len(text) if end < 0 else end
        lines.append(text[start:end])
        at = text.find(needle, end)
    return lines


def local_uid_allowed(uid: int | None) -> bool:
    """Whether a tokenless TCP client with this uid may use the engine: the engine's own uid and root only."""
    return uid is not None and uid in (os.getuid(), 0)


def is_loopback(address: str) -> bool:
    """Whether a gRPC/HTTP listen address only accepts local connections."""
    if address.startswith("unix:"):
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def token_interceptor(token: str) -> Any:
    """A gRPC server interceptor that refuses (UNAUTHENTICATED) every call without `Authorization: Bearer <token>`,
    but gRPC health checks. grpc is imported here, not at the top: the CLI checks addresses without it."""
    import grpc

    class TokenInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]  # grpc ships no types
        def __init__(self) -> None:
            self._expected = f"Bearer {token}"
            self._deny = grpc.unary_unary_rpc_method_handler(
                lambda request, context: context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
            )

        def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
            if details.method.startswith("/grpc.health.v1."):
                return continuation(details)
            if dict(details.invocation_metadata or ()).get("authorization") == self._expected:
                return continuation(details)
            return self._deny

    return TokenInterceptor()
