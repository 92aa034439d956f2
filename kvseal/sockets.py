"""Blocking reads of an exact size, for the lane's and the peer protocol's framed streams."""

from __future__ import annotations

import socket

from kvseal.errors import Unavailable


class StreamClosed(Unavailable, ConnectionError):
    """The other end closed the connection before the first byte of what was read (a clean end of stream)."""


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """n bytes from `sock`; StreamClosed when the other end closed before the first, ConnectionError inside."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                raise StreamClosed("the other end closed the connection")
            raise ConnectionError(f"the other end closed the connection after {got} of {n} bytes")
        got += k
    return bytes(buf)
