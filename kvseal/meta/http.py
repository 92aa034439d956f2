"""The MetaServer's HTTP side (--http-listen): /health (200, or 503 with the reason while the store is
unreachable) and /metrics (Prometheus). Who may ask, and how errors answer: kvseal.httpd (as for its gRPC)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvseal.errors import NotFound, Unavailable, quote
from kvseal.httpd import JsonHandler


def serve_http(
    listen: str, token: str | None, registry: CollectorRegistry, store_error: Callable[[], str | None]
) -> ThreadingHTTPServer:
    """Binds `listen` (HOST:PORT, --http-listen) and serves from a thread: /metrics from `registry`, /health from
    `store_error()` (why the store cannot be reached now, or None)."""
    host, port = listen.rsplit(":", 1)
    handler = type(
        "Handler", (_Handler,), {"token": token, "registry": registry, "store_error": staticmethod(store_error)}
    )
    try:
        http = ThreadingHTTPServer((host.strip("[]"), int(port)), handler)
    except OSError as e:
        raise Unavailable(f"cannot listen on {listen!r} (--http-listen): {e.strerror}") from None
    http.daemon_threads = True
    threading.Thread(target=http.serve_forever, name="kvseal-meta-http", daemon=True).start()
    return http


class _Handler(JsonHandler):
    who = "the MetaServer"
    registry: CollectorRegistry
    store_error: Callable[[], str | None]

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.answer(self._get)

    def _get(self, path: str) -> None:
        if path == "/health":
            error = self.store_error()
            if error is None:
                self.send_json({"status": "ok"})
            else:
                self.send_json({"status": "unavailable", "error": error}, 503)
        elif path == "/metrics":
            self.send(200, CONTENT_TYPE_LATEST, generate_latest(self.registry))
        else:
            raise NotFound(f"no such path {quote(path)}")
