"""Serves the query lane (kvseal.fastquery): Query and Release on a unix socket, one thread per connection."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from kvseal import fastquery as fq
from kvseal.engine.engine import Engine
from kvseal.errors import KvsealError
from kvseal.server.metrics import Metrics

log = logging.getLogger("kvseal.server")


class QueryLaneServer:
    def __init__(self, path: str, engine: Engine, metrics: Metrics) -> None:
        self.path = path
        self.engine = engine
        self.metrics = metrics
        if os.path.exists(path):
            os.unlink(path)  # a stale socket of an earlier engine
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            self._sock.bind(path)
        finally:
            os.umask(old_umask)
        self._sock.listen(64)
        self._closing = False
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()

    def start(self) -> None:
        threading.Thread(target=self._accept, name="kvseal-querylane", daemon=True).start()

    def stop(self) -> None:
        self._closing = True
        self._sock.close()
        with self._lock:
            for conn in self._conns:
                conn.close()
        if os.path.exists(self.path):
            os.unlink(self.path)

    def _accept(self) -> None:
        while not self._closing:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="kvseal-querylane-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                try:
                    frame = fq.read_frame(conn)
                except KvsealError as e:  # an oversized frame: answer, then drop the connection
                    conn.sendall(fq.encode_error(e.status, str(e)))
                    return
                if frame is None:
                    return
                conn.sendall(self._handle(*frame))
        except OSError:
            pass  # the client went away
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _handle(self, op: int, body: bytes) -> bytes:
        start = time.perf_counter()
        method, code = "Query" if op == fq.OP_QUERY else "Release", "OK"
        try:
            request = fq.decode_request(op, body)
            if isinstance(request, fq.ReleaseRequest):
                self.engine.release(request.instance_id, request.lease_id)
                return fq.encode_release_ok()
            r = self.engine.query(request.instance_id, request.hashes, request.lease_ttl_ms)
            return fq.encode_query_ok(r.hits, r.lease_id, r.lease_ttl_ms, r.namespace_final)
        except KvsealError as e:
            code = e.status
            return fq.encode_error(e.status, str(e))
        except Exception as e:  # a bug, not bad input: answer and keep serving
            code = "INTERNAL"
            log.exception("query lane %s failed", method)
            return fq.encode_error("INTERNAL", f"{method} failed inside the engine: {type(e).__name__}: {e}")
        finally:
            self.metrics.observe_rpc(f"lane.{method}", code, time.perf_counter() - start)
