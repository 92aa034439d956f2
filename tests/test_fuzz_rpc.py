"""Bursts of malformed RPCs against one real engine process.

Rule: every call succeeds or fails with INVALID_ARGUMENT, FAILED_PRECONDITION, NOT_FOUND or RESOURCE_EXHAUSTED
(never INTERNAL, UNKNOWN or UNAVAILABLE), and afterwards the engine still answers health checks and serves a valid
instance byte-exact, with no Traceback on its stderr.

The engine holds, from fixture setup on, a sealed instance "valid" (two layers in one /dev/shm file, four resident
blocks) and an instance "half" with one of its two workers registered, so Save/Load/Query reach the data path
(block ranges, leases, copies) and the not-sealed path. Register and Unregister never name those two instances;
everything else may.
"""

from __future__ import annotations

import collections
import hashlib
import os
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from conftest import EngineProcess
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvseal.proto import kvseal_pb2 as pb
from kvseal.proto import kvseal_pb2_grpc as pb_grpc

pytestmark = pytest.mark.process

ALLOWED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
U32 = 2**32 - 1
U64 = 2**64 - 1

VALID = "valid"
HALF = "half"
BLOCKS = 16
SEGMENT = 1024  # bytes per block per layer
LAYER_BYTES = BLOCKS * SEGMENT
VALID_HASHES = [hashlib.sha256(f"valid-{i}".encode()).digest() for i in range(4)]
FUZZ_SHM_BYTES = 1 << 20


class Setup:
    def __init__(self, engine: EngineProcess, valid_shm: str, fuzz_shm: str, regular: str) -> None:
        self.engine = engine
        self.valid_shm = valid_shm
        self.fuzz_shm = fuzz_shm
        self.regular = regular
        self.channel = grpc.insecure_channel(engine.target)
        self.stub = pb_grpc.EngineStub(self.channel)
        self.original = b""  # the valid instance's bytes of blocks 0..3, both layers


def _shm_file(tag: str, size: int) -> str:
    path = f"/dev/shm/kvseal-fuzz-{os.getpid()}-{tag}-{os.urandom(4).hex()}"
    with open(path, "wb") as f:
        f.write(os.urandom(size))
    return path


def _read(path: str, offset: int, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


def _valid_layers(path: str) -> list[pb.LayerSpec]:
    return [
        pb.LayerSpec(
            name=f"model.layers.{i}.self_attn.attn",
            dtype="float16",
            segment_bytes=SEGMENT,
            segments=1,
            layout_tag="cpu-LBHNC",
            num_blocks=BLOCKS,
            strides=[SEGMENT],
            memory=pb.MemoryHandle(shm=pb.ShmHandle(path=path, offset=i * LAYER_BYTES, size=2 * LAYER_BYTES)),
        )
        for i in range(2)
    ]


@pytest.fixture(scope="module")
def setup(module_engine: EngineProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    regular = tmp_path_factory.mktemp("fuzz") / "regular.bin"
    regular.write_bytes(bytes(FUZZ_SHM_BYTES))
    valid_shm = _shm_file("valid", 2 * LAYER_BYTES)
    fuzz_shm = _shm_file("fuzz", FUZZ_SHM_BYTES)
    s = Setup(module_engine, valid_shm, fuzz_shm, str(regular))
    try:
        r = s.stub.Register(
            pb.RegisterRequest(
                instance_id=VALID,
                namespace="fuzz-valid",
                tp_rank=0,
                tp_size=1,
                world_size=1,
                block_size=16,
                layers=_valid_layers(valid_shm),
            ),
            timeout=30,
        )
        assert r.status.sealed
        saved = s.stub.Save(
            pb.SaveRequest(worker=pb.WorkerId(instance_id=VALID), block_hashes=VALID_HASHES, block_ids=[0, 1, 2, 3]),
            timeout=30,
        )
        assert saved.completed == 4
        s.original = _read(valid_shm, 0, 4 * SEGMENT) + _read(valid_shm, LAYER_BYTES, 4 * SEGMENT)
        r = s.stub.Register(
            pb.RegisterRequest(
                instance_id=HALF,
                namespace="fuzz-half",
                tp_rank=0,
                tp_size=2,
                world_size=2,
                block_size=16,
                layers=_valid_layers(fuzz_shm),
            ),
            timeout=30,
        )
        assert not r.status.sealed
        yield s
    finally:
        s.channel.close()
        for path in (valid_shm, fuzz_shm):
            os.unlink(path)


# -------------------------------------------------------------------- strategies
#
# Each strategy mixes three kinds of values: valid ones (so requests reach the deep paths: mapping, seal, copies,
# leases), edge values (0, limits, limits + 1, 2**63, 2**64 - 1, NUL and newline in strings) and random ones.

u32 = st.one_of(st.sampled_from([0, 1, 2, 3, 7, 64, U32]), st.integers(0, U32))
u64 = st.one_of(st.sampled_from([0, 1, 2, 15, 16, 17, 1024, 2**31, 2**32, 2**62, 2**63, U64]), st.integers(0, U64))
texts = st.text(max_size=24)
bad_texts = st.one_of(st.sampled_from(["", "a b", "x" * 300, "é", "a\n", "a\x00b", "\n"]), texts)
FUZZ_IDS = ["fz-a", "fz-b", "fz-c"]
any_instance = st.one_of(st.sampled_from([VALID, VALID, HALF, *FUZZ_IDS, "nope"]), bad_texts)
fuzz_instance = st.one_of(st.sampled_from(FUZZ_IDS), bad_texts)
namespaces = st.one_of(st.sampled_from(["ns", "ns", "fuzz-valid", "fuzz-half"]), bad_texts)
one_hash = st.one_of(st.sampled_from([*VALID_HASHES, b"x", b"\x00" * 64, b"\x00" * 65, b""]), st.binary(max_size=100))
hashes = st.one_of(
    st.just(VALID_HASHES),
    st.lists(st.sampled_from(VALID_HASHES), max_size=8),
    st.lists(st.binary(min_size=1, max_size=64), max_size=40),
    st.lists(one_hash, max_size=40),
)
block_id = st.one_of(st.integers(0, BLOCKS - 1), st.sampled_from([BLOCKS, BLOCKS + 1, 2**63, U64]), u64)


@st.composite
def hashes_and_blocks(draw: Any) -> tuple[list[bytes], list[int]]:
    """Mostly as many block ids as hashes (so the data path is reached), sometimes not."""
    hs = draw(hashes)
    if draw(st.integers(0, 4)) == 0:
        return hs, draw(st.lists(block_id, max_size=40))
    valid_ids = st.integers(0, BLOCKS - 1)
    ids = st.one_of(
        st.lists(valid_ids, min_size=len(hs), max_size=len(hs)), st.lists(block_id, min_size=len(hs), max_size=len(hs))
    )
    return hs, draw(ids)


@st.composite
def worker_ids(draw: Any, instances: Any = any_instance) -> pb.WorkerId | None:
    choice = draw(st.integers(0, 9))
    if choice == 0:
        return None
    if choice <= 5:
        key = draw(st.sampled_from([(VALID, 0, 0), (HALF, 0, 0), (HALF, 1, 0), ("fz-a", 0, 0), ("fz-b", 1, 0)]))
        if instances is fuzz_instance and key[0] in (VALID, HALF):
            key = ("fz-a", key[1], key[2])
        return pb.WorkerId(instance_id=key[0], tp_rank=key[1], pp_rank=key[2])
    return pb.WorkerId(
        instance_id=draw(instances),
        tp_rank=draw(st.one_of(st.integers(0, 2), u32)),
        pp_rank=draw(st.one_of(st.just(0), u32)),
    )


@st.composite
def valid_layer(draw: Any, setup: Setup, name: str) -> pb.LayerSpec:
    """A layer that fits the fuzz shm file: any segment size, split or not, 8-byte aligned or not."""
    segments = draw(st.sampled_from([1, 2]))
    segment_bytes = draw(st.sampled_from([8, 64, 1000, 1024, 4096]))
    num_blocks = draw(st.one_of(st.sampled_from([1, 1, 2, 16]), st.integers(1, 16)))
    block_stride = draw(st.sampled_from([segment_bytes, segment_bytes * segments, 8192]))
    strides = [max(block_stride, segment_bytes * segments) if segments == 2 else block_stride]
    if segments == 2:
        strides.append(draw(st.sampled_from([segment_bytes, 16 * 8192])))
        if strides[1] == segment_bytes:
            strides[0] = max(strides[0], 2 * segment_bytes)
    return pb.LayerSpec(
        name=name,
        dtype=draw(st.sampled_from(["float16", "bfloat16", "torch.float32", "fp8_e4m3"])),
        segment_bytes=segment_bytes,
        segments=segments,
        group_id=draw(st.integers(0, 2)),
        layout_tag=draw(st.sampled_from(["cpu-LBHNC", "amx"])),
        num_blocks=num_blocks,
        strides=strides,
        memory=pb.MemoryHandle(
            shm=pb.ShmHandle(path=setup.fuzz_shm, offset=draw(st.sampled_from([0, 3, 64, 4096])), size=FUZZ_SHM_BYTES)
        ),
    )


def shm_paths(setup: Setup) -> Any:
    """The fuzz file, near misses of it, other files, /proc fd links, NUL bytes, newlines and random text."""
    paths = st.sampled_from(
        [
            setup.fuzz_shm,
            setup.fuzz_shm + "\x00",
            setup.fuzz_shm + "\n",
            setup.fuzz_shm + "-missing",
            "/dev/shm/",
            "/dev/shm",
            "/dev/shm/../etc/passwd",
            "/dev/shm/a\x00b",
            "\x00",
            "/etc/passwd",
            "/dev/zero",
            setup.regular,
            "/proc/1/fd/0",
            f"/proc/{os.getpid()}/fd/0",
            "/proc/self/fd/0",
            "/proc/999999999/fd/3",
            "/proc/1/fd/2\n",
            "",
            "relative/path",
            "/dev/shm/" + "x" * 300,
        ]
    )
    return st.one_of(paths, paths, paths, texts)


@st.composite
def memory_handles(draw: Any, setup: Setup) -> pb.MemoryHandle | None:
    kind = draw(st.sampled_from(["shm", "shm", "shm", "cuda", "none", "empty"]))
    if kind == "none":
        return None
    if kind == "empty":
        return pb.MemoryHandle()
    if kind == "cuda":
        return pb.MemoryHandle(
            cuda=pb.CudaIpcHandle(
                device=draw(st.integers(-1, 8)),
                handle=draw(st.binary(max_size=64)),
                storage_size=draw(u64),
                storage_offset=draw(u64),
                offset=draw(u64),
            )
        )
    path = draw(shm_paths(setup))
    offset = draw(st.one_of(st.sampled_from([0, 8, 1000, FUZZ_SHM_BYTES - 1]), u64))
    size = draw(st.one_of(st.sampled_from([0, 1, 4096, FUZZ_SHM_BYTES, FUZZ_SHM_BYTES + 1]), u64))
    return pb.MemoryHandle(shm=pb.ShmHandle(path=path, offset=offset, size=size))


@st.composite
def mutated_layer(draw: Any, setup: Setup, name: str) -> pb.LayerSpec:
    """A valid layer with one field replaced by an edge or random value (the memory path and the strides, whose
    values reach the file system and numpy, more often than the rest)."""
    layer = draw(valid_layer(setup, name))
    field = draw(st.sampled_from(["path", "stride_value", *MUTATIONS, "path", "stride_value"]))
    if field in ("name", "dtype", "layout_tag"):
        setattr(layer, field, draw(bad_texts))
    elif field == "segment_bytes":
        layer.segment_bytes = draw(st.one_of(st.sampled_from([0, 2**30, 2**30 + 1, 2**63, U64]), u64))
    elif field == "segments":
        layer.segments = draw(st.sampled_from([0, 3, U32, 3 - layer.segments]))
    elif field == "num_blocks":
        layer.num_blocks = draw(st.one_of(st.sampled_from([0, 1, 2**32, 2**63, U64]), u64))
    elif field == "strides":
        layer.strides[:] = draw(st.lists(st.one_of(st.sampled_from([0, 1, 2**63, U64]), u64), max_size=3))
    elif field == "stride_value":
        i = draw(st.sampled_from([0, 0, len(layer.strides) - 1]))
        layer.strides[i] = draw(st.one_of(st.sampled_from([U64, 2**63, 2**63 - 1, 0, 1, 7, 2**31, 2**32]), u64))
        if draw(st.booleans()):
            layer.num_blocks = 1  # the block stride then spans nothing, so no extent check bounds it
    elif field == "path":
        layer.memory.shm.path = draw(shm_paths(setup))
    elif field == "memory":
        memory = draw(memory_handles(setup))
        if memory is None:
            layer.ClearField("memory")
        else:
            layer.memory.CopyFrom(memory)
    elif field == "offset":
        layer.memory.shm.offset = draw(st.one_of(st.sampled_from([1, 7, FUZZ_SHM_BYTES - 8, FUZZ_SHM_BYTES]), u64))
    elif field == "size":
        layer.memory.shm.size = draw(st.one_of(st.sampled_from([0, 1, 4096, FUZZ_SHM_BYTES + 1]), u64))
    else:
        layer.group_id = draw(u32)
    return layer


MUTATIONS = [  # hypothesis draws early entries more often: the ones that reach the OS and numpy come first
    "path",
    "stride_value",
    "memory",
    "num_blocks",
    "strides",
    "offset",
    "size",
    "segment_bytes",
    "segments",
    "name",
    "dtype",
    "layout_tag",
    "group_id",
]


@st.composite
def register_requests(draw: Any, setup: Setup) -> pb.RegisterRequest:
    tp_size = draw(st.sampled_from([1, 1, 2]))
    names = draw(
        st.lists(
            st.sampled_from([f"model.layers.{i}.self_attn.attn" for i in range(4)]), min_size=1, max_size=3, unique=True
        )
    )
    mutate = draw(st.integers(0, 4))  # 0: valid layers; 1..3: one layer mutated; 4: layers from scratch
    if mutate == 0:
        layers = [draw(valid_layer(setup, n)) for n in names]
    elif mutate <= 3:
        bad = draw(st.integers(0, len(names) - 1))
        layers = [draw((mutated_layer if i == bad else valid_layer)(setup, n)) for i, n in enumerate(names)]
    else:
        layers = draw(st.lists(wild_layer(setup), max_size=4))
    request = pb.RegisterRequest(
        instance_id=draw(st.sampled_from(FUZZ_IDS)),
        namespace="ns",
        tp_rank=draw(st.integers(0, tp_size - 1)),
        tp_size=tp_size,
        pp_rank=0,
        world_size=tp_size,
        block_size=16,
        layers=layers,
    )
    if draw(st.integers(0, 2)) == 0:  # and/or an instance-wide field out of range
        field = draw(
            st.sampled_from(["instance_id", "namespace", "tp_rank", "tp_size", "pp_rank", "world_size", "block_size"])
        )
        if field == "instance_id":
            request.instance_id = draw(fuzz_instance)
        elif field == "namespace":
            request.namespace = draw(namespaces)
        elif field == "block_size":
            request.block_size = draw(st.one_of(st.sampled_from([0, 2**20, 2**20 + 1]), u32))
        else:
            setattr(request, field, draw(st.one_of(st.integers(0, 4), u32)))
    return request


@st.composite
def wild_layer(draw: Any, setup: Setup) -> pb.LayerSpec:
    """Every field drawn on its own."""
    segments = draw(st.sampled_from([1, 2, 0, 3, U32]))
    kwargs: dict[str, Any] = dict(
        name=draw(st.one_of(st.sampled_from(["l0", "l1"]), bad_texts)),
        dtype=draw(st.one_of(st.sampled_from(["float16", "FP8", "torch.float16"]), bad_texts)),
        segment_bytes=draw(st.one_of(st.sampled_from([0, 1, 8, 1024, 2**30, 2**30 + 1]), u64)),
        segments=segments,
        group_id=draw(u32),
        layout_tag=draw(st.one_of(st.just("t"), bad_texts)),
        num_blocks=draw(st.one_of(st.sampled_from([0, 1, 2, 16, U64]), u64)),
        strides=draw(st.lists(st.one_of(st.sampled_from([0, 8, 1024, 65536]), u64), max_size=3)),
    )
    memory = draw(memory_handles(setup))
    if memory is not None:
        kwargs["memory"] = memory
    return pb.LayerSpec(**kwargs)


@st.composite
def rpcs(draw: Any, setup: Setup) -> tuple[str, Any]:
    method = draw(
        st.sampled_from(
            [
                "Register",
                "Register",
                "Register",
                "Save",
                "Save",
                "Load",
                "Load",
                "Query",
                "Query",
                "Release",
                "Unregister",
                "Session",
            ]
        )
    )
    if method == "Register":
        return method, draw(register_requests(setup))
    if method in ("Save", "Load"):
        hs, ids = draw(hashes_and_blocks())
        kwargs: dict[str, Any] = dict(block_hashes=hs, block_ids=ids)
        worker = draw(worker_ids())
        if worker is not None:
            kwargs["worker"] = worker
        if method == "Save":
            return method, pb.SaveRequest(**kwargs)
        return method, pb.LoadRequest(lease_id=draw(st.one_of(st.integers(0, 30), u64)), **kwargs)
    if method == "Query":
        return method, pb.QueryRequest(
            instance_id=draw(any_instance),
            block_hashes=draw(hashes),
            request_id=draw(st.one_of(st.just(""), texts, st.text(min_size=250, max_size=300))),
            lease_ttl_ms=draw(st.one_of(st.sampled_from([0, 1, 3_600_000, 3_600_001]), u32)),
        )
    if method == "Release":
        lease = draw(st.one_of(st.integers(0, 30), u64))
        return method, pb.ReleaseRequest(instance_id=draw(any_instance), lease_id=lease)
    worker = draw(worker_ids(fuzz_instance))
    message = pb.UnregisterRequest if method == "Unregister" else pb.SessionRequest
    return method, message() if worker is None else message(worker=worker)


def call(setup: Setup, method: str, request: Any) -> None:
    """Makes one RPC; raises AssertionError if it fails with a status outside ALLOWED."""
    try:
        if method == "Session":
            stream = setup.stub.Session(request, timeout=30)
            try:
                next(stream)  # a worker of a fuzz instance: the session opens, and ends (dropping it) on cancel
            finally:
                stream.cancel()
        else:
            getattr(setup.stub, method)(request, timeout=30)
    except grpc.RpcError as e:
        code = e.code()
        if code == grpc.StatusCode.CANCELLED and method == "Session":
            return
        assert code in ALLOWED, f"{method} answered {code.name}: {e.details()}\nrequest: {request!r}"[:4000]


def check_engine_healthy(setup: Setup) -> None:
    engine = setup.engine
    assert engine.alive()
    assert "Traceback" not in engine.stderr(), engine.stderr()
    health = health_pb2_grpc.HealthStub(setup.channel)
    r = health.Check(health_pb2.HealthCheckRequest(service="kvseal.v1.Engine"), timeout=10)
    assert r.status == health_pb2.HealthCheckResponse.SERVING
    assert engine.get("/health")[0] == 200
    assert engine.get("/metrics")[0] == 200
    assert engine.get("/v1/namespaces")[0] == 200
    assert engine.get("/v1/instances")[0] == 200
    # the valid instance still serves its four blocks, byte-exact, into other block ids
    q = setup.stub.Query(pb.QueryRequest(instance_id=VALID, block_hashes=VALID_HASHES), timeout=10)
    assert q.hits == 4
    r = setup.stub.Load(
        pb.LoadRequest(
            worker=pb.WorkerId(instance_id=VALID),
            block_hashes=VALID_HASHES,
            block_ids=[8, 9, 10, 11],
            lease_id=q.lease_id,
        ),
        timeout=10,
    )
    assert (r.outcome, r.loaded) == (pb.LoadResponse.LOADED, 4)
    got = _read(setup.valid_shm, 8 * SEGMENT, 4 * SEGMENT) + _read(
        setup.valid_shm, LAYER_BYTES + 8 * SEGMENT, 4 * SEGMENT
    )
    assert got == setup.original


# -------------------------------------------------------------------- tests


def test_malformed_rpc_bursts(setup: Setup) -> None:
    made: collections.Counter[str] = collections.Counter()

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(burst=st.data())
    def bursts(burst: Any) -> None:
        for method, request in burst.draw(st.lists(rpcs(setup), min_size=1, max_size=6), label="burst"):
            call(setup, method, request)
            made[method] += 1

    bursts()
    assert sum(made.values()) >= 150 and len(made) == 7, made  # every RPC was exercised
    check_engine_healthy(setup)


def test_oversized_requests(setup: Setup) -> None:
    # more hashes than one request may carry, a hash longer than allowed, a message above the 64 MiB limit
    too_many = [b"h"] * (2**17 + 1)
    call(setup, "Query", pb.QueryRequest(instance_id=VALID, block_hashes=too_many))
    call(
        setup,
        "Save",
        pb.SaveRequest(worker=pb.WorkerId(instance_id=VALID), block_hashes=too_many, block_ids=[0] * len(too_many)),
    )
    call(setup, "Load", pb.LoadRequest(worker=pb.WorkerId(instance_id=VALID), block_hashes=[b"h" * 65], block_ids=[0]))
    big = b"\x00" * (65 << 20)
    with pytest.raises(grpc.RpcError) as info:
        setup.stub.Query(pb.QueryRequest(instance_id=VALID, block_hashes=[big]), timeout=60)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    del big
    check_engine_healthy(setup)


def test_page_larger_than_a_slab_is_refused_cleanly(setup: Setup) -> None:
    """Ten 1 MiB layers (views of one 1 MiB region) make a 10 MiB page: more than the 8 MiB slab. The seal is
    refused with RESOURCE_EXHAUSTED and leaves no instance behind."""
    layers = [
        pb.LayerSpec(
            name=f"big.{i}",
            dtype="uint8",
            segment_bytes=FUZZ_SHM_BYTES,
            segments=1,
            layout_tag="t",
            num_blocks=1,
            strides=[FUZZ_SHM_BYTES],
            memory=pb.MemoryHandle(shm=pb.ShmHandle(path=setup.fuzz_shm, offset=0, size=FUZZ_SHM_BYTES)),
        )
        for i in range(10)
    ]
    request = pb.RegisterRequest(instance_id="too-big", namespace="ns", tp_size=1, world_size=1, block_size=16)
    with pytest.raises(grpc.RpcError) as info:
        setup.stub.Register(pb.RegisterRequest(layers=layers, **_fields(request)), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--pool-size" in (info.value.details() or "")
    assert all(i["instance_id"] != "too-big" for i in setup.engine.get_json("/v1/instances"))
    r = setup.stub.Register(pb.RegisterRequest(layers=layers[:7], **_fields(request)), timeout=30)  # 7 MiB fits
    assert r.status.sealed and r.status.page_bytes == 7 * FUZZ_SHM_BYTES
    setup.stub.Unregister(pb.UnregisterRequest(worker=pb.WorkerId(instance_id="too-big")), timeout=30)
    check_engine_healthy(setup)


def _fields(message: Any) -> dict[str, Any]:
    return {field.name: value for field, value in message.ListFields()}


def _one_layer(setup: Setup, instance_id: str = "fz-regress", namespace: str = "ns", **changes: Any) -> Any:
    layer = _valid_layers(setup.fuzz_shm)[0]
    path = changes.pop("path", None)
    for key, value in changes.items():
        if key == "strides":
            layer.strides[:] = value
        else:
            setattr(layer, key, value)
    if path is not None:
        layer.memory.shm.path = path
    return pb.RegisterRequest(
        instance_id=instance_id, namespace=namespace, tp_size=1, world_size=1, block_size=16, layers=[layer]
    )


@pytest.mark.parametrize(
    "case",
    [
        "nul-in-path",
        "nul-only-path",
        "block-stride-2**64-1-one-block",
        "block-stride-2**63-one-block",
        "newline-after-instance-id",
        "newline-after-namespace",
        "newline-after-layer-name",
    ],
)
def test_regressions_found_by_fuzzing(setup: Setup, case: str) -> None:
    """Requests the fuzzer found answered INTERNAL (or accepted) before the fixes: a NUL byte in the shm path
    (ValueError from os.path.realpath), a block stride above 2**63 on a one-block layer (OverflowError from numpy
    at seal, after the instance was already marked sealed: every later Save failed with INTERNAL too), and names
    with a trailing newline, which the `^...$` patterns let through."""
    request = {
        "nul-in-path": lambda: _one_layer(setup, path=setup.fuzz_shm + "\x00"),
        "nul-only-path": lambda: _one_layer(setup, path="\x00"),
        "block-stride-2**64-1-one-block": lambda: _one_layer(setup, num_blocks=1, strides=[U64]),
        "block-stride-2**63-one-block": lambda: _one_layer(setup, num_blocks=1, strides=[2**63]),
        "newline-after-instance-id": lambda: _one_layer(setup, instance_id="fz-regress\n"),
        "newline-after-namespace": lambda: _one_layer(setup, namespace="ns\n"),
        "newline-after-layer-name": lambda: _one_layer(setup, name="model.layers.0.self_attn.attn\n"),
    }[case]()
    with pytest.raises(grpc.RpcError) as info:
        setup.stub.Register(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    # nothing half-registered is left behind
    with pytest.raises(grpc.RpcError) as info:
        setup.stub.Save(
            pb.SaveRequest(worker=pb.WorkerId(instance_id=request.instance_id), block_hashes=[b"h"], block_ids=[0]),
            timeout=30,
        )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    # the largest stride numpy takes is fine
    ok = _one_layer(setup, instance_id="fz-regress-ok", num_blocks=1, strides=[2**63 - 1])
    assert setup.stub.Register(ok, timeout=30).status.sealed
    saved = setup.stub.Save(
        pb.SaveRequest(worker=pb.WorkerId(instance_id="fz-regress-ok"), block_hashes=[case.encode()], block_ids=[0]),
        timeout=30,
    )
    assert saved.written == 1
    setup.stub.Unregister(pb.UnregisterRequest(worker=pb.WorkerId(instance_id="fz-regress-ok")), timeout=30)
