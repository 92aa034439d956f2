"""Hardening (issue 7): the engine is a shared node service, tried here the way a local attacker would try it.

Every test runs real `kvseal serve` processes. Attacks by another user run in a fresh interpreter that drops to
nobody:nogroup (uid/gid 65534) *after* its imports (`as_nobody`: the interpreter may live where nobody cannot read,
e.g. under /root); the functions named `attack_*` below are what that process runs, and what they return (JSON) is
what the test asserts on. Those tests need root (CI runs as root) and fail otherwise.

Workers here are mostly in-process `Tenant`s (one layer of sealed memfd memory, registered over their own lane
connection, i.e. their own session) or raw lane connections speaking kvseal.wire.lane frames; one test uses a
tests/workers.py Worker process holding torch KV.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import grp
import hashlib
import json
import os
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import REPO, Meta, save_blocks, wait_until
from workers import KV_SHAPE, Worker, attn_layers

from kvseal.client import EngineClient, layer_from_array
from kvseal.errors import DeadlineExceeded, InvalidArgument, KvsealError, PermissionDenied, Unavailable
from kvseal.memfd import SharedArray, new_memfd
from kvseal.proto import kvseal_pb2 as pb
from kvseal.proto import kvseal_pb2_grpc as pb_grpc
from kvseal.testing import EngineProcess, http_get, register_one_rank
from kvseal.wire import lane as ln

pytestmark = pytest.mark.process

TESTS = Path(__file__).resolve().parent
NOBODY = 65534
NAMESPACE = "hardening"
LAYER = "model.layers.0.self_attn.attn"
TAG = "cpu-test"
DTYPE = "bfloat16"
BLOCKS, SLOT = 8, 4096  # a Tenant's memory: BLOCKS blocks of one SLOT-byte slot each (one layer)
WAIT_S = 30.0
LOADED = pb.LoadResponse.LOADED

needs_root = pytest.mark.usefixtures("as_root")


@pytest.fixture
def as_root() -> None:
    """These tests drop a child to uid 65534: a run without root must fail them, not skip them."""
    assert os.geteuid() == 0, "run the suite as root (CI does): these tests drop a child to uid 65534"


def hashes(tag: str, n: int = BLOCKS) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


def pattern(seed: int, blocks: int = BLOCKS, slot: int = SLOT) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (blocks, slot), dtype=np.uint8)


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def layer_spec(fd: int, blocks: int = BLOCKS, slot: int = SLOT) -> pb.LayerSpec:
    """One layer of `blocks` blocks in the memory behind `fd` (for EngineClient.register: a descriptor of this
    process; in a raw REGISTER frame: an index into the descriptors sent with it)."""
    return pb.LayerSpec(
        name=LAYER,
        dtype=DTYPE,
        segment_bytes=slot,
        segments=1,
        layout_tag=TAG,
        num_blocks=blocks,
        strides=[slot],
        memory=pb.MemoryHandle(shm=pb.ShmHandle(fd=fd, offset=0, size=blocks * slot)),
    )


def registration(
    instance_id: str,
    layers: Sequence[pb.LayerSpec],
    *,
    tp_rank: int = 0,
    world_size: int = 1,
    namespace: str = NAMESPACE,
) -> dict[str, Any]:
    """EngineClient.register's arguments (tp_size = world_size: no pipeline stages)."""
    return {
        "instance_id": instance_id,
        "namespace": namespace,
        "tp_rank": tp_rank,
        "tp_size": world_size,
        "pp_rank": 0,
        "world_size": world_size,
        "block_size": 16,
        "layers": list(layers),
    }


def register_frame(instance_id: str, layers: Sequence[pb.LayerSpec], **kwargs: Any) -> bytes:
    return ln.encode_register(pb.RegisterRequest(**registration(instance_id, layers, **kwargs)).SerializeToString())


class Tenant:
    """A worker of the calling process: one layer of BLOCKS blocks in a sealed memfd (kvseal.memfd.SharedArray),
    registered through `client`, whose lane connection is its session."""

    def __init__(
        self,
        client: EngineClient,
        instance_id: str,
        *,
        seed: int,
        tp_rank: int = 0,
        world_size: int = 1,
        namespace: str = NAMESPACE,
        blocks: int = BLOCKS,
        slot: int = SLOT,
    ) -> None:
        self.client = client
        self.shared = SharedArray((blocks, slot))
        self.shared.array[:] = pattern(seed, blocks, slot)
        self.blocks = blocks
        self.key = (instance_id, tp_rank, 0)
        self._registration = {"tp_rank": tp_rank, "world_size": world_size, "namespace": namespace}
        self.status = self.register()

    def register(self) -> pb.InstanceStatus:
        return register_one_rank(
            self.client,
            self.key[0],
            self.shared,
            {LAYER: self.shared.array},
            layout_tag=TAG,
            dtype=DTYPE,
            **self._registration,
        )

    def layer(self) -> pb.LayerSpec:
        return layer_from_array(LAYER, self.shared.array, self.shared, layout_tag=TAG, dtype=DTYPE)

    def block(self, i: int) -> bytes:
        return self.shared.array[i].tobytes()

    def save(self, block_hashes: Sequence[bytes], block_ids: Sequence[int] | None = None) -> pb.SaveResponse:
        return self.client.save(
            self.key, block_hashes, list(range(len(block_hashes))) if block_ids is None else block_ids
        )

    def query(self, block_hashes: Sequence[bytes], **kwargs: Any) -> pb.QueryResponse:
        return self.client.query(self.key[0], block_hashes, **kwargs)

    def load(self, block_hashes: Sequence[bytes], block_ids: Sequence[int], lease_id: int = 0) -> pb.LoadResponse:
        return self.client.load(self.key, block_hashes, block_ids, lease_id=lease_id)

    def close(self) -> None:
        self.client.close()
        self.shared.close()


@pytest.fixture
def tenants(engine_factory: Callable[..., EngineProcess]) -> Iterator[Callable[..., Tenant]]:
    """make(engine, instance_id, *, timeout=30, seed=..., ...) -> a registered Tenant, closed before its engine
    stops."""
    made: list[Tenant] = []

    def make(engine: EngineProcess, instance_id: str, *, timeout: float = 30.0, **kwargs: Any) -> Tenant:
        kwargs.setdefault("seed", len(made) + 1)
        t = Tenant(engine.client(timeout=timeout), instance_id, **kwargs)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


# -------------------------------------------------------------------- raw lane connections


def lane_path(engine: EngineProcess) -> str:
    with engine.client() as client:
        return client.info().lane_socket


def connect(path: str, timeout: float = 30.0) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(path)
    return sock


def call(sock: socket.socket, frame: bytes, fds: Sequence[int] = ()) -> tuple[str, bytes] | None:
    """Sends one frame (with `fds` as SCM_RIGHTS) and reads the answer: (status name, body), None at EOF."""
    if fds:
        sent = socket.send_fds(sock, [frame], list(fds))
        if sent < len(frame):
            sock.sendall(frame[sent:])
    else:
        sock.sendall(frame)
    try:
        reply = ln.read_frame(sock)
    except ConnectionResetError:
        return None
    return None if reply is None else (ln.STATUS_NAMES.get(reply[0], str(reply[0])), reply[1])


def hung_up(sock: socket.socket) -> bool:
    """Whether the engine closed the connection: waits (the socket's timeout) for EOF; False if bytes came."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def closed_now(sock: socket.socket) -> bool:
    """Whether the engine has closed the connection, without waiting."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except ConnectionResetError:
        return True


def unread_bytes(sock: socket.socket) -> int:
    """Bytes this end sent that the engine has not read yet (SIOCOUTQ of a unix stream socket)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, struct.pack("i", 0)))[0]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def error_lines(engine: EngineProcess) -> list[str]:
    return [line for line in engine.stderr().splitlines() if " ERROR " in line]


# -------------------------------------------------------------------- another user: nobody


def nogroup() -> str:
    return grp.getgrgid(NOBODY).gr_name


def as_nobody(attack: str, timeout: float = 120.0, **args: Any) -> Any:
    """Runs `attack_<attack>(**args)` of this module in a fresh interpreter that drops to uid/gid 65534 with no
    supplementary groups before the attack starts, and returns what it returned."""
    code = (
        f"import sys; sys.path[:0] = [{str(TESTS)!r}, {str(REPO)!r}]; import test_hardening; test_hardening._nobody()"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps({"attack": attack, "args": args}),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    assert r.returncode == 0, f"the attack {attack!r} failed as nobody:\n{r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def _nobody() -> None:
    """Entry point of the process `as_nobody` starts (its imports are done, as root, before the drop)."""
    import encodings.idna  # noqa: F401

    import grpc._channel  # noqa: F401  (imported lazily by grpc and numpy: nobody could not read them later)
    import numpy.random  # noqa: F401

    request = json.load(sys.stdin)
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    assert (os.getuid(), os.geteuid(), os.getgid(), os.getegid(), os.getgroups()) == (NOBODY,) * 4 + ([],)
    result = globals()[f"attack_{request['attack']}"](**request["args"])
    print(json.dumps(result), flush=True)


def outcome(fn: Callable[[], Any]) -> list[Any]:
    """[status, value or message]: OK and what fn returned, or the error's gRPC status / errno name."""
    try:
        return ["OK", fn()]
    except KvsealError as e:
        return [e.status, str(e)]
    except grpc.RpcError as e:
        return [e.code().name, e.details()]
    except OSError as e:
        return [errno.errorcode.get(e.errno or 0, type(e).__name__), str(e)]


def raw_outcome(reply: tuple[str, bytes] | None) -> list[Any]:
    return ["closed", ""] if reply is None else [reply[0], reply[1].decode(errors="replace")]


ROOT_HASHES = hashes("root")


@pytest.fixture
def victim() -> Iterator[tuple[str, bytes]]:
    """A root-owned mode-0600 file in /dev/shm holding BLOCKS blocks of secret bytes."""
    secret = os.urandom(BLOCKS * SLOT)
    path = f"/dev/shm/kvseal-victim-{os.getpid()}-{os.urandom(4).hex()}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.write(fd, secret)
    finally:
        os.close(fd)
    st = os.stat(path)
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o600)
    yield path, secret
    os.unlink(path)


def attack_foreign_memory(
    target: str, victim_path: str, root_memfd: str, root_sealed: str, root_lease: int, root_partial: str
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # what the kernel lets this user open: not the victim's file, not root's memfd (through /proc)
    out["open victim rw"] = outcome(lambda: os.open(victim_path, os.O_RDWR))
    out["open victim ro"] = outcome(lambda: os.open(victim_path, os.O_RDONLY))
    out["open root memfd"] = outcome(lambda: os.open(root_memfd, os.O_RDWR))
    # an O_PATH descriptor needs only search permission on /dev/shm: it names the file, it cannot read it
    o_path = os.open(victim_path, os.O_PATH)
    client = EngineClient(target, timeout=30)
    out["register O_PATH of victim"] = outcome(
        lambda: client.register(**registration("nobody-x", [layer_spec(o_path)]))
    )
    own = Tenant(client, "nobody-A", seed=7)
    out["own register"] = ["OK", own.status.sealed]
    out["own save"] = outcome(lambda: own.save(hashes("nobody")).completed)
    out["own query"] = outcome(lambda: own.query(hashes("nobody")).hits)
    # the old path-style handle: ShmHandle field 1 was `path`; an old client sends it and no descriptor
    out["ShmHandle fields"] = sorted(pb.ShmHandle.DESCRIPTOR.fields_by_name)
    path_bytes = victim_path.encode()
    old_shm = b"\x0a" + bytes([len(path_bytes)]) + path_bytes + pb.ShmHandle(size=BLOCKS * SLOT).SerializeToString()
    old_layer = layer_spec(0)
    old_layer.memory.shm.CopyFrom(pb.ShmHandle.FromString(old_shm))
    old_body = pb.RegisterRequest(**registration("nobody-old", [old_layer])).SerializeToString()
    out["old frame carries the path"] = path_bytes in old_body
    with connect(client.info().lane_socket) as sock:
        out["old path-style"] = raw_outcome(call(sock, ln.encode_register(old_body)))
        out["fd index past"] = raw_outcome(call(sock, register_frame("nobody-y", [layer_spec(3)]), fds=[own.shared.fd]))
    # root's instances: not queried, released, joined, taken over or used by this user
    out["query root"] = outcome(lambda: client.query(root_sealed, ROOT_HASHES).hits)
    out["release root lease"] = outcome(lambda: client.release(root_sealed, root_lease))
    out["unregister root worker"] = outcome(lambda: client.unregister((root_sealed, 0, 0)))
    out["save root worker"] = outcome(lambda: client.save((root_sealed, 0, 0), hashes("poison"), list(range(BLOCKS))))
    out["load root worker"] = outcome(lambda: client.load((root_sealed, 0, 0), ROOT_HASHES, list(range(BLOCKS))))
    out["join root instance"] = outcome(
        lambda: client.register(**registration(root_partial, [own.layer()], tp_rank=1, world_size=2)).sealed
    )
    out["take root worker key"] = outcome(lambda: client.register(**registration(root_sealed, [own.layer()])).sealed)
    out["own still registered"] = outcome(lambda: own.query(hashes("nobody")).hits)
    own.close()
    return out


@needs_root
def test_another_user_cannot_register_memory_it_cannot_open_nor_touch_roots_instances(
    engine_factory: Callable[..., EngineProcess], tenants: Callable[..., Tenant], victim: tuple[str, bytes]
) -> None:
    engine = engine_factory("--lane-group", nogroup())
    sealed = tenants(engine, "root-S")
    assert sealed.save(ROOT_HASHES).completed == BLOCKS
    partial = tenants(engine, "root-P", world_size=2)
    assert not partial.status.sealed
    lease = sealed.query(ROOT_HASHES)
    assert lease.hits == BLOCKS
    victim_path, _ = victim

    out = as_nobody(
        "foreign_memory",
        target=engine.target,
        victim_path=victim_path,
        root_memfd=f"/proc/{os.getpid()}/fd/{sealed.shared.fd}",
        root_sealed="root-S",
        root_lease=lease.lease_id,
        root_partial="root-P",
    )
    assert out["open victim rw"][0] == out["open victim ro"][0] == "EACCES", out
    assert out["open root memfd"][0] == "EACCES", out
    status, message = out["register O_PATH of victim"]
    assert status == "INVALID_ARGUMENT" and "layers[0].memory.shm" in message, out
    assert out["ShmHandle fields"] == ["fd", "offset", "size"]  # no path: the engine is never handed one
    assert out["old frame carries the path"]
    status, message = out["old path-style"]
    assert status == "INVALID_ARGUMENT" and "layers[0].memory.shm.fd 0" in message and "0 file desc" in message, out
    status, message = out["fd index past"]
    assert status == "INVALID_ARGUMENT" and "layers[0].memory.shm.fd 3" in message and "1 file desc" in message, out
    assert out["own register"] == ["OK", True]
    assert out["own save"] == ["OK", BLOCKS] and out["own query"] == ["OK", BLOCKS]
    for attempt in (
        "query root",
        "release root lease",
        "unregister root worker",
        "save root worker",
        "load root worker",
        "join root instance",
        "take root worker key",
    ):
        assert out[attempt][0] == "PERMISSION_DENIED", (attempt, out[attempt])
    assert out["own still registered"] == ["OK", BLOCKS]

    # root's instances are as they were: the lease is still open, the worker serves, nobody joined root-P
    assert engine.metric("kvseal_leases") == 1
    r = sealed.load(ROOT_HASHES, list(range(BLOCKS)), lease.lease_id)
    assert (r.outcome, r.loaded) == (LOADED, BLOCKS)
    assert sealed.save(hashes("poison")).written == BLOCKS  # had nobody's Save gone through, these were skipped
    view = {i["instance_id"]: i for i in engine.get_json("/v1/instances")}
    assert (view["root-P"]["registered"], view["root-P"]["sealed"]) == (1, False)
    wait_until(
        lambda: "nobody-A" not in {i["instance_id"] for i in engine.get_json("/v1/instances")},
        WAIT_S,
        "nobody's session to end with its process",
    )
    assert engine.alive()


def attack_shared_namespace(target: str, root_hashes: list[str], plant_hashes: list[str]) -> dict[str, Any]:
    with EngineClient(target, timeout=30) as client:
        spy = Tenant(client, "nobody-N", seed=99)
        out: dict[str, Any] = {"namespace_final": spy.status.namespace_final}
        probe = [bytes.fromhex(h) for h in root_hashes]
        out["query root's hashes"] = outcome(lambda: spy.query(probe).hits)
        out["load root's hashes"] = outcome(lambda: spy.load(probe, list(range(len(probe)))).loaded)
        out["plant"] = outcome(lambda: spy.save([bytes.fromhex(h) for h in plant_hashes]).completed)
        out["planted"] = [digest(spy.block(i)) for i in range(len(plant_hashes))]
        spy.shared.close()
        return out


@needs_root
def test_users_do_not_share_blocks(
    engine_factory: Callable[..., EngineProcess], tenants: Callable[..., Tenant]
) -> None:
    """Two users' instances of the same model and layout must not read or plant each other's blocks: a block
    hash is computable from the tokens, so a shared namespace would let another user test whether root's
    tenants saw a prompt and read its KV (which encodes it), or plant KV that root's instances then load."""
    engine = engine_factory("--lane-group", nogroup())
    owner = tenants(engine, "root-S")
    assert owner.save(ROOT_HASHES).completed == BLOCKS
    plant = hashes("plant")
    out = as_nobody(
        "shared_namespace",
        target=engine.target,
        root_hashes=[h.hex() for h in ROOT_HASHES],
        plant_hashes=[h.hex() for h in plant],
    )
    assert out["plant"][0] == "OK", out
    reader = tenants(engine, "root-R", seed=5)
    q = reader.query(plant)
    loaded = []
    if q.hits:
        reader.load(plant[: q.hits], list(range(q.hits)), q.lease_id)
        loaded = [digest(reader.block(i)) for i in range(q.hits)]
    assert not set(loaded) & set(out["planted"]), "root's instance loaded KV that another user saved"
    assert out["query root's hashes"] == ["OK", 0], f"another user found root's blocks: {out}"
    assert out["load root's hashes"][1] != BLOCKS, f"another user loaded root's blocks: {out}"
    assert out["namespace_final"] == owner.status.namespace_final  # same model and layout: only the user differs
    tenants_of = {(n["namespace"], n["uid"]): n["resident_blocks"] for n in engine.get_json("/v1/namespaces")}
    assert tenants_of == {(owner.status.namespace_final, 0): BLOCKS, (owner.status.namespace_final, 65534): BLOCKS}


def attack_tokenless_tcp(target: str, http: str, root_sealed: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.EngineStub(channel)
        out["Info"] = outcome(lambda: bool(stub.Info(pb.InfoRequest(), timeout=30).lane_socket))
        query = pb.QueryRequest(instance_id=root_sealed, block_hashes=ROOT_HASHES)
        out["Query root"] = outcome(lambda: stub.Query(query, timeout=30).hits)
        out["Release root"] = outcome(lambda: stub.Release(pb.ReleaseRequest(instance_id=root_sealed, lease_id=1), 30))
        out["Query unknown"] = outcome(lambda: stub.Query(pb.QueryRequest(instance_id="x", block_hashes=[b"h"]), 30))
    for path in ("/v1/instances", "/v1/namespaces", "/health"):
        out[f"GET {path}"] = http_get(http + path)[0]
    return out


@needs_root
def test_another_user_over_tokenless_tcp_grpc_is_refused(
    engine_factory: Callable[..., EngineProcess], tenants: Callable[..., Tenant]
) -> None:
    """Tokenless loopback gRPC serves only the engine's uid and root (the peer's uid from the kernel's socket
    table, kvseal.auth). Info is open: it names the lane, where the kernel names every peer."""
    engine = engine_factory()
    sealed = tenants(engine, "root-S")
    sealed.save(ROOT_HASHES)
    out = as_nobody("tokenless_tcp", target=engine.target, http=engine.http, root_sealed="root-S")
    assert out["Info"] == ["OK", True], out
    for call_name in ("Query root", "Release root", "Query unknown"):
        assert out[call_name][0] == "PERMISSION_DENIED", (call_name, out)
    assert engine.metric("kvseal_leases") == 0  # no lease was granted to nobody


@needs_root
def test_clients_hand_memory_only_to_an_engine_run_by_a_user_they_trust(
    engine_factory: Callable[..., EngineProcess],
) -> None:
    """Anyone may take the engine's port and lane path while it is down. Here an engine run by uid 65534 stands for
    that impostor: a root client refuses to register with it (no descriptor is sent), unless told it is the
    engine's user."""
    impostor = engine_factory(wrapper=("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"))
    with impostor.client(timeout=30) as client:
        with pytest.raises(PermissionDenied, match="served by uid 65534"):
            Tenant(client, "root-T", seed=1)
    assert impostor.get_json("/v1/instances") == []
    with impostor.client(timeout=30, engine_uid=65534) as client:
        assert Tenant(client, "root-T", seed=1).status.sealed


@needs_root
def test_another_user_cannot_read_http_v1_without_a_token(
    engine_factory: Callable[..., EngineProcess], tenants: Callable[..., Tenant]
) -> None:
    """HTTP /v1/* follows gRPC's rule (issue 7, item 1): without a token, only the engine's uid and root; /health
    stays open."""
    engine = engine_factory()
    tenants(engine, "root-S").save(ROOT_HASHES)
    out = as_nobody("tokenless_tcp", target=engine.target, http=engine.http, root_sealed="root-S")
    assert out["GET /health"] == 200
    assert out["GET /v1/instances"] in (401, 403), out
    assert out["GET /v1/namespaces"] in (401, 403), out


def attack_default_lane(target: str) -> dict[str, Any]:
    with EngineClient(target, timeout=30) as client:
        path = client.info().lane_socket
        return {
            "connect": outcome(lambda: connect(path).close()),
            "register": outcome(lambda: Tenant(client, "n", seed=1)),
        }


@needs_root
def test_default_lane_socket_is_for_the_engines_user_only(engine_factory: Callable[..., EngineProcess]) -> None:
    engine = engine_factory()
    out = as_nobody("default_lane", target=engine.target)
    assert out["connect"][0] == "EACCES", out
    status, message = out["register"]
    assert status == "UNAVAILABLE" and "Permission denied" in message, out


# -------------------------------------------------------------------- 2. a symlink swapped during Register


def attack_symlink_race(target: str, victim_path: str, attempts: int, seed: int) -> dict[str, Any]:
    """Swaps a symlink in its own /dev/shm folder between its own memfd (through /proc), its own plain file and
    the victim's file, in another process, while it opens the link and registers what it got, `attempts` times.
    The registration names no path: the most it can hand over is a descriptor the kernel gave *it*."""
    folder = tempfile.mkdtemp(prefix="kvseal-race-", dir="/dev/shm")
    own = SharedArray((BLOCKS, SLOT))
    own.array[:] = pattern(seed)
    own_memfd = f"/proc/{os.getpid()}/fd/{own.fd}"
    own_file = os.path.join(folder, "own.bin")
    with open(own_file, "wb") as f:
        f.write(pattern(seed).tobytes())
    targets = [own_memfd, own_file, victim_path]
    kind = {os.stat(own_memfd).st_ino: "own-memfd", os.stat(own_file).st_ino: "own-file"}
    kind[os.stat(victim_path).st_ino] = "victim"
    link = os.path.join(folder, "kv")
    os.symlink(own_memfd, link)
    swapper = os.fork()  # before any gRPC channel exists
    if swapper == 0:
        try:
            i = 0
            while True:
                i += 1
                os.symlink(targets[i % 3], link + ".new")
                os.replace(link + ".new", link)
        finally:
            os._exit(0)
    records, saved = [], []
    try:
        reader = Tenant(EngineClient(target, timeout=30), "race-reader", seed=seed + 1)
        client = EngineClient(target, timeout=30)
        for attempt in range(attempts):
            try:
                fd, how = os.open(link, os.O_RDWR | os.O_CLOEXEC), "rdwr"
            except PermissionError:  # the victim's: all this user can get of it is a descriptor that names it
                fd, how = os.open(link, os.O_PATH | os.O_CLOEXEC), "o_path"
            try:
                what = kind.get(os.fstat(fd).st_ino, "other")
                status, message = outcome(
                    lambda fd=fd: client.register(**registration("race", [layer_spec(fd)])).sealed
                )
            finally:
                os.close(fd)
            if status == "OK":
                block_hashes = hashes(f"race-{attempt}")
                client.save(("race", 0, 0), block_hashes, list(range(BLOCKS)))
                client.unregister(("race", 0, 0))
                saved.append(block_hashes)
            records.append([what, how, status, "" if status == "OK" else message])
    finally:
        os.kill(swapper, signal.SIGKILL)
        os.waitpid(swapper, 0)
    loaded = []  # what the engine stored from each successful registration, read back by another instance
    for block_hashes in saved:
        q = reader.query(block_hashes)
        r = reader.load(block_hashes[: q.hits], list(range(q.hits)), q.lease_id)
        loaded.append([digest(reader.block(i)) for i in range(r.loaded)])
    reader.close()
    client.close()
    for name in os.listdir(folder):
        os.unlink(os.path.join(folder, name))
    os.rmdir(folder)
    return {"records": records, "loaded": loaded}


@needs_root
def test_symlink_swapped_during_register_never_maps_a_foreign_file(
    engine_factory: Callable[..., EngineProcess], victim: tuple[str, bytes]
) -> None:
    engine = engine_factory("--lane-group", nogroup())
    victim_path, secret = victim
    seed, attempts = 11, 200
    out = as_nobody("symlink_race", target=engine.target, victim_path=victim_path, attempts=attempts, seed=seed)
    records, loaded = out["records"], out["loaded"]
    assert len(records) == attempts
    seen: dict[tuple[str, str, str], int] = {}
    for what, how, status, message in records:
        seen[what, how, status] = seen.get((what, how, status), 0) + 1
        assert status in ("OK", "INVALID_ARGUMENT"), (what, how, status, message)
        if status == "OK":
            assert (what, how) == ("own-memfd", "rdwr"), (what, how)
        else:
            assert "layers[0].memory.shm" in message
    assert not any(what == "victim" and how == "rdwr" for what, how, _, _ in records)  # the kernel said no
    assert any(what == "victim" for what, _, _, _ in records), f"the race never showed the victim's file: {seen}"
    assert seen.get(("own-memfd", "rdwr", "OK"), 0) >= 1, seen

    own = [digest(pattern(seed)[i].tobytes()) for i in range(BLOCKS)]
    secret_blocks = {digest(secret[i * SLOT : (i + 1) * SLOT]) for i in range(BLOCKS)}
    assert len(loaded) == seen[("own-memfd", "rdwr", "OK")]
    for blocks in loaded:
        assert blocks == own  # every stored byte came from the attacker's own memfd
        assert not set(blocks) & secret_blocks
    assert engine.alive()


# -------------------------------------------------------------------- 3. another connection vs a worker's key

KV_BLOCK_BYTES = int(np.prod(KV_SHAPE[1:])) * 2  # float16


def kv_tenant(engine: EngineProcess, seed: int) -> tuple[EngineClient, SharedArray, pb.LayerSpec]:
    """Memory and a layer spec in the layout of a tests/workers.py Worker's attn_layers(1) (float16 KV_SHAPE)."""
    shared = SharedArray((KV_SHAPE[0], KV_BLOCK_BYTES))
    shared.array[:] = pattern(seed, KV_SHAPE[0], KV_BLOCK_BYTES)
    layer = layer_from_array(
        attn_layers(1)[0].name, shared.array, shared, layout_tag=attn_layers(1)[0].layout_tag, dtype="float16"
    )
    return engine.client(), shared, layer


def test_another_connection_cannot_use_or_take_over_a_workers_key(engine: EngineProcess) -> None:
    worker = Worker.start(engine.target, name="victim-worker")
    foreign_client, foreign_memory, foreign_layer = kv_tenant(engine, seed=3)
    third_client, third_memory, third_layer = kv_tenant(engine, seed=4)
    try:
        status = worker.register(
            instance_id="A", namespace=NAMESPACE, tp_rank=0, tp_size=1, world_size=1, layers=attn_layers(1), seed=1
        )
        assert status.sealed
        saved_hashes, ids = hashes("victim"), [3, 7, 0, 12, 31, 5, 9, 20]
        assert worker.save(saved_hashes, ids).completed == BLOCKS
        key = ("A", 0, 0)

        with pytest.raises(PermissionDenied, match="belongs to another session"):
            foreign_client.unregister(key)
        with pytest.raises(PermissionDenied, match="belongs to another session"):
            foreign_client.save(key, hashes("poison"), list(range(BLOCKS)))
        with pytest.raises(PermissionDenied, match="belongs to another session"):
            foreign_client.load(key, saved_hashes, list(range(BLOCKS)))
        with pytest.raises(PermissionDenied, match="held by another session"):
            foreign_client.register(**registration("A", [foreign_layer]))
        assert foreign_client.query("A", hashes("poison")).hits == 0  # nothing of the foreign client was stored
        (view,) = engine.get_json("/v1/instances")
        assert (view["instance_id"], view["registered"], view["sealed"]) == ("A", 1, True)
        assert worker.session_alive()

        # the victim's next save stores its own bytes, and a third instance loads all of them byte-exact
        more_hashes, more_ids = hashes("victim-more", 4), [1, 2, 4, 6]
        assert worker.save(more_hashes, more_ids).completed == 4
        third = third_client.register(**registration("C", [third_layer]))
        assert third.namespace_final == status.namespace_final
        everything = saved_hashes + more_hashes
        q = third_client.query("C", everything)
        assert q.hits == len(everything)
        r = third_client.load(("C", 0, 0), everything, list(range(len(everything))), lease_id=q.lease_id)
        assert (r.outcome, r.loaded) == (LOADED, len(everything))
        expected = worker.read(ids + more_ids)[attn_layers(1)[0].name]
        assert [third_memory.array[i].tobytes() for i in range(len(everything))] == expected
    finally:
        for client in (foreign_client, third_client):
            client.close()
        foreign_memory.close()
        third_memory.close()
        worker.close()


# -------------------------------------------------------------------- 4. memory that would shrink under the engine

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def test_a_registered_memfd_cannot_shrink_and_unsealed_memory_is_refused(
    engine: EngineProcess, tenants: Callable[..., Tenant]
) -> None:
    breaker = tenants(engine, "breaker")
    other = tenants(engine, "other")
    assert breaker.save(hashes("before")).completed == BLOCKS
    for size in (0, SLOT, BLOCKS * SLOT + SLOT):  # shrink to nothing, shrink, grow: all sealed
        with pytest.raises(PermissionError):
            os.ftruncate(breaker.shared.fd, size)
    assert os.fstat(breaker.shared.fd).st_size == BLOCKS * SLOT
    # punching holes is what the seals allow: the pages read as zeros afterwards, no SIGBUS for the engine
    assert _libc.fallocate(breaker.shared.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 2 * SLOT) == 0
    punched = hashes("punched", 2)
    assert breaker.save(punched, [0, 1]).completed == 2

    q = other.query(hashes("before") + punched)
    assert q.hits == BLOCKS + 2
    other.client.release("other", q.lease_id)
    q = other.query(hashes("before"))
    r = other.load(hashes("before"), list(range(BLOCKS)), q.lease_id)
    assert (r.outcome, r.loaded) == (LOADED, BLOCKS)
    assert [other.block(i) for i in range(BLOCKS)] == [pattern(1)[i].tobytes() for i in range(BLOCKS)]
    q = other.query(punched)
    assert other.load(punched, [0, 1], q.lease_id).loaded == 2
    assert other.block(0) == other.block(1) == bytes(SLOT)
    assert other.save(hashes("after")).completed == BLOCKS
    assert engine.alive()

    unsealed = new_memfd(BLOCKS * SLOT)
    grow_sealed_only = new_memfd(BLOCKS * SLOT)
    fcntl.fcntl(grow_sealed_only, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    try:
        with engine.client() as client:
            for fd in (unsealed, grow_sealed_only):
                with pytest.raises(InvalidArgument, match=r"layers\[0\]\.memory\.shm: .*sealed with F_SEAL_SHRINK"):
                    client.register(**registration("unsealed", [layer_spec(fd)]))
    finally:
        os.close(unsealed)
        os.close(grow_sealed_only)
    assert "unsealed" not in {i["instance_id"] for i in engine.get_json("/v1/instances")}


# -------------------------------------------------------------------- 4b. sparse memory: mapped as far as layers go

SPARSE_BYTES = 1 << 30
MAPPED_CAP = "8MiB"


def sparse_layer(fd: int, offset: int, blocks: int, stride: int) -> pb.LayerSpec:
    """A layer of `blocks` SLOT-byte blocks `stride` apart from `offset` in a SPARSE_BYTES memfd."""
    spec = layer_spec(fd, blocks)
    spec.strides[:] = [stride]
    spec.memory.shm.CopyFrom(pb.ShmHandle(fd=fd, offset=offset, size=SPARSE_BYTES))
    return spec


def attack_sparse_memfd(target: str, engine_pid: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    fd = new_memfd(SPARSE_BYTES)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    offset = (512 << 20) + 100  # four blocks half way in, not page-aligned: the only bytes this user wrote
    data = pattern(11, 4).tobytes()
    os.pwrite(fd, data, offset)
    client = EngineClient(target, timeout=30)
    before = rss_bytes(engine_pid)
    small = sparse_layer(fd, offset, 4, SLOT)
    out["small"] = outcome(lambda: client.register(**registration("sparse-A", [small])).sealed)
    out["small growth"] = rss_bytes(engine_pid) - before
    # the blocks go through the mapped window byte-exact, both ways
    tags = hashes("sparse", 4)
    out["save"] = outcome(lambda: client.save(("sparse-A", 0, 0), tags, [0, 1, 2, 3]).completed)
    os.pwrite(fd, bytes(len(data)), offset)
    lease = client.query("sparse-A", tags).lease_id
    out["load"] = outcome(lambda: client.load(("sparse-A", 0, 0), tags, [0, 1, 2, 3], lease_id=lease).loaded)
    out["round trip"] = os.pread(fd, len(data), offset) == data
    # 6 MiB (two blocks 6 MiB - 4 KiB apart), twice: the second is over the 8 MiB cap until the first goes
    six = sparse_layer(fd, 0, 2, (6 << 20) - SLOT)
    out["6 MiB"] = outcome(lambda: client.register(**registration("sparse-B", [six])).sealed)
    out["6 MiB more"] = outcome(lambda: client.register(**registration("sparse-C", [six])).sealed)
    out["unregister"] = outcome(lambda: client.unregister(("sparse-B", 0, 0)))
    out["6 MiB again"] = outcome(lambda: client.register(**registration("sparse-C", [six])).sealed)
    # one layer spanning half the file: refused before anything is mapped
    before = rss_bytes(engine_pid)
    out["512 MiB"] = outcome(
        lambda: client.register(**registration("sparse-D", [sparse_layer(fd, 0, 2, 512 << 20)])).sealed
    )
    out["512 MiB growth"] = rss_bytes(engine_pid) - before
    client.close()
    os.close(fd)
    return out


@needs_root
def test_a_sparse_memfd_costs_the_engine_only_what_layers_cover_and_a_uid_has_a_cap(
    engine_factory: Callable[..., EngineProcess], tenants: Callable[..., Tenant]
) -> None:
    """Issue 19 item 11: a 16 KiB layer in a 1 GiB sparse memfd once grew the engine's RSS by 1 GiB (it mapped
    and faulted in the whole file). Now it maps the layers' extents, and a uid's mappings are capped."""
    engine = engine_factory("--lane-group", nogroup(), "--max-mapped-per-uid", MAPPED_CAP)
    out = as_nobody("sparse_memfd", target=engine.target, engine_pid=engine.pid)
    assert out["small"] == ["OK", True], out
    assert out["small growth"] < 64 << 20, out  # 1 GiB before the fix
    assert out["save"] == ["OK", 4] and out["load"] == ["OK", 4] and out["round trip"], out
    assert out["6 MiB"] == ["OK", True], out
    status, message = out["6 MiB more"]
    assert status == "RESOURCE_EXHAUSTED", out
    assert "--max-mapped-per-uid" in message and "8.0 MiB" in message and f"uid {NOBODY}" in message, message
    assert out["unregister"] == ["OK", 0] and out["6 MiB again"] == ["OK", True], out
    assert out["512 MiB"][0] == "RESOURCE_EXHAUSTED" and out["512 MiB growth"] < 16 << 20, out
    # root (and the engine's own user) is not capped
    big = tenants(engine, "root-big", blocks=4, slot=4 << 20)
    assert big.status.sealed
    assert engine.alive()


# -------------------------------------------------------------------- 5. 1024 sessions at once

SESSIONS = 1024


@pytest.fixture
def many_fds() -> Iterator[None]:
    """Room for SESSIONS lane connections and their memfds in this process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 3 * SESSIONS + 512
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(hard, want)))
        except (ValueError, OSError) as e:
            pytest.fail(f"cannot raise RLIMIT_NOFILE to {want} (soft {soft}, hard {hard}): {e}")
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_1024_concurrent_sessions_while_register_and_query_answer(
    many_fds: None, engine: EngineProcess, tenants: Callable[..., Tenant]
) -> None:
    path = lane_path(engine)
    socks: list[socket.socket] = []
    try:
        memories = [SharedArray((1, SLOT)) for _ in range(SESSIONS)]
        for i, memory in enumerate(memories):  # every session sends its Register before any answer is read
            sock = connect(path, timeout=60)
            socks.append(sock)
            frame = register_frame(f"s{i}", [layer_spec(0, blocks=1)], namespace="sessions")
            assert socket.send_fds(sock, [frame], [memory.fd]) == len(frame)
        for sock, memory in zip(socks, memories, strict=True):
            reply = call_reply(sock)
            assert reply is not None and reply[0] == "OK", reply
            assert pb.InstanceStatus.FromString(reply[1]).sealed
            memory.close()  # the engine holds its own mapping
        fresh = tenants(engine, "fresh", timeout=30)
        assert fresh.status.sealed
        assert fresh.save(hashes("fresh")).completed == BLOCKS
        assert fresh.query(hashes("fresh")).hits == BLOCKS
        assert engine.metric("kvseal_workers") == SESSIONS + 1
        assert engine.metric("kvseal_instances") == SESSIONS + 1
    finally:
        for sock in socks:
            sock.close()
    wait_until(lambda: engine.metric("kvseal_workers") == 1, WAIT_S, "the engine to drop 1024 closed sessions")
    assert engine.metric("kvseal_instances") == 1
    assert fresh.query(hashes("fresh")).hits == BLOCKS


def call_reply(sock: socket.socket) -> tuple[str, bytes] | None:
    reply = ln.read_frame(sock)
    return None if reply is None else (ln.STATUS_NAMES.get(reply[0], str(reply[0])), reply[1])


# -------------------------------------------------------------------- 6. out of descriptors

FD_LIMIT = 256


def fd_limit(n: int) -> list[str]:
    """A wrapper command that sets RLIMIT_NOFILE (soft and hard: the engine raises its soft limit to the hard one)
    and execs the rest of its command line."""
    code = "import os, resource, sys; n = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); "
    code += "os.execv(sys.argv[2], sys.argv[2:])"
    return [sys.executable, "-c", code, str(n)]


def test_300_idle_connections_at_a_low_fd_limit_then_a_normal_client_succeeds(
    engine_factory: Callable[..., EngineProcess], tenants: Callable[..., Tenant]
) -> None:
    engine = engine_factory(wrapper=fd_limit(FD_LIMIT))
    limits = Path(f"/proc/{engine.pid}/limits").read_text()
    assert any(
        line.startswith("Max open files") and line.split()[3:5] == [str(FD_LIMIT)] * 2 for line in limits.splitlines()
    )
    path = lane_path(engine)
    idle = [connect(path) for _ in range(300)]
    try:
        wait_until(
            lambda: any("descriptors" in line for line in error_lines(engine)), WAIT_S, "the engine to run out of fds"
        )
        normal = tenants(engine, "normal", timeout=15)
        assert normal.status.sealed
        assert normal.save(hashes("normal")).completed == BLOCKS
        q = normal.query(hashes("normal"))
        assert q.hits == BLOCKS
        assert normal.load(hashes("normal"), list(range(BLOCKS)), q.lease_id).loaded == BLOCKS
        closed = sum(closed_now(s) for s in idle)
        assert closed > 0  # idle connections that hold no registration made room
    finally:
        for sock in idle:
            sock.close()
    errors = error_lines(engine)
    assert len(errors) == 1 and "descriptors" in errors[0], errors
    assert engine.alive()


# -------------------------------------------------------------------- 7. headers that announce more than they send


def test_a_header_announcing_a_large_body_allocates_nothing_and_an_oversized_one_is_refused(
    engine: EngineProcess, tenants: Callable[..., Tenant]
) -> None:
    owner = tenants(engine, "A")
    owner.save(hashes("a"))
    path = lane_path(engine)
    limit = ln.FRAME_LIMITS[ln.OP_SAVE]

    def headers(n: int, announced: int) -> list[socket.socket]:
        socks = [connect(path) for _ in range(n)]
        for sock in socks:
            sock.sendall(struct.pack("<IB", announced, ln.OP_SAVE))
        wait_until(lambda: all(unread_bytes(s) == 0 for s in socks), WAIT_S, f"the engine to read {n} headers")
        return socks

    for sock in headers(32, 100):  # the same, announcing little: what the lane threads' first wake-ups cost
        sock.close()
    before = rss_bytes(engine.pid)
    pending = headers(8, limit)
    try:
        assert owner.query(hashes("a")).hits == BLOCKS  # the engine answers meanwhile
        grown = rss_bytes(engine.pid) - before
        # 8 bodies allocated up front would be 8 x limit; a lane thread's receive buffer (1 MiB, once per thread,
        # at most 16) is the only cost a header may add
        assert grown < 2 * limit, f"RSS grew {grown} bytes after 8 headers announcing {limit} bytes each"
        assert not any(closed_now(s) for s in pending)  # a body at the limit is still awaited

        # a header is enough for the engine to read a body incrementally: the rest arrives later, is answered
        with connect(path) as sock:
            frame = ln.encode_query("A", hashes("a"))
            sock.sendall(frame[:5])
            wait_until(lambda: unread_bytes(sock) == 0, WAIT_S, "the engine to read the header")
            sock.sendall(frame[5:])
            reply = call_reply(sock)
            assert reply is not None and reply[0] == "OK"
            assert ln.decode_query_ok(reply[1])[0] == BLOCKS
    finally:
        for sock in pending:
            sock.close()

    for op, announced in ((ln.OP_SAVE, 64 << 20), (ln.OP_REGISTER, ln.FRAME_LIMITS[ln.OP_REGISTER] + 1)):
        for announced_op in (op, ln.OP_HELLO):
            with connect(path) as sock:
                size = announced if announced_op == op else ln.FRAME_LIMITS[ln.OP_HELLO] + 1
                reply = call(sock, struct.pack("<IB", size, announced_op))
                assert reply is not None and reply[0] == "INVALID_ARGUMENT", reply
                assert f"frame of {size} bytes exceeds its" in reply[1].decode()
                assert hung_up(sock)
    assert owner.query(hashes("a")).hits == BLOCKS
    assert engine.alive()


def test_descriptors_sent_beyond_one_frames_limit_are_refused(engine: EngineProcess) -> None:
    """A frame carries at most MAX_FDS descriptors: a client that keeps sending descriptors with the pieces of one
    frame must not make the engine hold them all (its descriptor table is every tenant's)."""
    path = lane_path(engine)
    baseline = open_fds(engine.pid)
    memory = SharedArray((SLOT,))
    with connect(path) as sock:
        sock.sendall(struct.pack("<IB", 1000, ln.OP_REGISTER))  # a body the engine waits for
        refused = False
        for _ in range(10):
            try:
                socket.send_fds(sock, [b"\x00"], [memory.fd] * 200)
            except (BrokenPipeError, ConnectionResetError):
                refused = True
                break
        if not refused:
            wait_until(lambda: unread_bytes(sock) == 0 or closed_now(sock), WAIT_S, "the engine to read them")
        held = open_fds(engine.pid) - baseline
        assert held <= ln.MAX_FDS + 8, f"the engine holds {held} descriptors of one unfinished frame"
    memory.close()
    wait_until(lambda: open_fds(engine.pid) <= baseline, WAIT_S, "the engine to close what it received")


# -------------------------------------------------------------------- 8. a stopped engine


def test_every_call_returns_within_its_deadline_while_the_engine_is_stopped(
    engine: EngineProcess, tenants: Callable[..., Tenant]
) -> None:
    timeout = 2.0
    saver = tenants(engine, "A", timeout=timeout)
    assert saver.save(hashes("a")).completed == BLOCKS
    loader = tenants(engine, "B", timeout=timeout)
    leaver = tenants(engine, "C", timeout=timeout)
    querier, releaser, registrar, grpc_user = (engine.client(timeout=timeout) for _ in range(4))
    fresh = engine.client(timeout=timeout)  # no lane yet: its first lane call asks Info (gRPC) first
    lease = releaser.query("A", hashes("a"))
    load_lease = loader.query(hashes("a"))
    with pytest.raises(KvsealError):  # opens the lane (an answer that is an error keeps it open)
        querier.query("missing", hashes("a"))
    with pytest.raises(KvsealError):
        registrar.query("missing", hashes("a"))
    assert grpc_user.info().lane_socket
    spare = SharedArray((BLOCKS, SLOT))
    calls: dict[str, Callable[[], Any]] = {
        "lane Register": lambda: registrar.register(**registration("R", [layer_spec(spare.fd)])),
        "lane Save": lambda: saver.save(hashes("a-more")),
        "lane Load": lambda: loader.load(hashes("a"), list(range(BLOCKS)), load_lease.lease_id),
        "lane Query": lambda: querier.query("A", hashes("a")),
        "lane Release": lambda: releaser.release("A", lease.lease_id),
        "lane Unregister": lambda: leaver.client.unregister(leaver.key),
        "gRPC Info": lambda: grpc_user.info(),
        "gRPC Query": lambda: grpc_user.query("A", [b"x" * 32, b"y" * 16]),  # unequal lengths: not lane-framable
        "fresh Register": lambda: fresh.register(**registration("F", [layer_spec(spare.fd)])),
    }
    results: dict[str, tuple[str, float]] = {}

    def timed(name: str, fn: Callable[[], Any]) -> None:
        start = time.monotonic()
        try:
            fn()
            results[name] = ("returned", time.monotonic() - start)
        except KvsealError as e:
            results[name] = (type(e).__name__, time.monotonic() - start)

    os.kill(engine.pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(len(calls)) as pool:
            futures = [pool.submit(timed, name, fn) for name, fn in calls.items()]
            _, hanging = wait_futures(futures, timeout=timeout + 20)
            assert not hanging, f"calls still blocked: {set(calls) - set(results)}"
    finally:
        os.kill(engine.pid, signal.SIGCONT)
    for name, (what, elapsed) in results.items():
        assert what in (DeadlineExceeded.__name__, Unavailable.__name__), (name, what, elapsed)
        assert elapsed < timeout + 3.0, (name, what, elapsed)
    assert len(results) == len(calls)

    # serving again; each worker whose call timed out lost its session with its connection, and registers again
    assert not saver.client.session_alive() and not loader.client.session_alive()
    wait_until(lambda: engine.metric("kvseal_workers") == 0, WAIT_S, "the engine to drop the timed-out sessions")
    assert saver.register().sealed
    assert saver.client.session_alive()
    assert saver.query(hashes("a")).hits == BLOCKS  # the blocks outlived the sessions
    assert saver.save(hashes("a-again")).completed == BLOCKS
    assert grpc_user.info().lane_socket
    spare.close()
    for client in (querier, releaser, registrar, grpc_user, fresh):
        client.close()


# -------------------------------------------------------------------- 9. --token on the lane and HTTP

TOKEN = "s3cret"


def test_with_a_token_the_lane_needs_hello_first_and_http_needs_the_token(
    engine_factory: Callable[..., EngineProcess],
) -> None:
    engine = engine_factory("--token", TOKEN)
    path = lane_path(engine)
    memory = SharedArray((BLOCKS, SLOT))
    try:
        frames = {
            "Query": (ln.encode_query("A", hashes("a")), ()),
            "Save": (ln.encode_save(("A", 0, 0), hashes("a"), list(range(BLOCKS))), ()),
            "Load": (ln.encode_load(("A", 0, 0), hashes("a"), list(range(BLOCKS))), ()),
            "Release": (ln.encode_release("A", 1), ()),
            "Unregister": (ln.encode_unregister(("A", 0, 0)), ()),
            "Ping": (ln.encode_ping(b"x" * 64), ()),
            "Register": (register_frame("A", [layer_spec(0)]), (memory.fd,)),
        }
        for name, (frame, fds) in frames.items():  # no HELLO first
            with connect(path) as sock:
                reply = call(sock, frame, fds)
                assert reply is not None and reply[0] == "UNAUTHENTICATED", (name, reply)
                assert b"HELLO" in reply[1]
                assert hung_up(sock), name
        for wrong in ("wrong", "", TOKEN + "x", TOKEN[:-1]):
            with connect(path) as sock:
                reply = call(sock, ln.encode_hello(wrong))
                assert reply is not None and reply[0] == "UNAUTHENTICATED", (wrong, reply)
                assert hung_up(sock), wrong
        # a wrong HELLO followed at once by a request: the request is never answered
        with connect(path) as sock:
            sock.sendall(ln.encode_hello("wrong") + ln.encode_query("A", hashes("a")))
            reply = call_reply(sock)
            assert reply is not None and reply[0] == "UNAUTHENTICATED"
            assert hung_up(sock)
        assert engine.get_json("/v1/instances") == []

        with connect(path) as sock:
            assert call(sock, ln.encode_hello(TOKEN)) == ("OK", b"")
            assert call(sock, ln.encode_ping(b"x" * 64)) == ("OK", b"")
            reply = call(sock, ln.encode_query("A", hashes("a")))
            assert reply is not None and reply[0] == "NOT_FOUND"  # past the token: the engine answers
            reply = call(sock, register_frame("A", [layer_spec(0)]), [memory.fd])
            assert reply is not None and reply[0] == "OK" and pb.InstanceStatus.FromString(reply[1]).sealed
            reply = call(sock, ln.encode_save(("A", 0, 0), hashes("a"), list(range(BLOCKS))))
            assert reply is not None and reply[0] == "OK" and ln.decode_save_ok(reply[1])[3] == BLOCKS
    finally:
        memory.close()

    for path_ in ("/v1/namespaces", "/v1/instances"):
        assert engine.get(path_, token="")[0] == 401
        assert engine.get(path_, token="wrong")[0] == 401
    assert engine.get("/v1/namespaces")[0] == 200
    assert engine.get("/health", token="")[0] == 200


# -------------------------------------------------------------------- 10. --lease-ttl is a maximum


def test_lease_ttl_caps_what_a_client_asks_for(
    engine_factory: Callable[..., EngineProcess], tenants: Callable[..., Tenant]
) -> None:
    engine = engine_factory("--lease-ttl", "2")
    owner = tenants(engine, "A")
    owner.save(hashes("a"))
    asked_granted = {3_600_000: 2000, 0: 2000, 500: 500}
    for asked, granted in asked_granted.items():
        q = owner.query(hashes("a"), lease_ttl_ms=asked)
        assert (q.hits, q.lease_ttl_ms) == (BLOCKS, granted), asked
    with grpc.insecure_channel(engine.target) as channel:
        q = pb_grpc.EngineStub(channel).Query(
            pb.QueryRequest(instance_id="A", block_hashes=hashes("a"), lease_ttl_ms=3_600_000), timeout=30
        )
        assert (q.hits, q.lease_ttl_ms) == (BLOCKS, 2000)
    assert engine.metric("kvseal_leases") == 4
    # and it is what the engine does: the hour-long lease is gone after two seconds (plus a tick)
    wait_until(lambda: engine.metric("kvseal_leases") == 0, 10.0, "the capped leases to expire")
    assert engine.metric("kvseal_pool_used_bytes", state="pinned") == 0


# -------------------------------------------------------------------- lane limits: idle timeout and connection cap


def test_idle_connections_without_a_registration_are_closed(
    engine_factory: Callable[..., EngineProcess], tenants: Callable[..., Tenant]
) -> None:
    engine = engine_factory("--lane-idle-timeout", "1")
    owner = tenants(engine, "A")  # holds a registration: never idle-closed
    path = lane_path(engine)
    silent = connect(path)
    half_frame = connect(path)
    half_frame.sendall(ln.encode_query("A", hashes("a"))[:9])  # a slow client that stops mid-frame
    try:
        wait_until(lambda: closed_now(silent) and closed_now(half_frame), WAIT_S, "idle connections to be closed")
    finally:
        silent.close()
        half_frame.close()
    assert owner.client.session_alive()
    assert owner.save(hashes("a")).completed == BLOCKS


def test_connection_cap_evicts_idle_connections_and_refuses_beyond_registered_ones(
    engine_factory: Callable[..., EngineProcess], tenants: Callable[..., Tenant]
) -> None:
    engine = engine_factory("--lane-max-connections", "3")
    first = tenants(engine, "A")
    path = lane_path(engine)
    idle = connect(path)
    second = tenants(engine, "B")  # three connections: at the cap, nobody waiting
    try:
        evicted_at_the_cap = closed_now(idle)
        third = tenants(engine, "C")  # the fourth: the idle connection makes room for it
        wait_until(lambda: closed_now(idle), WAIT_S, "the idle connection to make room for C")
    finally:
        idle.close()
    assert not evicted_at_the_cap, "an idle connection was closed when the cap was reached with nobody waiting"
    with connect(path) as sock:  # three sessions hold registrations: the next is told why and closed
        reply = call_reply(sock)
        assert reply is not None and reply[0] == "RESOURCE_EXHAUSTED" and b"cap" in reply[1], reply
        assert hung_up(sock)
    for t in (first, second, third):
        assert t.client.session_alive()
        assert t.save(hashes(t.key[0])).completed == BLOCKS
    assert any("connection cap" in line for line in error_lines(engine))


# -------------------------------------------------------------------- 11. soak: an oversubscribed pool

SOAK_TENANTS, SOAK_ROUNDS, SOAK_BLOCKS, SOAK_SLOT = 4, 8, 64, 16384
SOAK_POOL = 16 << 20  # 1024 pages of 16 KiB; the tenants save 4 x 8 x 64 = 2048 distinct pages: 2x the pool


def soak_content(block_hash: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(block_hash[:8], "little")).integers(0, 256, SOAK_SLOT, dtype=np.uint8)


def test_soak_instances_save_and_load_in_a_2x_oversubscribed_pool(
    engine_factory: Callable[..., EngineProcess], tenants: Callable[..., Tenant]
) -> None:
    engine = engine_factory("--pool-size", str(SOAK_POOL), "--slab-size", str(2 << 20))
    workers = [
        tenants(engine, f"soak{k}", blocks=SOAK_BLOCKS, slot=SOAK_SLOT, namespace="soak") for k in range(SOAK_TENANTS)
    ]
    rounds = [[hashes(f"soak{k}-r{r}", SOAK_BLOCKS) for r in range(SOAK_ROUNDS)] for k in range(SOAK_TENANTS)]
    totals = {"written": 0, "completed": 0, "not_stored": 0, "loaded": 0, "checked": 0}
    lock = threading.Lock()
    failures: list[str] = []

    def run(k: int) -> None:
        me = workers[k]
        try:
            for r in range(SOAK_ROUNDS):
                mine = rounds[k][r]
                me.shared.array[:] = np.stack([soak_content(h) for h in mine])
                s = me.save(mine)
                assert s.written + s.skipped + s.not_stored == SOAK_BLOCKS and s.skipped == 0, s
                # read back what another tenant saved last (its latest or previous round), as much as is resident
                other = rounds[(k + 1 + r) % SOAK_TENANTS][max(0, r - (r + k) % 2)]
                q = me.query(other)
                loaded = 0
                if q.hits:
                    res = me.load(other[: q.hits], list(range(q.hits)), q.lease_id)
                    assert (res.outcome, res.loaded) == (LOADED, q.hits), res
                    loaded = res.loaded
                    for i in range(loaded):
                        assert np.array_equal(me.shared.array[i], soak_content(other[i])), f"soak{k} block {i}"
                with lock:
                    totals["written"] += s.written
                    totals["completed"] += s.completed
                    totals["not_stored"] += s.not_stored
                    totals["loaded"] += loaded
                    totals["checked"] += loaded
        except BaseException as e:  # reported by the main thread
            failures.append(f"soak{k}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(k,)) for k in range(SOAK_TENANTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert not failures, failures

    # every page written sealed (world_size 1) and is either resident or was evicted; nothing is left pinned,
    # inflight or leased; the pool's bytes add up
    m = engine.metric
    resident, evictions = m("kvseal_resident_blocks"), m("kvseal_evictions_total")
    assert totals["completed"] == totals["written"]
    assert totals["written"] + totals["not_stored"] == SOAK_TENANTS * SOAK_ROUNDS * SOAK_BLOCKS
    assert resident + evictions == totals["written"], (resident, evictions, totals)
    assert evictions >= totals["written"] - SOAK_POOL // SOAK_SLOT > 0
    assert m("kvseal_leases") == 0
    assert m("kvseal_pool_used_bytes", state="pinned") == m("kvseal_pool_used_bytes", state="inflight") == 0
    assert m("kvseal_pool_used_bytes", state="sealed") == resident * SOAK_SLOT == m("kvseal_resident_bytes")
    assert m("kvseal_pool_free_bytes") + m("kvseal_pool_used_bytes", state="sealed") == m("kvseal_pool_bytes")
    (ns,) = engine.get_json("/v1/namespaces")
    assert (ns["resident_blocks"], ns["resident_bytes"]) == (resident, resident * SOAK_SLOT)
    assert totals["checked"] > 0

    # what is resident now loads byte-exact, whoever saved it
    reader = workers[0]
    found = 0
    for per_round in rounds:
        for block_hashes in per_round:
            q = reader.query(block_hashes)
            if q.hits:
                assert reader.load(block_hashes[: q.hits], list(range(q.hits)), q.lease_id).loaded == q.hits
                found += q.hits
                for i in range(q.hits):
                    assert np.array_equal(reader.shared.array[i], soak_content(block_hashes[i]))
    assert 0 < found <= resident
    assert m("kvseal_leases") == 0


# ---------------------------------------------------------------- the MetaServer without a token


def attack_metaserver(
    target: str, http: str, namespace: str, block_hashes: list[str], real_node: str
) -> dict[str, Any]:
    """As nobody against a tokenless MetaServer: announce a forged holder of root's blocks, heartbeat root's node id
    under a session of its own, and read."""
    hs = [bytes.fromhex(x) for x in block_hashes]
    blocks = [pb.NamespaceBlocks(namespace_final=namespace, block_hashes=hs)]
    stub = pb_grpc.MetaServerStub(grpc.insecure_channel(target))

    def beat(node: str) -> Any:
        return stub.Heartbeat(pb.HeartbeatRequest(node_id=node, session="evil", address="127.0.0.1:9"), timeout=10)

    return {
        "heartbeat forged": outcome(lambda: beat("0-forged").new_session),
        "announce forged": outcome(
            lambda: (
                stub.Announce(pb.BlocksRequest(node_id="0-forged", session="evil", blocks=blocks), timeout=10).changed
            )
        ),
        "heartbeat the real node": outcome(lambda: beat(real_node).new_session),
        "withdraw as the real node": outcome(
            lambda: (
                stub.Withdraw(pb.BlocksRequest(node_id=real_node, session="evil", blocks=blocks), timeout=10).changed
            )
        ),
        "unregister the real node": outcome(
            lambda: stub.Unregister(pb.UnregisterNodeRequest(node_id=real_node, session="evil"), timeout=10).removed
        ),
        "query": outcome(
            lambda: len(
                stub.QueryPrefix(pb.QueryPrefixRequest(namespace_final=namespace, block_hashes=hs), timeout=10).nodes
            )
        ),
        "list": outcome(lambda: len(stub.ListNodes(pb.ListNodesRequest(), timeout=10).nodes)),
        "http metrics": http_get(f"{http}/metrics")[0],
        "http health": http_get(f"{http}/health")[0],
    }


@needs_root
def test_another_user_can_neither_forge_a_holder_nor_take_a_node_id_at_a_tokenless_metaserver(
    meta: Callable[..., Meta], engine_factory: Callable[..., EngineProcess]
) -> None:
    """Without a token the MetaServer serves its own user and root only (the caller's socket owner, as the engine
    checks it). Before: nobody's forged holder sorted first and every fetch of the namespace missed after
    --peer-timeout, and nobody's heartbeat of a node's id hid that node's blocks. Now both are PERMISSION_DENIED,
    and another node fetches every block from the real one at once."""
    m = meta()
    flags = ("--metaserver", f"127.0.0.1:{m.port}", "--peer-timeout", "3")
    a = engine_factory(*flags, "--node-id", "a")
    hs = [f"m{i}".encode().ljust(32, b".") for i in range(8)]
    namespace = save_blocks(a, "a1", "llama", hs)
    wait_until(lambda: m.prefix(hs, ns=namespace) == {"a": 8}, 20, "A's blocks to be announced")
    out = as_nobody(
        "metaserver",
        target=f"127.0.0.1:{m.port}",
        http=f"http://127.0.0.1:{m.http_port}",
        namespace=namespace,
        block_hashes=[x.hex() for x in hs],
        real_node="a",
    )
    for call in ("heartbeat forged", "announce forged", "heartbeat the real node", "withdraw as the real node"):
        status, message = out[call]
        assert status == "PERMISSION_DENIED" and "serves only its own user" in message, (call, out)
    for call in ("unregister the real node", "query", "list"):
        assert out[call][0] == "PERMISSION_DENIED", (call, out)
    assert (out["http metrics"], out["http health"]) == (403, 200), out
    assert m.prefix(hs, ns=namespace) == {"a": 8}

    c = engine_factory(*flags, "--node-id", "c")
    shared = SharedArray((len(hs), 16384))
    try:
        with EngineClient(c.target, timeout=30) as client:
            register_one_rank(client, "c1", shared, namespace="llama", layout_tag="t", dtype="uint8")
            start = time.monotonic()
            while (r := client.query("c1", hs, request_id="r1")).loading:
                assert time.monotonic() - start < 3, "still loading after --peer-timeout"
                time.sleep(0.01)
            assert r.hits == 8 and r.namespace_final == namespace
    finally:
        shared.close()
    assert c.metric("kvseal_peer_hits_total") == 8 and not c.metric("kvseal_peer_fetch_failures_total")
