"""HTTP side of the engine: /health (200 once the engine serves, 503 while it starts or stops), /metrics
(Prometheus), /v1/instances, /v1/namespaces, /v1/peers, /v1/compatibility?a=NS&b=NS (why two final namespaces
cannot share blocks) (JSON), and DELETE /v1/namespaces/<namespace_final>[?uid=N], which purges a final namespace
from memory and SSD.

Who may ask: /health, anyone. Every other path: with a token, whoever sends it; without one, only a client whose
socket belongs to the engine's uid or root (kvseal.auth), since they show every tenant's namespaces.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import os
import socket
import threading
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvseal.auth import local_uid_allowed, tcp_peer_uid
from kvseal.engine.engine import Engine
from kvseal.errors import (
    InvalidArgument,
    KvsealError,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
    quote,
    translate,
)
from kvseal.limits import MAX_NAMESPACE_FINAL_CHARS
from kvseal.server.metrics import Metrics

log = logging.getLogger("kvseal.server")


class HttpServer:
    def __init__(self, host: str, port: int, engine: Engine, metrics: Metrics, token: str | None) -> None:
        handler = type("Handler", (_Handler,), {"engine": engine, "metrics": metrics, "token": token})
        server_class = _HttpServer6 if ":" in host else ThreadingHTTPServer
        self._server = server_class((host, port), handler)
        self._server.daemon_threads = True
        self._server.peers = None  # type: ignore[attr-defined]
        self._server.ready = threading.Event()  # type: ignore[attr-defined]
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvseal-http", daemon=True)

    def start(self) -> None:
        """Serves, and /health says ready (the server calls this once everything else serves)."""
        self._server.ready.set()  # type: ignore[attr-defined]
        self._thread.start()

    @property
    def peers(self) -> Any:
        return self._server.peers  # type: ignore[attr-defined]

    @peers.setter
    def peers(self, fetcher: Any) -> None:
        """The peer fetcher (kvseal.peer.client.PeerFetcher) that /v1/peers asks for the live nodes."""
        self._server.peers = fetcher  # type: ignore[attr-defined]

    def stop(self) -> None:
        self._server.ready.clear()  # type: ignore[attr-defined]
        if self._thread.is_alive():  # shutdown() waits for serve_forever, which a failed start never ran
            self._server.shutdown()
        self._server.server_close()


class _HttpServer6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    engine: Engine
    metrics: Metrics
    token: str | None
    server_version = "kvseal"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: metrics scrapes would flood the log
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._answer(self._get)

    def do_DELETE(self) -> None:  # noqa: N802
        self._answer(self._delete)

    def _answer(self, serve: Callable[[str], None]) -> None:
        """Serves the request; an error answers the status kvseal.errors' table gives it, as JSON {"error": ...}."""
        path = urllib.parse.urlsplit(self.path).path
        try:
            self._check_allowed(path)
            serve(path)
        except Exception as e:
            if not isinstance(e, KvsealError):
                log.exception("HTTP %s %s failed", self.command, quote(path))
            status, message = translate(e, f"{self.command} {quote(path)} failed inside the engine")
            self._send(status.http, "application/json", json.dumps({"error": message}).encode())

    def _get(self, path: str) -> None:
        if path == "/health":
            if self.server.ready.is_set():  # type: ignore[attr-defined]
                self._send(200, "application/json", b'{"status":"ok"}')
            else:
                self._send(503, "application/json", b'{"status":"unavailable"}')
        elif path == "/metrics":
            self._send(200, CONTENT_TYPE_LATEST, generate_latest(self.metrics.registry))
        elif path == "/v1/namespaces":
            self._json(self.engine.namespaces())
        elif path == "/v1/instances":
            self._json([dataclasses.asdict(s) | {"descriptor": s.descriptor.decode()} for s in self.engine.instances()])
        elif path == "/v1/peers":
            self._peers()
        elif path == "/v1/compatibility":
            self._compatibility()
        else:
            raise NotFound(f"no such path {quote(path)}")

    def _delete(self, path: str) -> None:
        prefix = "/v1/namespaces/"
        if not path.startswith(prefix) or len(path) == len(prefix):
            raise NotFound(f"no such path {quote(path)}: DELETE /v1/namespaces/<namespace_final>[?uid=N]")
        namespace = urllib.parse.unquote(path[len(prefix) :])
        if len(namespace) > MAX_NAMESPACE_FINAL_CHARS:
            raise InvalidArgument(
                f"namespace_final has {len(namespace)} characters; at most {MAX_NAMESPACE_FINAL_CHARS}"
            )
        uid_arg = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query).get("uid", [None])[0]
        if uid_arg is not None and not uid_arg.isdigit():
            raise InvalidArgument(f"uid must be a number, got {quote(uid_arg)}")
        purged = self.engine.purge(namespace, None if uid_arg is None else int(uid_arg))
        if not purged:
            raise NotFound(f"no namespace {quote(namespace)} in memory or on SSD")
        self._json(purged)

    def _compatibility(self) -> None:
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
        a, b = query.get("a", [""])[0], query.get("b", [""])[0]
        if not a or not b:
            raise InvalidArgument(
                "name both final namespaces: /v1/compatibility?a=<namespace_final>&b=<namespace_final>"
            )
        for name, value in (("a", a), ("b", b)):
            if len(value) > MAX_NAMESPACE_FINAL_CHARS:
                raise InvalidArgument(f"{name} has {len(value)} characters; at most {MAX_NAMESPACE_FINAL_CHARS}")
        diffs, message = self.engine.compare(a, b)
        differences = [{"field": d.field, "layer": d.layer, "a": d.left, "b": d.right} for d in diffs]
        self._json({"compatible": not diffs, "message": message, "differences": differences})

    def _peers(self) -> None:
        fetcher = self.server.peers  # type: ignore[attr-defined]
        if fetcher is None:
            raise NotFound("this engine has no MetaServer: start it with --metaserver HOST:PORT")
        try:
            nodes = fetcher.nodes()
        except grpc.RpcError as e:
            raise Unavailable(f"the MetaServer does not answer: {e.code().name}") from None
        self._json({"node_id": fetcher.node_id, "nodes": nodes})

    def _check_allowed(self, path: str) -> None:
        """Raises Unauthenticated / PermissionDenied when this client may not have `path`."""
        if path == "/health":
            return
        if self.token is not None:
            given = self.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                raise Unauthenticated("missing or wrong bearer token")
            return
        uid = self._peer_uid()
        if not local_uid_allowed(uid):
            who = "this client's uid could not be found" if uid is None else f"this client is uid {uid}"
            raise PermissionDenied(
                f"without a token, {path} is only for the engine's user (uid {os.getuid()}) and root, and {who}: "
                "run the client as one of those, or start the engine with --token (or $KVSEAL_TOKEN) and send "
                "'Authorization: Bearer <token>'"
            )

    def _peer_uid(self) -> int | None:
        """The uid owning the client's socket of this connection (looked up once: one handler per connection)."""
        if not hasattr(self, "_uid"):
            host, port = self.client_address[:2]
            server_host, server_port = self.connection.getsockname()[:2]
            self._uid = tcp_peer_uid(host, port, server_port, server_host=server_host)
        return self._uid

    def _json(self, value: Any) -> None:
        self._send(200, "application/json", json.dumps(value, indent=1).encode())

    def _send(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
