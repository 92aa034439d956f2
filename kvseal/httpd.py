"""The HTTP side every kvseal server shares (the engine's and the MetaServer's --http-listen): who may ask, and how
errors answer.

Who may ask: /health, anyone. Any other path: with a token, whoever sends it as 'Authorization: Bearer <token>';
without one, only a client whose socket belongs to the server's uid or root (the socket owner of a loopback
client: kvseal.auth), since the answers show every tenant's namespaces. An error answers the HTTP code of
kvseal.errors' table, as JSON {"error": ...}.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

from kvseal.auth import local_uid_allowed, tcp_peer_uid
from kvseal.errors import KvsealError, PermissionDenied, Unauthenticated, quote, translate

log = logging.getLogger("kvseal.http")


class JsonHandler(BaseHTTPRequestHandler):
    """A request handler whose do_* methods call `answer(serve)`; `serve(path)` raises kvseal errors."""

    token: str | None = None
    who = "the server"  # in messages: "the engine", "the MetaServer"
    token_flag = "--token"  # how that server is given a token
    server_version = "kvseal"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: metrics scrapes would flood the log
        pass

    def answer(self, serve: Callable[[str], None]) -> None:
        """Serves the request (after the access check); an error answers its status from kvseal.errors' table."""
        path = urllib.parse.urlsplit(self.path).path
        try:
            self.check_allowed(path)
            serve(path)
        except Exception as e:
            if not isinstance(e, KvsealError):
                log.exception("HTTP %s %s failed", self.command, quote(path))
            status, message = translate(e, f"{self.command} {quote(path)} failed inside {self.who}")
            self.send(status.http, "application/json", json.dumps({"error": message}).encode())

    def check_allowed(self, path: str) -> None:
        """Raises Unauthenticated / PermissionDenied when this client may not have `path`."""
        if path == "/health":
            return
        if self.token is not None:
            given = self.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                raise Unauthenticated("missing or wrong bearer token")
            return
        uid = self.client_uid()
        if not local_uid_allowed(uid):
            who = "this client's uid could not be found" if uid is None else f"this client is uid {uid}"
            raise PermissionDenied(
                f"without a token, {path} is only for {self.who}'s user (uid {os.getuid()}) and root, and {who}: "
                f"run the client as one of those, or start {self.who} with {self.token_flag} and send "
                "'Authorization: Bearer <token>'"
            )

    def client_uid(self) -> int | None:
        """The uid owning the client's socket of this connection (looked up once: one handler per connection)."""
        if not hasattr(self, "_uid"):
            host, port = self.client_address[:2]
            server_host, server_port = self.connection.getsockname()[:2]
            self._uid = tcp_peer_uid(host, port, server_port, server_host=server_host)
        return self._uid

    def send_json(self, value: Any, code: int = 200) -> None:
        self.send(code, "application/json", json.dumps(value, indent=1).encode())

    def send(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
