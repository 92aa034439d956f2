"""The MetaServer's HTTP side (--http-listen): /health (200, or 503 with the reason while the store is
unreachable) and /metrics (Prometheus).

Who may ask: /health, anyone. /metrics (and any other path): with a token, whoever sends it as
'Authorization: Bearer <token>'; without one, only a client whose socket belongs to the MetaServer's uid or root
(the socket owner of a loopback client: kvseal.auth), as for its gRPC.
"""

from __future__ import annotations

import hmac
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvseal.auth import local_uid_allowed, tcp_peer_uid
from kvseal.errors import Unavailable

if TYPE_CHECKING:
    from kvseal.meta.server import MetaServer


def serve_http(server: MetaServer, listen: str) -> ThreadingHTTPServer:
    """Binds `listen` (HOST:PORT, --http-listen) and serves /health and /metrics of `server` from a thread."""
    host, port = listen.rsplit(":", 1)
    handler = type("Handler", (_Handler,), {"server_ref": server})
    try:
        http = ThreadingHTTPServer((host.strip("[]"), int(port)), handler)
    except OSError as e:
        raise Unavailable(f"cannot listen on {listen!r} (--http-listen): {e.strerror}") from None
    http.daemon_threads = True
    threading.Thread(target=http.serve_forever, name="kvseal-meta-http", daemon=True).start()
    return http


class _Handler(BaseHTTPRequestHandler):
    server_ref: MetaServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        if path != "/health" and not self._allowed(path):
            return
        if path == "/health":
            error = self.server_ref.service.store_error()
            if error is None:
                self._send(200, "application/json", b'{"status":"ok"}')
            else:
                self._send(503, "application/json", json.dumps({"status": "unavailable", "error": error}).encode())
        elif path == "/metrics":
            self._send(200, CONTENT_TYPE_LATEST, generate_latest(self.server_ref.registry))
        else:
            self._send(404, "application/json", b'{"error":"no such path"}')

    def _allowed(self, path: str) -> bool:
        """With a token: the token. Without: the MetaServer's user and root only (as gRPC)."""
        token = self.server_ref.cfg.token
        if token is not None:
            given = self.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                self._send(401, "application/json", b'{"error":"missing or wrong bearer token"}')
                return False
            return True
        host, port = self.client_address[:2]
        server_host, server_port = self.connection.getsockname()[:2]
        uid = tcp_peer_uid(host, port, server_port, server_host=server_host)
        if local_uid_allowed(uid):
            return True
        who = "this client's uid could not be found" if uid is None else f"this client is uid {uid}"
        message = (
            f"without a token, {path} is only for the MetaServer's user (uid {os.getuid()}) and root, and {who}: run "
            "the client as one of those, or start the MetaServer with --token and send 'Authorization: Bearer <token>'"
        )
        self._send(403, "application/json", json.dumps({"error": message}).encode())
        return False

    def _send(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
