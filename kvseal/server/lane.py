"""Serves the local lane (kvseal.lane): Query, Release, Save and Load on a unix socket, one thread per connection."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from kvseal import lane
from kvseal.engine.engine import Engine
from kvseal.errors import KvsealError
from kvseal.server.metrics import Metrics

log = logging.getLogger("kvseal.server")


class LaneServer:
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
        threading.Thread(target=self._accept, name="kvseal-lane", daemon=True).start()

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
            threading.Thread(target=self._serve, args=(conn,), name="kvseal-lane-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                try:
                    frame = lane.read_frame(conn)
                except KvsealError as e:  # an oversized frame: answer, then drop the connection
                    conn.sendall(lane.encode_error(e.status, str(e)))
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
        method, code = lane.OP_NAMES.get(op, "Unknown"), "OK"
        try:
            request = lane.decode_request(op, body)
            engine = self.engine
            if isinstance(request, lane.QueryRequest):
                q = engine.query(request.instance_id, request.hashes, request.lease_ttl_ms)
                return lane.encode_query_ok(q.hits, q.lease_id, q.lease_ttl_ms, q.namespace_final)
            if isinstance(request, lane.ReleaseRequest):
                engine.release(request.instance_id, request.lease_id)
                return lane.encode_release_ok()
            if isinstance(request, lane.SaveRequest):
                s = engine.save(request.worker, request.hashes, request.block_ids)
                return lane.encode_save_ok(s.written, s.skipped, s.not_stored, s.completed, s.namespace_final)
            r = engine.load(request.worker, request.hashes, request.block_ids, request.lease_id)
            return lane.encode_load_ok(r.outcome, r.loaded, r.reason, r.message)
        except KvsealError as e:
            code = e.status
            return lane.encode_error(e.status, str(e))
        except Exception as e:  # a bug, not bad input: answer and keep serving
            code = "INTERNAL"
            log.exception("lane %s failed", method)
            return lane.encode_error("INTERNAL", f"{method} failed inside the engine: {type(e).__name__}: {e}")
        finally:
            self.metrics.observe_rpc(f"lane.{method}", code, time.perf_counter() - start)
