"""Who is on the other end of a loopback TCP connection (kvseal.auth), and the HTTP side that uses it.

Real sockets only. A client of another uid is a child python that starts as root, imports what it needs, drops
to nobody (65534) and then connects; those tests need root, as in CI.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from kvseal import auth
from kvseal.auth import local_uid_allowed, parse_grpc_peer, tcp_peer_uid
from kvseal.engine.engine import Engine
from kvseal.server.http import HttpServer
from kvseal.server.metrics import Metrics

NOBODY = 65534
# the suite runs as root (CI does): dropping a child to uid 65534 needs it, and a test that cannot run must fail
needs_root = pytest.mark.usefixtures("as_root")

# imports first: the interpreter's own files need not be readable by nobody
_IMPORTS = "import encodings.idna, json, os, socket, sys, urllib.error, urllib.request\n"
_DROP = _IMPORTS + "os.setgroups([])\nos.setgid(65534)\nos.setuid(65534)\n"

_CONNECT = (
    _DROP
    + """family, host, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
s = socket.socket(family, socket.SOCK_STREAM)
s.connect((host, port))
print(s.getsockname()[1], flush=True)
sys.stdin.read()  # keep the connection open until the test closes our stdin
"""
)

_HTTP_GET = (
    _DROP
    + """results = []
for url, token in json.loads(sys.argv[1]):
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", "Bearer " + token)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            results.append([response.status, response.read().decode()])
    except urllib.error.HTTPError as e:
        results.append([e.code, e.read().decode()])
print(json.dumps(results))
"""
)


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


FAMILIES = [
    pytest.param(socket.AF_INET, "127.0.0.1", id="ipv4"),
    pytest.param(
        socket.AF_INET6,
        "::1",
        id="ipv6",
    ),
]


Lookup = Callable[..., int | None]


@pytest.fixture
def as_root() -> None:
    assert os.getuid() == 0, "these tests drop a child to uid 65534: run the suite as root (CI does)"


def _via_proc(host: str, port: int, server_port: int, *, server_host: str | None = None) -> int | None:
    """tcp_peer_uid as it answers where sock_diag does not work: from /proc/net/tcp{,6} alone."""
    return auth._lookup(host, port, server_port, server_host, sock_diag=False)


@pytest.fixture(params=["sock_diag", "proc"])
def lookup(request: pytest.FixtureRequest) -> Lookup:
    """tcp_peer_uid, and its /proc fallback: both must give the same answers."""
    return tcp_peer_uid if request.param == "sock_diag" else _via_proc


@contextmanager
def _listener(family: int, host: str) -> Iterator[socket.socket]:
    with socket.socket(family, socket.SOCK_STREAM) as server:
        server.bind((host, 0))
        server.listen()
        yield server


@contextmanager
def _nobody_client(family: int, host: str, port: int) -> Iterator[int]:
    """A connection to host:port from a socket of uid 65534, open while in the block; yields its client port."""
    child = subprocess.Popen(
        [sys.executable, "-I", "-c", _CONNECT, str(int(family)), host, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = child.stdout.readline()  # type: ignore[union-attr]
        assert line.strip().isdecimal(), f"nobody client did not connect (exit {child.poll()})"
        yield int(line)
    finally:
        child.stdin.close()  # type: ignore[union-attr]
        child.wait(timeout=10)
        child.stdout.close()  # type: ignore[union-attr]


# --- parse_grpc_peer -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("peer", "expected"),
    [
        ("ipv4:127.0.0.1:43210", ("127.0.0.1", 43210)),  # what grpcio 1.85 gives for IPv4 clients
        ("ipv6:%5B::1%5D:43210", ("::1", 43210)),  # ... and for IPv6 ones: brackets percent-encoded
        ("ipv6:[::1]:43210", ("::1", 43210)),
        ("ipv6:%5B::ffff:127.0.0.1%5D:1", ("::ffff:127.0.0.1", 1)),
        ("ipv6:[fe80::1%25eth0]:80", ("fe80::1%eth0", 80)),
        ("unix:", None),  # a unix-socket client
        ("unix:/run/kvseal.sock", None),
        ("unix-abstract:kvseal", None),
        ("ipv4:127.0.0.1", None),
        ("ipv4:127.0.0.1:0", None),
        ("ipv4:127.0.0.1:65536", None),
        ("ipv4:127.0.0.1:-1", None),
        ("ipv4:localhost:80", None),
        ("ipv4:::1:80", None),
        ("ipv6:127.0.0.1:80", None),
        ("ipv6:[127.0.0.1]:80", None),
        ("ipv6:::1:80", None),
        ("ipv6:[::1]", None),
        ("", None),
        ("127.0.0.1:80", None),
    ],
)
def test_parse_grpc_peer(peer: str, expected: tuple[str, int] | None) -> None:
    assert parse_grpc_peer(peer) == expected


# --- tcp_peer_uid ----------------------------------------------------------------------------------------------


def test_sock_diag_works_here() -> None:
    """Else every lookup walks /proc/net/tcp{,6}: milliseconds per RPC."""
    assert auth._sock_diag_works()


@pytest.mark.parametrize(("family", "host"), FAMILIES)
def test_own_client_is_found_as_our_uid(lookup: Lookup, family: int, host: str) -> None:
    with _listener(family, host) as server, socket.socket(family, socket.SOCK_STREAM) as client:
        server_port = server.getsockname()[1]
        client.connect((host, server_port))
        accepted, peer = server.accept()
        with accepted:
            assert peer[:2] == client.getsockname()[:2]
            assert lookup(peer[0], peer[1], server_port) == os.getuid()
            assert lookup(peer[0], peer[1], server_port, server_host=host) == os.getuid()


@needs_root
@pytest.mark.parametrize(("family", "host"), FAMILIES)
def test_client_of_another_uid_is_found_as_that_uid(lookup: Lookup, family: int, host: str) -> None:
    with _listener(family, host) as server:
        server_port = server.getsockname()[1]
        with _nobody_client(family, host, server_port) as client_port:
            accepted, peer = server.accept()
            with accepted:
                assert peer[1] == client_port
                assert lookup(host, client_port, server_port) == NOBODY
                assert lookup(host, client_port, server_port, server_host=host) == NOBODY
                assert not local_uid_allowed(lookup(host, client_port, server_port))


@needs_root
def test_ipv4_mapped_client_and_server(lookup: Lookup) -> None:
    """An AF_INET6 client connected to ::ffff:127.0.0.1 sits in /proc/net/tcp6; a dual-stack server sees it mapped."""
    with _listener(socket.AF_INET, "127.0.0.1") as server:
        server_port = server.getsockname()[1]
        with _nobody_client(socket.AF_INET6, "::ffff:127.0.0.1", server_port) as client_port:
            accepted, peer = server.accept()
            with accepted:
                assert peer == ("127.0.0.1", client_port)  # the AF_INET server sees plain IPv4
                assert lookup("127.0.0.1", client_port, server_port) == NOBODY
                assert lookup("127.0.0.1", client_port, server_port, server_host="127.0.0.1") == NOBODY
    with _listener(socket.AF_INET6, "::ffff:127.0.0.1") as server:
        server_port = server.getsockname()[1]
        with _nobody_client(socket.AF_INET, "127.0.0.1", server_port) as client_port:
            accepted, peer = server.accept()
            with accepted:
                assert peer[:2] == ("::ffff:127.0.0.1", client_port)  # an AF_INET client as a v6 server sees it
                assert lookup(peer[0], client_port, server_port) == NOBODY
                server_host = accepted.getsockname()[0]
                assert lookup(peer[0], client_port, server_port, server_host=server_host) == NOBODY


def test_unknown_or_mismatched_connection_is_none(lookup: Lookup) -> None:
    with _listener(socket.AF_INET, "127.0.0.1") as server, socket.create_connection(server.getsockname()) as client:
        server_port = server.getsockname()[1]
        accepted, _ = server.accept()
        with accepted:
            host, port = client.getsockname()
            assert lookup(host, port, server_port) == os.getuid()
            with _listener(socket.AF_INET, "127.0.0.1") as unused:  # a port no connection of ours goes to or from
                free = unused.getsockname()[1]
                assert lookup(host, free, server_port) is None
                assert lookup(host, port, free) is None
            assert lookup(host, port, server_port, server_host="127.0.0.2") is None
            assert lookup("127.0.0.2", port, server_port) is None
            assert lookup("::1", port, server_port) is None
            assert lookup(host, port, server_port, server_host="::1") is None  # other family: no such row
            assert lookup("localhost", port, server_port) is None  # not an address
            assert lookup("", port, server_port) is None


def test_closed_connection_is_none_not_root(lookup: Lookup) -> None:
    """Once the client closed, its row is FIN_WAIT/TIME_WAIT (TIME_WAIT shows uid 0): never an identity."""
    with _listener(socket.AF_INET, "127.0.0.1") as server:
        server_port = server.getsockname()[1]
        client = socket.create_connection(server.getsockname())
        host, port = client.getsockname()
        accepted, _ = server.accept()
        with accepted, client:
            assert lookup(host, port, server_port) == os.getuid()
            client.close()
            assert accepted.recv(1) == b""  # the client's FIN arrived
            assert lookup(host, port, server_port) is None
        assert lookup(host, port, server_port) is None


def test_local_uid_allowed() -> None:
    assert local_uid_allowed(os.getuid())
    assert local_uid_allowed(0)
    assert not local_uid_allowed(None)
    assert not local_uid_allowed(NOBODY if os.getuid() != NOBODY else 1)


# --- HTTP ------------------------------------------------------------------------------------------------------


@contextmanager
def _http_server(host: str, token: str | None) -> Iterator[str]:
    engine = Engine(8 << 20, slab_bytes=1 << 20, prefault=False)
    server = HttpServer(host, 0, engine, Metrics(engine), token)
    server.start()
    try:
        yield f"http://{'[' + host + ']' if ':' in host else host}:{server.port}"
    finally:
        server.stop()


def _get(url: str, token: str | None = None) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read()


def _nobody_gets(requests: list[tuple[str, str | None]]) -> list[tuple[int, str]]:
    r = subprocess.run(
        [sys.executable, "-I", "-c", _HTTP_GET, json.dumps(requests)],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stderr
    return [(code, body) for code, body in json.loads(r.stdout)]


PATHS = ["/v1/namespaces", "/v1/instances", "/metrics", "/no-such-path"]


@pytest.mark.parametrize(("family", "host"), FAMILIES)
def test_http_without_token_answers_own_uid_and_root(family: int, host: str) -> None:
    with _http_server(host, None) as base:
        status, body = _get(base + "/v1/namespaces")
        assert (status, json.loads(body)) == (200, [])
        assert _get(base + "/v1/instances") == (200, b"[]")
        assert _get(base + "/metrics")[0] == 200
        assert _get(base + "/health") == (200, b'{"status":"ok"}')
        assert _get(base + "/no-such-path")[0] == 404


@needs_root
@pytest.mark.parametrize(("family", "host"), FAMILIES)
def test_http_without_token_refuses_other_uids_but_health(family: int, host: str) -> None:
    with _http_server(host, None) as base:
        answers = _nobody_gets([(base + "/health", None), *((base + p, None) for p in PATHS)])
    assert answers[0] == (200, '{"status":"ok"}')
    for path, (status, body) in zip(PATHS, answers[1:], strict=True):
        assert status == 403, (path, body)
        error = json.loads(body)["error"]
        assert path in error and "uid 65534" in error and "root" in error and "--token" in error


@needs_root
def test_http_with_token_is_unchanged() -> None:
    with _http_server("127.0.0.1", "s3cret") as base:
        answers = _nobody_gets(
            [
                (base + "/health", None),
                (base + "/v1/namespaces", "s3cret"),
                (base + "/v1/namespaces", None),
                (base + "/v1/namespaces", "wrong"),
            ]
        )
        assert _get(base + "/v1/namespaces")[0] == 401  # root too: with a token, the token decides
        assert _get(base + "/v1/namespaces", "s3cret") == (200, b"[]")
    assert answers[0] == (200, '{"status":"ok"}')
    assert answers[1] == (200, "[]")
    assert [code for code, _ in answers[2:]] == [401, 401]
