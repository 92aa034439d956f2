"""HTTP side of the engine: /health, /metrics (Prometheus), /v1/instances, /v1/namespaces (JSON)."""

from __future__ import annotations

import dataclasses
import hmac
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvseal.engine.engine import Engine
from kvseal.server.metrics import Metrics


class HttpServer:
    def __init__(self, host: str, port: int, engine: Engine, metrics: Metrics, token: str | None) -> None:
        handler = type("Handler", (_Handler,), {"engine": engine, "metrics": metrics, "token": token})
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvseal-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    engine: Engine
    metrics: Metrics
    token: str | None
    server_version = "kvseal"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: metrics scrapes would flood the log
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = self.path.split("?", 1)[0]
        if path != "/health" and self.token is not None:
            given = self.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                self._send(401, "application/json", b'{"error":"missing or wrong bearer token"}')
                return
        if path == "/health":
            self._send(200, "application/json", b'{"status":"ok"}')
        elif path == "/metrics":
            self._send(200, CONTENT_TYPE_LATEST, generate_latest(self.metrics.registry))
        elif path == "/v1/namespaces":
            self._json(self.engine.namespaces())
        elif path == "/v1/instances":
            self._json([dataclasses.asdict(s) for s in self.engine.instances()])
        else:
            self._send(404, "application/json", json.dumps({"error": f"no such path {path!r}"}).encode())

    def _json(self, value: Any) -> None:
        self._send(200, "application/json", json.dumps(value, indent=1).encode())

    def _send(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
