"""Socket helpers of the peer protocol, and the built-in TCP data plane: pages stream on the control connection
itself, sent with one sendmsg over many pages and received with recvmsg_into straight into pool pages (no
intermediate buffer on either side)."""

from __future__ import annotations

import socket
from collections.abc import Sequence

from kvseal.sockets import recv_exact
from kvseal.wire.peer import ProtocolError

IOV_MAX = 1024  # buffers one sendmsg / recvmsg_into takes (Linux's UIO_MAXIOV)


def recv_frame(sock: socket.socket, limit: int) -> bytes:
    """A u32-length-prefixed body, refused from its header when longer than `limit`."""
    n = int.from_bytes(recv_exact(sock, 4), "little")
    if n > limit:
        raise ProtocolError(f"frame of {n} bytes, at most {limit}")
    return recv_exact(sock, n)


def send_all(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Sends every view in order, IOV_MAX at a time, resuming after partial sends."""
    pending = [memoryview(v).cast("B") for v in views]
    i = 0
    while i < len(pending):
        sent = sock.sendmsg(pending[i : i + IOV_MAX])
        while sent and i < len(pending):
            if sent >= len(pending[i]):
                sent -= len(pending[i])
                i += 1
            else:
                pending[i] = pending[i][sent:]
                sent = 0


def recv_all_into(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fills every view in order from the socket; ConnectionError when it closes first."""
    pending = [memoryview(v).cast("B") for v in views]
    i = 0
    while i < len(pending):
        got = sock.recvmsg_into(pending[i : i + IOV_MAX])[0]
        if got == 0:
            raise ConnectionError("the peer closed the connection in the middle of a page")
        while got and i < len(pending):
            if got >= len(pending[i]):
                got -= len(pending[i])
                i += 1
            else:
                pending[i] = pending[i][got:]
                got = 0


class TcpDataPlane:
    """Pages follow the fetch's answer on the control connection."""

    name = "tcp"
    pulls = False

    def offer(self) -> bytes:
        return b""

    def send(self, sock: socket.socket, pages: Sequence[memoryview]) -> None:
        send_all(sock, pages)

    def receive_inline(self, sock: socket.socket, destinations: Sequence[memoryview]) -> None:
        recv_all_into(sock, destinations)

    def close(self) -> None:
        pass
