"""`kvseal router`: the aiohttp shell around kvseal.router.legs and kvseal.router.pool.

One request, start to end:

    1. pick a prefill instance (policy); POST legs.prefill_body; an HTTP error there is the client's answer
    2. read the prefill's kv_transfer_params; when they carry a kvseal layout, learn every decode instance's
       layout (one probe each, kept until an error from it) and keep the compatible ones (none: 409)
    3. with --metaserver, the compatible instance whose node holds the longest prefix; else the policy
    4. POST legs.decode_body and relay the answer: SSE chunk by chunk, anything else whole

Every failure to get an answer becomes a RouterError, turned into the client's HTTP error in one place
(`_generate`): 502 for an unreachable instance or a bad answer, 504 past --timeout. A client that goes away
cancels its handler (handler_cancellation), which closes the leg's connection, which vLLM takes as an abort.

Limits: at start the router raises its open-file limit to the hard one; at most --max-requests requests (default
from that limit: each holds a few descriptors) are served at once, and the next ones get 503 at once rather than a
failed connection to an instance later; a body over --max-body-size gets 413 before it is read; a body that nests
JSON too deep to parse gets 400. What a client sent wrong, or sent too much of, is never a 5xx.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import resource
import signal
import sys
import time
import uuid
from typing import Any

import aiohttp
from aiohttp import web

from kvseal.errors import DeadlineExceeded, KvsealError, Unavailable, error_for_status
from kvseal.limits import MAX_BLOCKS_PER_REQUEST, raise_open_file_limit
from kvseal.router.config import FDS_PER_REQUEST, RouterConfig, default_max_requests
from kvseal.router.legs import (
    block_hashes,
    decode_body,
    decode_candidates,
    error_body,
    explain_incompatibility,
    is_definitive_description,
    kv_transfer_params,
    kvseal_layout,
    prefill_body,
    probe_body,
)
from kvseal.router.pool import Instance, KvLayout, make_policy

log = logging.getLogger("kvseal.router")

REQUEST_ID = "X-Request-Id"
CONTENT_TYPE = "Content-Type"
SHUTDOWN_GRACE_S = 5.0  # what requests in flight at SIGTERM get to finish
METASERVER_TIMEOUT_S = 0.5
METASERVER_QUIET_S = 2.0  # after the MetaServer failed a lookup, decode picks use the policy alone for this long


class RouterError(KvsealError):
    """An answer the router gives itself (a bad request, an incompatible pair, a leg without a usable answer): the
    client gets HTTP status `http` (a gateway's own codes: 502, 504, 413 ...) with an OpenAI-style error body of
    type `kind`."""

    def __init__(self, http: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.http, self.kind, self.message = http, kind, message


class PrefixLookup:
    """Which MetaServer nodes hold how much of a prompt's prefix. Blocking gRPC, run in the default executor."""

    def __init__(self, address: str, token: str | None) -> None:
        import grpc  # only a router with --metaserver pays for importing grpc

        from kvseal.proto import kvseal_pb2, kvseal_pb2_grpc

        self._grpc, self._pb = grpc, kvseal_pb2
        self.address = address
        self._channel = grpc.insecure_channel(address)
        self._stub = kvseal_pb2_grpc.MetaServerStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._quiet_until = 0.0

    def _query(self, namespace_final: str, hashes: list[bytes]) -> dict[str, int]:
        request = self._pb.QueryPrefixRequest(namespace_final=namespace_final, block_hashes=hashes)
        answer = self._stub.QueryPrefix(request, timeout=METASERVER_TIMEOUT_S, metadata=self._metadata)
        return {node.node_id: node.prefix for node in answer.nodes}

    async def prefixes(self, namespace_final: str, hashes: list[bytes]) -> dict[str, int]:
        """node_id -> leading hashes it holds; {} when the MetaServer cannot say (it failed now or just before)."""
        if time.monotonic() < self._quiet_until:
            return {}
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(None, self._query, namespace_final, hashes[:MAX_BLOCKS_PER_REQUEST])
        except self._grpc.RpcError as e:
            error = error_for_status(e.code().name, e.details() or "")
            if isinstance(error, Unavailable | DeadlineExceeded):
                self._quiet_until = time.monotonic() + METASERVER_QUIET_S
            log.warning("MetaServer %s: QueryPrefix failed, picking by policy: %s", self.address, error)
            return {}

    def close(self) -> None:
        self._channel.close()


class Router:
    def __init__(self, cfg: RouterConfig, max_requests: int | None = None) -> None:
        """`max_requests`: what --max-requests 0 means here (from the open-file limit); cfg's when it names one."""
        self.cfg = cfg
        self.max_requests = cfg.max_requests or max_requests or default_max_requests(_open_file_limit())
        self.active = 0  # requests being served (an event-loop counter: no lock)
        self.prefill = [Instance(url) for url in cfg.prefill]
        self.decode = [Instance(url) for url in cfg.decode]
        self.pick_prefill = make_policy(cfg.policy, self.prefill)
        self.pick_decode = make_policy(cfg.policy, self.decode)
        self.meta = PrefixLookup(cfg.metaserver, cfg.token) if cfg.metaserver else None
        self._answer_timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
        # a decode leg may stream for longer than --timeout; what it may not do is stay silent that long
        self._silence_timeout = aiohttp.ClientTimeout(total=None, connect=cfg.timeout_s, sock_read=cfg.timeout_s)
        self._probes: dict[Instance, asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:  # created inside the running loop, as aiohttp wants
            # no connection limit: every client stream holds one connection to its decode instance
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self._session

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        return app

    async def close(self) -> None:
        for task in self._probes.values():
            task.cancel()
        if self._session is not None:
            await self._session.close()
        if self.meta is not None:
            self.meta.close()

    # ---------------------------------------------------------------- endpoints

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "/v1/completions", chat=False)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "/v1/chat/completions", chat=True)

    async def _generate(self, request: web.Request, path: str, chat: bool) -> web.StreamResponse:
        rid = request.headers.get(REQUEST_ID) or uuid.uuid4().hex
        if self.active >= self.max_requests:
            return self._refuse(self._overloaded(), rid)
        self.active += 1
        try:
            return await self._route(request, path, chat, rid)
        except RouterError as e:
            return self._refuse(e, rid)
        except RecursionError:  # json.dumps of a body json.loads just managed, a few frames deeper
            return self._refuse(_too_deep(), rid)
        finally:
            self.active -= 1

    def _overloaded(self) -> RouterError:
        return RouterError(
            503,
            "service_unavailable",
            f"the router is serving {self.max_requests} requests, its limit (--max-requests): retry later, or "
            "raise --max-requests",
        )

    def _refuse(self, e: RouterError, rid: str) -> web.StreamResponse:
        """The client's error response for `e`. A 413 or 503 closes the connection: its descriptor is free at once,
        and a body left unread is not waited for."""
        status = e.http_status
        log.warning("request %s: %d %s", rid, status, e.message)
        headers = {REQUEST_ID: rid}
        if status == 503:
            headers["Retry-After"] = "1"
        response = web.json_response(error_body(e.message, e.kind, status), status=status, headers=headers)
        if status in (413, 503):
            response.force_close()
        return response

    async def _models(self, request: web.Request) -> web.StreamResponse:
        if self.active >= self.max_requests:
            return self._refuse(self._overloaded(), request.headers.get(REQUEST_ID) or uuid.uuid4().hex)
        self.active += 1
        try:
            return await self._models_of_one(request)
        finally:
            self.active -= 1

    async def _models_of_one(self, request: web.Request) -> web.StreamResponse:
        instance = self.pick_decode.pick()
        try:
            async with self.session.get(
                instance.url + "/v1/models", headers=_forwarded(request), timeout=self._answer_timeout
            ) as up:
                body = await up.read()
                self._answered(instance, up.status)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            err = self._failed("decode", instance, e)
            return web.json_response(error_body(err.message, err.kind, err.http_status), status=err.http_status)
        return web.Response(status=up.status, body=body, headers={CONTENT_TYPE: _content_type(up)})

    async def _health(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {
                "status": "ok",
                "prefill": [i.health() for i in self.prefill],
                "decode": [i.health() for i in self.decode],
            }
        )

    # ---------------------------------------------------------------- one request

    async def _route(self, request: web.Request, path: str, chat: bool, rid: str) -> web.StreamResponse:
        cap = self.cfg.max_body_bytes
        length = request.content_length
        if length is not None and length > cap:
            raise _too_large(length, cap)
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:  # a body without Content-Length, read up to the cap
            raise _too_large(None, cap) from None
        try:
            body = json.loads(raw)
        except RecursionError:
            raise _too_deep() from None
        except ValueError:
            raise RouterError(400, "invalid_request_error", "the request body is not JSON") from None
        # Python 3.12 and later parse deeper than the recursion limit (3.13: some thousands of levels): same limit
        limit = sys.getrecursionlimit()
        if raw.count(b"[") + raw.count(b"{") > limit and _nesting_depth(body) > limit:
            raise _too_deep()
        if not isinstance(body, dict):
            raise RouterError(400, "invalid_request_error", "the request body must be a JSON object")
        headers = _forwarded(request) | {REQUEST_ID: rid}

        prefill = self.pick_prefill.pick()
        answered = await self._prefill(prefill, path, prefill_body(body, chat), headers, rid)
        if isinstance(answered, web.Response):
            return answered  # the prefill's own HTTP error
        params = kv_transfer_params(answered)
        if params is None:
            log.debug("request %s: prefill %s handed no kv_transfer_params over", rid, prefill.url)

        layout = kvseal_layout(params)
        if layout is not None:
            await self._learn_layouts(body.get("model"), _forwarded(request))
        candidates, incompatible = decode_candidates(layout, self.decode)
        if not candidates:
            assert layout is not None  # decode_candidates leaves nothing out without a prefill layout
            other = self.pick_decode.pick(incompatible)
            assert other.layout is not None
            why = explain_incompatibility(layout, other.layout)
            raise RouterError(409, "incompatible_kv_layout", "the prefill and decode instances cannot share KV: " + why)
        decode = await self._nearest(layout, params, candidates) or self.pick_decode.pick(candidates)
        log.debug("request %s: prefill %s, decode %s", rid, prefill.url, decode.url)
        return await self._decode(request, decode, path, decode_body(body, params), headers, rid)

    async def _prefill(
        self, instance: Instance, path: str, body: dict[str, Any], headers: dict[str, str], rid: str
    ) -> Any:
        """The prefill's JSON answer, or its HTTP error as the client's response."""
        instance.inflight += 1
        try:
            async with self.session.post(
                instance.url + path, json=body, headers=headers, timeout=self._answer_timeout
            ) as up:
                data = await up.read()
                self._answered(instance, up.status)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise self._failed("prefill", instance, e) from None
        finally:
            instance.inflight -= 1
        if up.status >= 400:
            return web.Response(status=up.status, body=data, headers={CONTENT_TYPE: _content_type(up), REQUEST_ID: rid})
        try:
            return json.loads(data)
        except ValueError:
            instance.ok = False
            why = f"the prefill instance {instance.url} answered {up.status} with a body that is not JSON"
            raise RouterError(502, "bad_gateway", why) from None

    async def _decode(
        self,
        request: web.Request,
        instance: Instance,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        rid: str,
    ) -> web.StreamResponse:
        instance.inflight += 1
        try:
            try:
                up = await self.session.post(
                    instance.url + path, json=body, headers=headers, timeout=self._silence_timeout
                )
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                raise self._failed("decode", instance, e) from None
            try:
                self._answered(instance, up.status)
                if up.content_type != "text/event-stream":
                    try:
                        data = await up.read()
                    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                        raise self._failed("decode", instance, e) from None
                    return web.Response(
                        status=up.status, body=data, headers={CONTENT_TYPE: _content_type(up), REQUEST_ID: rid}
                    )
                return await self._relay_stream(request, instance, up, rid)
            finally:
                # a stream cut short (the client went away, an error) drops the connection: vLLM aborts on that
                if up.content.at_eof():
                    up.release()
                else:
                    up.close()
        finally:
            instance.inflight -= 1

    async def _relay_stream(
        self, request: web.Request, instance: Instance, up: aiohttp.ClientResponse, rid: str
    ) -> web.StreamResponse:
        out = web.StreamResponse(status=up.status, headers={CONTENT_TYPE: _content_type(up), REQUEST_ID: rid})
        await out.prepare(request)
        tail = b"\n\n"
        try:
            while True:
                try:
                    chunk = await up.content.readany()
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    # the status is sent already: the failure becomes the stream's last event, as vLLM does its own
                    err = self._failed("decode", instance, e)
                    log.warning("request %s: %d %s", rid, err.http_status, err.message)
                    event = json.dumps(error_body(err.message, err.kind, err.http_status)).encode()
                    separator = b"" if tail.endswith(b"\n\n") else b"\n\n"
                    await out.write(separator + b"data: " + event + b"\n\ndata: [DONE]\n\n")
                    break
                if not chunk:
                    break
                await out.write(chunk)
                tail = (tail + chunk)[-2:]
            await out.write_eof()
        except ConnectionResetError:  # the client went away between two chunks; the caller drops the decode leg
            log.debug("request %s: the client went away mid-stream", rid)
        return out

    # ---------------------------------------------------------------- decode choice

    async def _learn_layouts(self, model: Any, headers: dict[str, str]) -> None:
        """Probes every decode instance whose layout is not known yet, one probe per instance at a time."""
        waits = []
        for instance in self.decode:
            if instance.learned:
                continue
            task = self._probes.get(instance)
            if task is None:
                task = asyncio.create_task(self._probe(instance, model, headers))
                self._probes[instance] = task
                task.add_done_callback(lambda _, i=instance: self._probes.pop(i, None))
            waits.append(asyncio.shield(task))  # a client going away must not cancel others' probe
        if waits:
            await asyncio.gather(*waits)

    async def _probe(self, instance: Instance, model: Any, headers: dict[str, str]) -> None:
        probe_headers = headers | {REQUEST_ID: f"kvseal-router-probe-{uuid.uuid4().hex}"}
        try:
            async with self.session.post(
                instance.url + "/v1/completions",
                json=probe_body(model),
                headers=probe_headers,
                timeout=self._answer_timeout,
            ) as up:
                self._answered(instance, up.status)
                if up.status != 200:
                    log.warning("decode instance %s answered the layout probe with %d", instance.url, up.status)
                    return
                answer = await up.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            instance.ok = False
            log.warning("cannot learn the KV layout of decode instance %s: %s", instance.url, _describe_error(e))
            return
        params = kv_transfer_params(answer)
        if is_definitive_description(params):
            instance.learned, instance.layout = True, kvseal_layout(params)
            log.info(
                "decode instance %s: %s",
                instance.url,
                f"KV layout {instance.layout.namespace_final}" if instance.layout else "no kvseal connector",
            )

    async def _nearest(
        self, layout: KvLayout | None, params: dict[str, Any] | None, candidates: list[Instance]
    ) -> Instance | None:
        """With a MetaServer: the candidate on the node holding the longest prefix of the prompt (the policy among
        several on that node); None when no candidate's node holds any, or the MetaServer cannot say."""
        on_nodes = [i for i in candidates if i.layout is not None and i.layout.node_id]
        hashes = block_hashes(params)
        if self.meta is None or layout is None or not on_nodes or not hashes:
            return None
        held = await self.meta.prefixes(layout.namespace_final, hashes)
        best = max((held.get(i.layout.node_id, 0) for i in on_nodes if i.layout), default=0)
        if best == 0:
            return None
        return self.pick_decode.pick([i for i in on_nodes if i.layout and held.get(i.layout.node_id, 0) == best])

    # ---------------------------------------------------------------- bookkeeping

    def _answered(self, instance: Instance, status: int) -> None:
        instance.ok = status < 500
        if status >= 500:
            instance.forget_layout()

    def _failed(self, leg: str, instance: Instance, e: BaseException) -> RouterError:
        """The client's error for a leg that got no (whole) answer; the instance counts as failed, unless the
        router itself could not open a connection to it."""
        if isinstance(e, aiohttp.ClientConnectorError) and e.os_error.errno in (errno.EMFILE, errno.ENFILE):
            return RouterError(
                503,
                "service_unavailable",
                f"the router is out of file descriptors (open-file limit {_open_file_limit()}, --max-requests "
                f"{self.max_requests}): retry later; lower --max-requests, or raise the limit (ulimit -n)",
            )
        instance.ok = False
        instance.forget_layout()
        where = f"the {leg} instance {instance.url}"
        # aiohttp's timeouts are asyncio.TimeoutError: TimeoutError itself from 3.11 on, its own class on 3.10
        if isinstance(e, asyncio.TimeoutError):
            return RouterError(504, "gateway_timeout", f"{where} did not answer within {self.cfg.timeout_s:g} s")
        if isinstance(e, aiohttp.ClientConnectorError):
            return RouterError(502, "bad_gateway", f"{where} is unreachable: {_describe_error(e)}")
        return RouterError(502, "bad_gateway", f"{where} broke off its answer: {_describe_error(e)}")


def _too_large(length: int | None, cap: int) -> RouterError:
    size = f"{length} bytes, more" if length is not None else "more"
    message = f"the request body is {size} than the router takes: at most {cap} bytes (--max-body-size)"
    return RouterError(413, "invalid_request_error", message)


def _nesting_depth(value: object) -> int:
    """How deep a json.loads result nests arrays and objects (0 for a scalar), walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _too_deep() -> RouterError:
    return RouterError(
        400,
        "invalid_request_error",
        f"the request body nests JSON arrays or objects too deeply to parse (about {sys.getrecursionlimit()} "
        "levels at most)",
    )


def _open_file_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _forwarded(request: web.Request) -> dict[str, str]:
    """The client's headers that the instances need too (vLLM's --api-key)."""
    auth = request.headers.get("Authorization")
    return {"Authorization": auth} if auth else {}


def _content_type(up: aiohttp.ClientResponse) -> str:
    return up.headers.get(CONTENT_TYPE, "application/json")


def _describe_error(e: BaseException) -> str:
    if isinstance(e, aiohttp.ClientConnectorError):  # asyncio's strerror names the address again: the errno's
        return os.strerror(e.os_error.errno) if e.os_error.errno else str(e.os_error)
    return str(e) or type(e).__name__


def _split_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


async def serve(cfg: RouterConfig) -> int:
    """Runs the router until SIGTERM or SIGINT; 1 when it cannot listen."""
    open_files = raise_open_file_limit()
    router = Router(cfg, default_max_requests(open_files))
    if router.max_requests * FDS_PER_REQUEST > open_files:
        log.warning(
            "--max-requests %d may need %d file descriptors, and the open-file limit is %d: requests past it get 503",
            router.max_requests,
            router.max_requests * FDS_PER_REQUEST,
            open_files,
        )
    log.info("serving at most %d requests at once (open-file limit %d)", router.max_requests, open_files)
    runner = web.AppRunner(router.app(), handler_cancellation=True, shutdown_timeout=SHUTDOWN_GRACE_S, access_log=None)
    await runner.setup()
    host, port = _split_listen(cfg.listen)
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as e:
        print(f"kvseal router: error: cannot listen on {cfg.listen}: {e.strerror or e}", file=sys.stderr)
        await runner.cleanup()
        await router.close()
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    bound = runner.addresses[0][1]  # the real port when --listen asked for port 0
    shown = f"[{host}]" if ":" in host else host
    print(
        f"kvseal router serving on http://{shown}:{bound}, prefill [{', '.join(cfg.prefill)}], decode "
        f"[{', '.join(cfg.decode)}]",
        flush=True,
    )
    await stop.wait()
    await runner.cleanup()
    await router.close()
    return 0
