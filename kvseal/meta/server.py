"""`kvseal metaserver`: the MetaServer process. gRPC (kvseal.v1.MetaServer) over a store (kvseal.meta.store), plus
HTTP /health and /metrics. This module puts the parts together and runs them: what it runs with and the store that
names (kvseal.meta.config), the gRPC service with who may call it and its bounded work (kvseal.meta.service), the
checks of every request's fields (kvseal.meta.checks), the FIFO lock of a memory store (kvseal.meta.fairlock) and
the HTTP side (kvseal.meta.http); here, the listeners (a unix socket made 0600) and the maintenance thread that
forgets silent nodes and cleans up dropped nodes' blocks in steps.

Who may call: loopback only unless --allow-remote with a token (like the engine); with a token every RPC and HTTP
path but /health needs it. Without a token, over TCP only the MetaServer's own user and root, on a unix socket its
own user.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent import futures
from http.server import ThreadingHTTPServer
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Gauge

from kvseal.auth import token_interceptor
from kvseal.errors import Unavailable, quote
from kvseal.meta.config import MetaConfig, open_store, redacted
from kvseal.meta.fairlock import FairLock
from kvseal.meta.http import serve_http
from kvseal.meta.service import QUERY_STEP, STEP_BLOCKS, MetaService
from kvseal.proto import kvseal_pb2_grpc as pb_grpc

__all__ = ["QUERY_STEP", "STEP_BLOCKS", "FairLock", "MetaConfig", "MetaServer", "MetaService", "open_store", "redacted"]


class MetaServer:
    """A running MetaServer: `start()` binds and serves, `stop()` ends it."""

    def __init__(self, cfg: MetaConfig) -> None:
        self.cfg = cfg
        self.store, clock = open_store(cfg.store)
        self.registry = CollectorRegistry()
        self.service = MetaService(cfg, self.store, clock, self.registry)
        nodes = Gauge("kvseal_meta_nodes", "Live nodes", registry=self.registry)
        nodes.set_function(lambda: len(self._nodes()))
        blocks = Gauge("kvseal_meta_blocks", "Blocks announced by live nodes", registry=self.registry)
        blocks.set_function(lambda: sum(n.blocks for n in self._nodes()))

        self._grpc = grpc.server(
            futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="kvseal-meta"),
            interceptors=[token_interceptor(cfg.token)] if cfg.token else [],
            options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 16 << 20)],
        )
        pb_grpc.add_MetaServerServicer_to_server(self.service, self._grpc)
        self._http: ThreadingHTTPServer | None = None
        self._stop = threading.Event()
        self.port = 0

    def _nodes(self) -> list[Any]:
        with self.service.lock:
            try:
                return self.store.nodes(self.service.clock())
            except ConnectionError:
                return []

    def start(self) -> None:
        unix = self.cfg.listen.startswith("unix:")
        old_umask = os.umask(0o177) if unix else None  # the socket is this user's only (it is trusted, no token)
        try:
            self.port = self._grpc.add_insecure_port(self.cfg.listen)
        except RuntimeError:
            self.port = 0
        finally:
            if old_umask is not None:
                os.umask(old_umask)
        if self.port == 0:
            raise Unavailable(f"cannot listen on {quote(self.cfg.listen)} (--listen): in use? pass another --listen")
        self.service.port = self.port
        if self.cfg.http_listen:
            self._http = serve_http(self.cfg.http_listen, self.cfg.token, self.registry, self.service.store_error)
        self._grpc.start()
        threading.Thread(target=self._maintain, name="kvseal-meta-maintain", daemon=True).start()

    def _maintain(self) -> None:
        """Every second: forget nodes silent past --forget-after; and, whenever woken, clean up dropped nodes'
        blocks in steps."""
        next_purge = time.monotonic() + 1.0
        while not self._stop.is_set():
            self.service.wake.wait(max(0.0, next_purge - time.monotonic()))
            self.service.wake.clear()
            if self._stop.is_set():
                return
            try:
                if time.monotonic() >= next_purge:
                    next_purge = time.monotonic() + 1.0
                    self.service.purge()
                    self.service.store_reached()
                self.service.collect()
            except ConnectionError as e:
                self.service.store_failed(e)

    @property
    def http_port(self) -> int:
        return self._http.server_address[1] if self._http else 0

    def wait(self, timeout: float | None = None) -> bool:
        """Whether a stop was requested, after waiting at most `timeout` seconds (None: until one is)."""
        return self._stop.wait(timeout)

    def request_stop(self) -> None:
        self._stop.set()

    def stop(self) -> None:
        self._stop.set()
        self.service.wake.set()
        self._grpc.stop(1.0).wait()
        if self._http:
            self._http.shutdown()
            self._http.server_close()
        self.store.close()
