"""`kvseal router` as a real subprocess in front of fake vLLM instances (aiohttp servers on one event loop in a
background thread) that record what they get and answer as vLLM does. A request's body may carry a `fake` object
(the router passes unknown fields on) that tells the fakes how to answer it."""

from __future__ import annotations

import asyncio
import functools
import http.client
import json
import re
import resource
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from conftest import REPO, Meta, free_port, wait_until

from kvseal import cli
from kvseal.core.layout import KvGroup, LayerGeometry, Layout, build_layout, namespace_final
from kvseal.router.legs import REMOTE_DECODE_PARAMS, decode_candidates, explain_incompatibility
from kvseal.router.pool import Instance, KvLayout, LeastInflight, RoundRobin

pytestmark = pytest.mark.process

GATE_TIMEOUT_S = 20.0  # what a fake waits at most for the test to open a gate

BASE = [LayerGeometry(f"model.layers.{i}.attn", "bfloat16", 4096, 2, 0, "kv") for i in range(2)]
LAYOUT_X = build_layout(16, 1, BASE)
LAYOUT_Y = build_layout(16, 1, [*BASE, LayerGeometry("model.layers.2.mtp.attn", "bfloat16", 4096, 2, 0, "kv")])


def kvseal_part(layout: Layout, node_id: str = "", hashes: list[bytes] | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {
        "version": 1,
        "namespace_final": namespace_final("llama", layout),
        "descriptor": layout.descriptor.decode(),
    }
    if node_id:
        part["node_id"] = node_id
    if hashes is not None:
        part["block_hashes"] = [h.hex() for h in hashes]
    return part


# ---------------------------------------------------------------- fake vLLM instances


@dataclass
class Received:
    path: str
    request_id: str
    body: dict[str, Any]


@dataclass(eq=False)
class Fake:
    """One fake vLLM instance. `layout`: what a decode instance's kvseal connector describes (None: no kvseal)."""

    name: str
    role: str  # prefill | decode
    layout: Layout | None = None
    node_id: str = ""
    hang: bool = False  # a decode instance that accepts and never answers
    url: str = ""
    received: list[Received] = field(default_factory=list)
    probes: list[Received] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)

    def got(self, rid: str) -> list[Received]:
        return [r for r in self.received if r.request_id == rid]


class Upstreams:
    """The fakes' event loop, in a thread of the test process."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fake-vllm", daemon=True)
        self.thread.start()
        self.runners: list[web.AppRunner] = []
        self.gates: dict[str, asyncio.Event] = {}

    def start(self, fake: Fake) -> Fake:
        fake.url = asyncio.run_coroutine_threadsafe(self._start(fake), self.loop).result(10)
        return fake

    def open_gate(self, key: str) -> None:
        self.loop.call_soon_threadsafe(lambda: self._gate(key).set())

    def close(self) -> None:
        async def cleanup() -> None:
            for runner in self.runners:
                await runner.cleanup()

        asyncio.run_coroutine_threadsafe(cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def _gate(self, key: str) -> asyncio.Event:
        return self.gates.setdefault(key, asyncio.Event())

    async def _wait_gate(self, key: str) -> None:
        await asyncio.wait_for(self._gate(key).wait(), GATE_TIMEOUT_S)

    async def _start(self, fake: Fake) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", functools.partial(self._handle, fake))
        app.router.add_post("/v1/chat/completions", functools.partial(self._handle, fake))
        app.router.add_get("/v1/models", functools.partial(self._models, fake))
        # handler_cancellation: a handler sees the router drop its connection, as vLLM's abort does
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self.runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    async def _models(self, fake: Fake, request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": fake.name}]})

    async def _handle(self, fake: Fake, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        got = Received(request.path, request.headers.get("X-Request-Id", ""), body)
        if body.get("kv_transfer_params") == {"kvseal_describe": True}:
            fake.probes.append(got)
            described = {"kvseal": kvseal_part(fake.layout, fake.node_id)} if fake.layout else None
            return web.json_response({"choices": [{"text": "!"}], "kv_transfer_params": described})
        fake.received.append(got)
        how = body.get("fake", {})
        if fake.role == "prefill":
            return self._prefill(fake, how)
        if fake.hang:
            await asyncio.sleep(GATE_TIMEOUT_S)
        if "decode_status" in how:
            return web.json_response({"error": {"message": "it broke"}}, status=how["decode_status"])
        if "gate" in how and not body.get("stream"):
            await self._wait_gate(how["gate"])
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "abc"}], "served_by": fake.name})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i, text in enumerate("abc"):
            await out.write(b"data: " + json.dumps({"choices": [{"text": text}]}).encode() + b"\n\n")
            if i == 0 and "gate" in how:
                try:
                    await self._wait_gate(how["gate"])
                except asyncio.CancelledError:
                    fake.cancelled.append(got.request_id)
                    raise
        await out.write(b"data: [DONE]\n\n")
        return out

    def _prefill(self, fake: Fake, how: dict[str, Any]) -> web.StreamResponse:
        if "prefill_status" in how:
            return web.json_response({"error": {"message": "bad prompt"}}, status=how["prefill_status"])
        if how.get("prefill_garbage"):
            return web.Response(text="<html>oops</html>", content_type="text/html")
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": fake.name,
            "remote_block_ids": [],
            "remote_host": None,
            "remote_port": None,
        }
        if "kvseal" in how:
            params["kvseal"] = how["kvseal"]
        return web.json_response({"choices": [{"text": "x", "finish_reason": "length"}], "kv_transfer_params": params})


# ---------------------------------------------------------------- routers


class RouterProcess:
    """A `kvseal router` on port 0; `url` is where its start line says it serves."""

    def __init__(
        self,
        workdir: Path,
        name: str,
        prefill: list[str],
        decode: list[str],
        *extra: str,
        open_files: tuple[int, int] | None = None,
    ) -> None:
        """`open_files`: (soft, hard) RLIMIT_NOFILE to start with, as `ulimit -n` would set it."""
        self.prefill, self.decode = prefill, decode
        self.out, self.err = workdir / f"{name}.stdout", workdir / f"{name}.stderr"
        argv = [sys.executable, "-m", "kvseal", "router", "--listen", "127.0.0.1:0", *extra]
        if open_files is not None:  # set in a new interpreter that execs the router: no preexec_fn in a threaded parent
            argv = [sys.executable, "-c", _WITH_OPEN_FILES, *map(str, open_files), *argv[1:]]
        for flag, urls in (("--prefill", prefill), ("--decode", decode)):
            for url in urls:
                argv += [flag, url]
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                argv,
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
            )
        self.url = ""

    def wait_ready(self) -> None:
        def line() -> str:
            assert self.proc.poll() is None, self.err.read_text()
            text = self.out.read_text()
            return text if text.endswith("\n") else ""

        self.start_line = wait_until(line, 30, "the router's start line").strip()
        match = re.fullmatch(
            r"kvseal router serving on (http://127\.0\.0\.1:\d+), prefill \[.*\], decode \[.*\]", self.start_line
        )
        assert match, self.start_line
        self.url = match.group(1)

    def stop(self) -> list[str]:
        """Waits for the exit that SIGTERM (sent by the caller, to every router at once) asks for."""
        try:
            rc = self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return [f"router {self.url} ignored SIGTERM"]
        err = self.err.read_text()
        return [f"router {self.url} exited {rc}:\n{err}"] if rc != 0 or "Traceback" in err else []


# argv: soft hard python-args...; forking with a preexec_fn from pytest (threads, torch loaded) aborted the child once
_WITH_OPEN_FILES = (
    "import os, resource, sys; "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2]))); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[3:]])"
)


@dataclass
class Setup:
    fakes: dict[str, Fake]
    routers: dict[str, RouterProcess]
    upstreams: Upstreams
    meta: Meta
    dead: str  # a URL nobody listens on


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    workdir = tmp_path_factory.mktemp("router")
    upstreams = Upstreams()
    specs = [
        Fake("p1", "prefill"),
        Fake("p2", "prefill"),
        Fake("pk", "prefill"),
        Fake("d1", "decode"),
        Fake("d2", "decode"),
        Fake("d3", "decode"),
        Fake("d4", "decode"),
        Fake("dx", "decode", LAYOUT_X, "node-x"),
        Fake("dy", "decode", LAYOUT_Y, "node-y"),
        Fake("da", "decode", LAYOUT_X, "node-a"),
        Fake("db", "decode", LAYOUT_X, "node-b"),
        Fake("dhang", "decode", hang=True),
        Fake("d5", "decode"),
    ]
    fakes = {f.name: upstreams.start(f) for f in specs}
    u = {name: f.url for name, f in fakes.items()}
    dead_p, dead_d, meta_port = (f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}", free_port())
    routers = {
        "rr": RouterProcess(workdir, "rr", [u["p1"], u["p2"]], [u["d1"], u["d2"]]),
        "li": RouterProcess(workdir, "li", [u["p1"]], [u["d3"], u["d4"]], "--policy", "least_inflight"),
        "compat1": RouterProcess(workdir, "compat1", [u["pk"]], [u["dx"]]),
        # a MetaServer nobody runs: every pick falls back to the policy
        "compat2": RouterProcess(
            workdir, "compat2", [u["pk"]], [u["dy"], u["dx"]], "--metaserver", f"127.0.0.1:{free_port()}"
        ),
        "errors": RouterProcess(workdir, "errors", [u["p1"], dead_p], [dead_d, u["dhang"], u["d5"]], "--timeout", "1"),
        "meta": RouterProcess(workdir, "meta", [u["pk"]], [u["da"], u["db"]], "--metaserver", f"127.0.0.1:{meta_port}"),
    }
    meta = Meta(workdir, port=meta_port)  # starts while the routers do
    try:
        for router in routers.values():
            router.wait_ready()
        yield Setup(fakes, routers, upstreams, meta, dead_p)
    finally:
        for router in routers.values():
            router.proc.send_signal(signal.SIGTERM)
        problems = [p for router in routers.values() for p in router.stop()]
        meta.stop(signal.SIGKILL)
        upstreams.close()
        if problems:
            pytest.fail("\n".join(problems), pytrace=False)


# ---------------------------------------------------------------- a client


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def post(router: RouterProcess, body: dict[str, Any], path: str = "/v1/completions", **headers: str) -> Answer:
    data = json.dumps(body).encode()
    request = urllib.request.Request(router.url + path, data=data, headers={"Content-Type": "application/json"})
    for name, value in headers.items():
        request.add_header(name.replace("_", "-"), value)
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return Answer(response.status, dict(response.headers), response.read())
    except urllib.error.HTTPError as e:
        with e:
            return Answer(e.code, dict(e.headers), e.read())


def get(router: RouterProcess, path: str) -> Answer:
    with urllib.request.urlopen(router.url + path, timeout=20) as response:
        return Answer(response.status, dict(response.headers), response.read())


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "llama", "prompt": "hello", "max_tokens": 20, **extra}


def served_by(fakes: list[Fake], rid: str) -> list[str]:
    return [f.name for f in fakes for _ in f.got(rid)]


# ---------------------------------------------------------------- the wire


def test_one_request_id_both_legs_and_the_pd_parameters(setup: Setup) -> None:
    rr, f = setup.routers["rr"], setup.fakes
    a = post(rr, completion(stream=False, min_tokens=5))
    assert a.status == 200, a.body
    rid = a.headers["X-Request-Id"]
    assert re.fullmatch(r"[0-9a-f]{32}", rid)
    [prefill] = [r for name in ("p1", "p2") for r in f[name].got(rid)]
    [decode] = [r for name in ("d1", "d2") for r in f[name].got(rid)]
    assert prefill.path == decode.path == "/v1/completions"
    assert prefill.body == {
        "model": "llama",
        "prompt": "hello",
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": REMOTE_DECODE_PARAMS,
    }
    handed_over = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": served_by([f["p1"], f["p2"]], rid)[0],
        "remote_block_ids": [],
        "remote_host": None,
        "remote_port": None,
    }
    assert decode.body == completion(stream=False, min_tokens=5, kv_transfer_params=handed_over)
    assert a.json()["choices"] == [{"text": "abc"}]

    b = post(rr, completion(), X_Request_Id="client-id-7")
    assert b.status == 200 and b.headers["X-Request-Id"] == "client-id-7"
    assert len(served_by([f["p1"], f["p2"]], "client-id-7")) == len(served_by([f["d1"], f["d2"]], "client-id-7")) == 1


def test_chat_prefill_gets_one_completion_token_and_no_stream_options(setup: Setup) -> None:
    rr, f = setup.routers["rr"], setup.fakes
    chat = {
        "model": "llama",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 40,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    a = post(rr, chat, "/v1/chat/completions")
    assert a.status == 200 and a.headers["Content-Type"].startswith("text/event-stream")
    rid = a.headers["X-Request-Id"]
    [prefill] = [r for name in ("p1", "p2") for r in f[name].got(rid)]
    [decode] = [r for name in ("d1", "d2") for r in f[name].got(rid)]
    assert prefill.path == decode.path == "/v1/chat/completions"
    assert prefill.body["max_tokens"] == prefill.body["max_completion_tokens"] == 1
    assert prefill.body["stream"] is False and "stream_options" not in prefill.body
    assert decode.body["stream"] is True and decode.body["stream_options"] == {"include_usage": True}
    assert decode.body["max_completion_tokens"] == 40


def test_a_stream_is_relayed_chunk_by_chunk_as_it_arrives(setup: Setup) -> None:
    rr = setup.routers["rr"]
    gate = uuid.uuid4().hex
    conn = http.client.HTTPConnection(rr.url.removeprefix("http://"), timeout=10)
    try:
        conn.request("POST", "/v1/completions", json.dumps(completion(stream=True, fake={"gate": gate})))
        response = conn.getresponse()
        assert response.status == 200
        # the decode holds its other chunks until the first has reached the client: a buffering router would stall
        assert json.loads(response.readline().removeprefix(b"data: "))["choices"] == [{"text": "a"}]
        assert response.readline() == b"\n"
        setup.upstreams.open_gate(gate)
        rest = response.read()
    finally:
        conn.close()
    events = [e for e in rest.split(b"\n\n") if e]
    assert [json.loads(e.removeprefix(b"data: "))["choices"][0]["text"] for e in events[:-1]] == ["b", "c"]
    assert events[-1] == b"data: [DONE]"


def test_a_client_that_goes_away_mid_stream_cancels_the_decode_leg(setup: Setup) -> None:
    rr, f = setup.routers["rr"], setup.fakes
    conn = http.client.HTTPConnection(rr.url.removeprefix("http://"), timeout=10)
    conn.request("POST", "/v1/completions", json.dumps(completion(stream=True, fake={"gate": uuid.uuid4().hex})))
    response = conn.getresponse()
    rid = response.headers["X-Request-Id"]
    assert response.readline().startswith(b"data: ")
    conn.close()
    response.close()
    wait_until(lambda: rid in f["d1"].cancelled + f["d2"].cancelled, 10, "the decode leg to be cancelled")


def test_round_robin_alternates_both_legs(setup: Setup) -> None:
    rr, f = setup.routers["rr"], setup.fakes
    rids = [post(rr, completion()).headers["X-Request-Id"] for _ in range(4)]
    prefills = [served_by([f["p1"], f["p2"]], rid)[0] for rid in rids]
    decodes = [served_by([f["d1"], f["d2"]], rid)[0] for rid in rids]
    for order in (prefills, decodes):
        assert order[0] != order[1] and order[:2] == order[2:], order


def test_least_inflight_prefers_the_idle_instance(setup: Setup) -> None:
    li, f, up = setup.routers["li"], setup.fakes, setup.upstreams
    gate = uuid.uuid4().hex
    held: list[Answer] = []
    thread = threading.Thread(target=lambda: held.append(post(li, completion(fake={"gate": gate}))))
    thread.start()
    try:
        busy = wait_until(
            lambda: [n for n in ("d3", "d4") if f[n].received and "gate" in f[n].received[-1].body.get("fake", {})],
            10,
            "the held request to reach a decode instance",
        )
        idle = {"d3": "d4", "d4": "d3"}[busy[0]]
        # round robin would send the second of these to the busy instance
        for _ in range(2):
            a = post(li, completion())
            assert a.status == 200 and served_by([f["d3"], f["d4"]], a.headers["X-Request-Id"]) == [idle]
    finally:
        up.open_gate(gate)
        thread.join(10)
    assert held[0].status == 200


# ---------------------------------------------------------------- layouts


def test_incompatible_layouts_get_409_naming_the_layer_and_no_decode_leg(setup: Setup) -> None:
    router, dx = setup.routers["compat1"], setup.fakes["dx"]
    a = post(router, completion(model="m-compat1", fake={"kvseal": kvseal_part(LAYOUT_Y)}))
    assert a.status == 409, a.body
    assert a.json() == {
        "error": {
            "message": "the prefill and decode instances cannot share KV: layer 'model.layers.2.mtp.attn' only in "
            "prefill",
            "type": "incompatible_kv_layout",
            "code": 409,
        }
    }
    assert dx.got(a.headers["X-Request-Id"]) == []

    ok = post(router, completion(model="m-compat1", fake={"kvseal": kvseal_part(LAYOUT_X)}))
    assert ok.status == 200, ok.body
    [decode] = dx.got(ok.headers["X-Request-Id"])
    assert decode.body["kv_transfer_params"]["kvseal"] == kvseal_part(LAYOUT_X)
    probes = [p for p in dx.probes if p.body["model"] == "m-compat1"]
    assert [p.body for p in probes] == [
        {"model": "m-compat1", "prompt": [0], "max_tokens": 1, "kv_transfer_params": {"kvseal_describe": True}}
    ], "a decode instance is probed once"

    # an error from a decode instance makes the router learn its layout again
    broken = post(router, completion(model="m-compat1", fake={"kvseal": kvseal_part(LAYOUT_X), "decode_status": 500}))
    assert broken.status == 500
    assert post(router, completion(model="m-compat1", fake={"kvseal": kvseal_part(LAYOUT_X)})).status == 200
    assert len([p for p in dx.probes if p.body["model"] == "m-compat1"]) == 2


def test_several_decode_instances_the_compatible_one_is_picked(setup: Setup) -> None:
    router, f = setup.routers["compat2"], setup.fakes
    for layout, expected in ((LAYOUT_X, "dx"), (LAYOUT_Y, "dy")):
        for _ in range(3):
            part = kvseal_part(layout, hashes=[b"\x01" * 16])  # hashes for a MetaServer that is down
            a = post(router, completion(model="m-compat2", fake={"kvseal": part}))
            assert a.status == 200, a.body
            assert served_by([f["dx"], f["dy"]], a.headers["X-Request-Id"]) == [expected]


def test_the_metaserver_picks_the_node_with_the_longest_prefix(setup: Setup) -> None:
    router, f, meta = setup.routers["meta"], setup.fakes, setup.meta
    ns = namespace_final("llama", LAYOUT_X)
    held = [bytes([i]) * 16 for i in range(4)]
    for node in ("node-a", "node-b"):
        meta.heartbeat(node)
    meta.announce("node-a", held[:1], ns=ns)
    meta.announce("node-b", held, ns=ns)
    for _ in range(3):
        a = post(router, completion(model="m-meta", fake={"kvseal": kvseal_part(LAYOUT_X, hashes=held)}))
        assert a.status == 200, a.body
        assert served_by([f["da"], f["db"]], a.headers["X-Request-Id"]) == ["db"]
    # a prefix no node holds: the policy picks
    unknown = [b"\xee" * 16]
    picked = []
    for _ in range(2):
        a = post(router, completion(model="m-meta", fake={"kvseal": kvseal_part(LAYOUT_X, hashes=unknown)}))
        picked += served_by([f["da"], f["db"]], a.headers["X-Request-Id"])
    assert sorted(picked) == ["da", "db"]


# ---------------------------------------------------------------- failures


def test_a_prefill_http_error_is_relayed_and_a_bad_answer_is_502(setup: Setup) -> None:
    rr, f = setup.routers["rr"], setup.fakes
    a = post(rr, completion(fake={"prefill_status": 400}))
    assert (a.status, a.json()) == (400, {"error": {"message": "bad prompt"}})
    assert served_by([f["d1"], f["d2"]], a.headers["X-Request-Id"]) == []
    b = post(rr, completion(fake={"prefill_garbage": True}))
    assert b.status == 502
    assert re.fullmatch(
        r"the prefill instance http://\S+ answered 200 with a body that is not JSON", b.json()["error"]["message"]
    )


def test_dead_instances_get_502_at_once_and_a_silent_one_504_after_the_timeout(setup: Setup) -> None:
    router, f = setup.routers["errors"], setup.fakes
    started = time.monotonic()
    a = post(router, completion())  # p1, then the dead decode instance
    assert a.status == 502 and time.monotonic() - started < 5
    assert a.json()["error"]["message"] == f"the decode instance {router.decode[0]} is unreachable: Connection refused"
    assert a.json()["error"]["type"] == "bad_gateway"
    b = post(router, completion())  # the dead prefill instance
    assert b.status == 502
    assert b.json()["error"]["message"] == f"the prefill instance {setup.dead} is unreachable: Connection refused"

    started = time.monotonic()
    c = post(router, completion())  # p1, then the decode instance that never answers
    waited = time.monotonic() - started
    assert c.status == 504 and 1 <= waited < 10, (c.status, waited)
    assert c.json()["error"] == {
        "message": f"the decode instance {f['dhang'].url} did not answer within 1 s",
        "type": "gateway_timeout",
        "code": 504,
    }
    health = get(router, "/health").json()
    assert [(i["url"], i["ok"]) for i in health["prefill"]] == [(f["p1"].url, True), (setup.dead, False)]
    decodes = [(router.decode[0], False), (f["dhang"].url, False), (f["d5"].url, None)]
    assert [(i["url"], i["ok"]) for i in health["decode"]] == decodes

    # the dead prefill instance's turn, then p1 and d5, whose stream goes silent after its first chunk: the status is
    # sent, so the failure is the stream's last event
    assert post(router, completion()).status == 502
    d = post(router, completion(stream=True, fake={"gate": uuid.uuid4().hex}))
    assert d.status == 200
    events = [e.removeprefix(b"data: ") for e in d.body.split(b"\n\n") if e]
    assert json.loads(events[0])["choices"] == [{"text": "a"}] and events[2] == b"[DONE]"
    assert json.loads(events[1])["error"]["message"] == f"the decode instance {f['d5'].url} did not answer within 1 s"
    wait_until(lambda: f["d5"].cancelled, 10, "the silent decode leg to be dropped")


# ---------------------------------------------------------------- the rest


def test_health_and_models(setup: Setup) -> None:
    rr, f = setup.routers["rr"], setup.fakes
    for _ in range(2):  # every instance answers one (round robin): the last contact of each worked
        assert post(rr, completion()).status == 200
    health = get(rr, "/health").json()
    assert health["status"] == "ok"
    assert [i["url"] for i in health["prefill"]] == [f["p1"].url, f["p2"].url]
    assert [i["url"] for i in health["decode"]] == [f["d1"].url, f["d2"].url]
    assert all(i["ok"] is True and i["inflight"] == 0 for i in health["prefill"] + health["decode"])
    models = get(rr, "/v1/models").json()
    assert models["data"][0]["id"] == "fake" and models["data"][0]["owned_by"] in ("d1", "d2")
    lists = f"prefill [{f['p1'].url}, {f['p2'].url}], decode [{f['d1'].url}, {f['d2'].url}]"
    assert rr.start_line == f"kvseal router serving on {rr.url}, {lists}"


def test_bad_command_lines_exit_2_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    for extra, flag in (
        (["--listen", "0.0.0.0:8000"], "--listen"),
        (["--decode", "127.0.0.1:3"], "--decode"),
        (["--decode", "http://127.0.0.1:2"], "--decode"),
        (["--timeout", "0"], "--timeout"),
        (["--max-requests", "-1"], "--max-requests"),
        (["--max-body-size", "0"], "--max-body-size"),
    ):
        with pytest.raises(SystemExit) as exit_:
            cli.parse_args(base + extra)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and len(err.splitlines()) == 1 and f"argument {flag}" in err, err
    assert cli.parse_args([*base, "--listen", "0.0.0.0:8000", "--allow-remote"]).router_config.allow_remote


def test_policies_take_turns_within_a_subset() -> None:
    a, b, c = Instance("a"), Instance("b"), Instance("c")
    rr = RoundRobin([a, b, c])
    assert [rr.pick().url for _ in range(4)] == ["a", "b", "c", "a"]
    assert [rr.pick([a, c]).url for _ in range(3)] == ["c", "a", "c"]
    li = LeastInflight([a, b, c])
    b.inflight = c.inflight = 1
    assert [li.pick().url for _ in range(2)] == ["a", "a"]
    a.inflight = 1
    assert [li.pick().url for _ in range(3)] == ["b", "c", "a"]


def test_decode_candidates_compatible_first_then_unknown_never_incompatible() -> None:
    x = KvLayout(namespace_final("llama", LAYOUT_X), LAYOUT_X.descriptor.decode())
    y = KvLayout(namespace_final("llama", LAYOUT_Y), LAYOUT_Y.descriptor.decode())
    same, other, unknown = Instance("same", layout=x), Instance("other", layout=y), Instance("unknown")
    assert decode_candidates(x, [other, unknown, same]) == ([same], [other])
    assert decode_candidates(x, [other, unknown]) == ([unknown], [other])
    assert decode_candidates(x, [other]) == ([], [other])
    assert decode_candidates(None, [other, unknown]) == ([other, unknown], [])
    assert explain_incompatibility(y, x) == "layer 'model.layers.2.mtp.attn' only in prefill"
    # a hybrid model's groups are part of the layout: another window is another layout, named by its group
    gemma = [replace(g, group_id=i) for i, g in enumerate(BASE)]
    p, d = (
        KvLayout(namespace_final("gemma", lay), lay.descriptor.decode())
        for lay in (build_layout(16, 1, gemma, (KvGroup("sliding", 16, w), KvGroup("full", 16))) for w in (512, 4096))
    )
    assert decode_candidates(p, [Instance("d", layout=d)])[0] == []
    assert explain_incompatibility(p, d) == "group 0: prefill 'sliding 512 x16', decode 'sliding 4096 x16'"
    # one layout under two namespaces (another model): only the names differ
    renamed = KvLayout(namespace_final("qwen", LAYOUT_X), x.descriptor)
    assert (
        explain_incompatibility(renamed, x)
        == f"namespace_final: prefill {renamed.namespace_final!r}, decode {x.namespace_final!r}"
    )


# ---------------------------------------------------------------- limits

STREAMS = 500


@pytest.fixture
def open_files() -> Iterator[int]:
    """This test process holds both ends' sockets of hundreds of streams: its soft limit goes to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 8 * STREAMS:
        pytest.fail(f"the hard open-file limit ({hard}) is below {8 * STREAMS}: raise it (ulimit -Hn)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    yield hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def concurrent_streams(router: RouterProcess, upstreams: Upstreams, n: int) -> list[tuple[int, bytes]]:
    """(status, body) of `n` streaming requests sent at once. Every decode stream holds after its first chunk until
    all `n` have an answer (that first chunk, or an error), so they are all in flight together."""
    gate = uuid.uuid4().hex
    heads = 0

    def arrived() -> None:
        nonlocal heads
        heads += 1
        if heads == n:
            upstreams.open_gate(gate)

    async def one(session: aiohttp.ClientSession) -> tuple[int, bytes]:
        body = completion(stream=True, fake={"gate": gate})
        async with session.post(router.url + "/v1/completions", json=body) as r:
            if r.status != 200:
                answer = await r.read()
                arrived()
                return r.status, answer
            first = await r.content.readline() + await r.content.readline()
            arrived()
            return r.status, first + await r.content.read()

    async def run() -> list[tuple[int, bytes]]:
        timeout = aiohttp.ClientTimeout(total=GATE_TIMEOUT_S + 20)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
            return list(await asyncio.gather(*(one(session) for _ in range(n))))

    return asyncio.run(run())


def _whole_stream(body: bytes) -> bool:
    events = [e.removeprefix(b"data: ") for e in body.split(b"\n\n") if e]
    return events[-1:] == [b"[DONE]"] and [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == list("abc")


def _soft_open_files(pid: int) -> int:
    line = next(x for x in Path(f"/proc/{pid}/limits").read_text().splitlines() if x.startswith("Max open files"))
    return int(line.split()[3])


def test_500_streams_at_a_1024_soft_limit_all_complete(setup: Setup, open_files: int, tmp_path: Path) -> None:
    """`ulimit -n 1024` (soft): the router raises its soft limit to the hard one at start, as the engine does."""
    p, d = (setup.upstreams.start(Fake(f"{role}-fd", role)) for role in ("prefill", "decode"))
    router = RouterProcess(tmp_path, "fd", [p.url], [d.url], open_files=(1024, open_files))
    try:
        router.wait_ready()
        assert _soft_open_files(router.proc.pid) == open_files
        answers = concurrent_streams(router, setup.upstreams, STREAMS)
        assert sorted({status for status, _ in answers}) == [200]
        assert all(_whole_stream(body) for _, body in answers)
        assert len(d.received) == STREAMS
    finally:
        router.proc.send_signal(signal.SIGTERM)
        assert router.stop() == []


def test_past_max_requests_a_clear_503_and_never_a_502(setup: Setup, open_files: int, tmp_path: Path) -> None:
    """soft = hard = 1024: the default bound (a quarter of the descriptors, less a reserve) leaves the admitted
    requests their upstream connections; the others get 503 at once, naming the flag."""
    p, d = (setup.upstreams.start(Fake(f"{role}-cap", role)) for role in ("prefill", "decode"))
    router = RouterProcess(tmp_path, "cap", [p.url], [d.url], open_files=(1024, 1024))
    try:
        router.wait_ready()
        bound = (1024 - 64) // 4
        assert f"serving at most {bound} requests at once (open-file limit 1024)" in router.err.read_text()
        answers = concurrent_streams(router, setup.upstreams, STREAMS)
        statuses = [status for status, _ in answers]
        assert set(statuses) <= {200, 503}, sorted(set(statuses))
        assert all(_whole_stream(body) for status, body in answers if status == 200)
        assert statuses.count(200) == bound, statuses.count(200)
        refused = {json.loads(body)["error"]["message"] for status, body in answers if status == 503}
        assert refused == {
            f"the router is serving {bound} requests, its limit (--max-requests): retry later, or raise --max-requests"
        }
        # once they are done, the router serves again
        assert post(router, completion()).status == 200
    finally:
        router.proc.send_signal(signal.SIGTERM)
        assert router.stop() == []


def test_an_oversized_body_is_413_and_a_deeply_nested_one_400(setup: Setup) -> None:
    rr = setup.routers["rr"]
    cap = 4 << 20

    def send(data: bytes, chunked: bool = False) -> Answer:
        conn = http.client.HTTPConnection(rr.url.removeprefix("http://"), timeout=20)
        try:
            conn.request("POST", "/v1/completions", iter([data]) if chunked else data, encode_chunked=chunked)
            response = conn.getresponse()
            return Answer(response.status, dict(response.headers), response.read())
        finally:
            conn.close()

    big = json.dumps(completion(prompt="x" * (50 << 20))).encode()
    a = send(big)
    assert (a.status, a.json()["error"]["type"]) == (413, "invalid_request_error")
    message = f"the request body is {len(big)} bytes, more than the router takes: at most {cap} bytes (--max-body-size)"
    assert a.json()["error"]["message"] == message
    b = send(json.dumps(completion(prompt="x" * (5 << 20))).encode(), chunked=True)  # no Content-Length
    assert b.status == 413
    assert (
        b.json()["error"]["message"]
        == f"the request body is more than the router takes: at most {cap} bytes (--max-body-size)"
    )
    deep = json.dumps(completion(x="@")).encode().replace(b'"@"', b"[" * 5000 + b"]" * 5000)  # valid JSON
    for nested in (b"[" * 100_000, b'{"a":' * 100_000, deep):
        c = send(nested)
        assert c.status == 400, (c.status, c.body[:200])
        assert c.json()["error"]["message"].startswith("the request body nests JSON arrays or objects too deeply")
    assert post(rr, completion()).status == 200  # and the router is fine
