"""HTTP side of the engine: /health (200 once the engine serves, 503 while it starts or stops), /metrics
(Prometheus), /v1/instances, /v1/namespaces, /v1/peers, /v1/compatibility?a=NS&b=NS (why two final namespaces
cannot share blocks) (JSON), and DELETE /v1/namespaces/<namespace_final>[?uid=N], which purges a final namespace
from memory and SSD.

Who may ask, and how errors answer: kvseal.httpd.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import urllib.parse
from http.server import ThreadingHTTPServer
from typing import Any

import grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvseal.engine.engine import Engine
from kvseal.errors import (
    InvalidArgument,
    NotFound,
    Unavailable,
    quote,
)
from kvseal.httpd import JsonHandler
from kvseal.limits import MAX_NAMESPACE_FINAL_CHARS
from kvseal.server.metrics import Metrics


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


class _Handler(JsonHandler):
    engine: Engine
    metrics: Metrics
    who = "the engine"
    token_flag = "--token (or $KVSEAL_TOKEN)"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.answer(self._get)

    def do_DELETE(self) -> None:  # noqa: N802
        self.answer(self._delete)

    def _get(self, path: str) -> None:
        if path == "/health":
            if self.server.ready.is_set():  # type: ignore[attr-defined]
                self.send(200, "application/json", b'{"status":"ok"}')
            else:
                self.send(503, "application/json", b'{"status":"unavailable"}')
        elif path == "/metrics":
            self.send(200, CONTENT_TYPE_LATEST, generate_latest(self.metrics.registry))
        elif path == "/v1/namespaces":
            self.send_json(self.engine.namespaces())
        elif path == "/v1/instances":
            self.send_json(
                [dataclasses.asdict(s) | {"descriptor": s.descriptor.decode()} for s in self.engine.instances()]
            )
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
        self.send_json(purged)

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
        self.send_json({"compatible": not diffs, "message": message, "differences": differences})

    def _peers(self) -> None:
        fetcher = self.server.peers  # type: ignore[attr-defined]
        if fetcher is None:
            raise NotFound("this engine has no MetaServer: start it with --metaserver HOST:PORT")
        try:
            nodes = fetcher.nodes()
        except grpc.RpcError as e:
            raise Unavailable(f"the MetaServer does not answer: {e.code().name}") from None
        self.send_json({"node_id": fetcher.node_id, "nodes": nodes})
