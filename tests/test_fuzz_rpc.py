"""Bursts of malformed calls against one real engine process: the local lane's frames (REGISTER with descriptors
of every kind, SAVE, LOAD, UNREGISTER, QUERY, RELEASE, HELLO, random and mutated bodies, bad headers, truncated
and pipelined frames) and gRPC's Query, Release and Info.

Rule: every call succeeds or fails with INVALID_ARGUMENT, FAILED_PRECONDITION, NOT_FOUND, PERMISSION_DENIED or
RESOURCE_EXHAUSTED (never INTERNAL, UNKNOWN or UNAVAILABLE); a complete lane frame always gets an answer and the
connection stays open, except after a header the lane refuses (unknown op, body over the op's limit: an
INVALID_ARGUMENT answer, then the engine hangs up); afterwards the engine answers health checks, serves the valid
instance byte-exact, has dropped what the fuzzing sessions registered, holds no descriptor they sent, and printed
no Traceback.

The engine holds, from fixture setup on, a sealed instance "valid" (two layers in one sealed memfd of this
process, four resident blocks) and an instance "half" with one of its two workers registered, each registered by
a session (lane connection) of its own. Fuzzing sessions may name them anywhere: the lane's trust model must keep
them intact (another session's worker is PERMISSION_DENIED). Each example opens its own raw lane connection, so
what it registers is its own session's, dropped when the example ends; most examples start with a valid
registration of "fz-a" (registered again on every new connection), so that what follows reaches the seal, the
store, the copies and the leases. The bursts assert that they got that deep.
"""

from __future__ import annotations

import collections
import fcntl
import hashlib
import os
import socket
import struct
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import _Engines, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvseal.client import EngineClient, layer_from_array
from kvseal.errors import InvalidArgument, NotFound, ResourceExhausted
from kvseal.limits import MAX_BLOCKS_PER_REQUEST, MAX_LAYERS
from kvseal.memfd import SharedArray, new_memfd
from kvseal.proto import kvseal_pb2 as pb
from kvseal.proto import kvseal_pb2_grpc as pb_grpc
from kvseal.testing import EngineProcess, register_one_rank
from kvseal.wire import lane as fq

pytestmark = pytest.mark.process

ALLOWED = ("INVALID_ARGUMENT", "FAILED_PRECONDITION", "NOT_FOUND", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED")
ALLOWED_LANE = {fq.STATUS_CODES[name] for name in ALLOWED}
ALLOWED_GRPC = {getattr(grpc.StatusCode, name) for name in ALLOWED}
INVALID = fq.STATUS_CODES["INVALID_ARGUMENT"]
U32 = 2**32 - 1
U64 = 2**64 - 1

VALID = "valid"
HALF = "half"
BLOCKS = 16
SEGMENT = 1024  # bytes per block per layer
VALID_HASHES = [hashlib.sha256(f"valid-{i}".encode()).digest() for i in range(4)]
FUZZ_HASHES = [hashlib.sha256(f"fuzz-{i}".encode()).digest() for i in range(8)]
FUZZ_SHM_BYTES = 1 << 20
LAYOUT_TAG = "cpu-LBHNC"


# -------------------------------------------------------------------- descriptors a worker might hand over


class Descriptors:
    """One descriptor of each kind, kept open by this process; frames carry duplicates of them (SCM_RIGHTS).
    Only "memfd" and "memfd-small" (read-write, sealed against shrinking) may be mapped."""

    def __init__(self, tmp: Path) -> None:
        self.memory = SharedArray((FUZZ_SHM_BYTES,))
        self.small = SharedArray((4096,))
        self.fds: dict[str, int] = {"memfd": self.memory.fd, "memfd-small": self.small.fd}
        self._own: list[int] = []
        self._keep: list[Any] = []
        unsealed = self._add("memfd-unsealed", new_memfd(FUZZ_SHM_BYTES))
        assert unsealed >= 0
        no_sealing = os.memfd_create("kvseal-fuzz", os.MFD_CLOEXEC)
        os.ftruncate(no_sealing, FUZZ_SHM_BYTES)
        self._add("memfd-no-sealing", no_sealing)
        write_sealed = new_memfd(FUZZ_SHM_BYTES)  # a worker may seal more than asked: it then cannot be written
        fcntl.fcntl(write_sealed, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
        self._add("memfd-write-sealed", write_sealed)
        proc = f"/proc/self/fd/{self.memory.fd}"
        self._add("memfd-read-only", os.open(proc, os.O_RDONLY | os.O_CLOEXEC))
        self._add("memfd-write-only", os.open(proc, os.O_WRONLY | os.O_CLOEXEC))
        self._add("memfd-o-path", os.open(proc, os.O_PATH | os.O_CLOEXEC))
        regular = tmp / "regular.bin"
        regular.write_bytes(bytes(FUZZ_SHM_BYTES))
        self._add("regular-file", os.open(regular, os.O_RDWR | os.O_CLOEXEC))
        with tempfile.NamedTemporaryFile(dir="/dev/shm") as f:  # tmpfs, but no memfd: no seals
            f.truncate(FUZZ_SHM_BYTES)
            self._add("dev-shm-file", os.open(f.name, os.O_RDWR | os.O_CLOEXEC))
        r, w = os.pipe2(os.O_CLOEXEC)
        self._add("pipe", r)
        self._own.append(w)
        a, b = socket.socketpair()
        self._keep += [a, b]
        self.fds["socket"] = a.fileno()
        self._add("dev-null", os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC))
        self._add("directory", os.open(tmp, os.O_RDONLY | os.O_CLOEXEC))
        self._add("eventfd", os.eventfd(0, os.EFD_CLOEXEC))

    def _add(self, kind: str, fd: int) -> int:
        self.fds[kind] = fd
        self._own.append(fd)
        return fd

    @property
    def kinds(self) -> list[str]:
        return list(self.fds)

    def close(self) -> None:
        for fd in self._own:
            os.close(fd)
        for s in self._keep:
            s.close()
        self.memory.close()
        self.small.close()


# -------------------------------------------------------------------- the engine and its two instances


class Owner:
    """A worker of this process registered over its own client's lane (its session), on sealed memfd memory."""

    def __init__(self, engine: EngineProcess, instance_id: str, namespace: str, tp_size: int) -> None:
        self.shared = SharedArray((2 * BLOCKS, SEGMENT))
        self.shared.array[:] = np.random.default_rng(len(instance_id)).integers(0, 256, self.shared.array.shape)
        self.client = engine.client()
        self.key = (instance_id, 0, 0)
        layers = {
            f"model.layers.{i}.self_attn.attn": self.shared.array[i * BLOCKS : (i + 1) * BLOCKS] for i in range(2)
        }
        self.status = register_one_rank(
            self.client,
            instance_id,
            self.shared,
            layers,
            namespace=namespace,
            layout_tag=LAYOUT_TAG,
            dtype="float16",
            world_size=tp_size,
        )

    def blocks(self, ids: Sequence[int]) -> bytes:
        """The bytes of blocks `ids` of both layers."""
        a = self.shared.array
        return a[list(ids)].tobytes() + a[[BLOCKS + i for i in ids]].tobytes()

    def close(self) -> None:
        self.client.close()
        self.shared.close()


@dataclass
class Setup:
    engine: EngineProcess
    lane_path: str
    valid: Owner
    half: Owner
    descriptors: Descriptors
    channel: grpc.Channel
    stub: pb_grpc.EngineStub
    original: bytes = b""  # the valid instance's bytes of blocks 0..3, both layers
    baseline_fds: int = 0  # the engine's open descriptors with only the two owners' sessions
    made: collections.Counter[str] = field(default_factory=collections.Counter)
    answers: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)


def engine_fds(engine: EngineProcess) -> int:
    return len(os.listdir(f"/proc/{engine.pid}/fd"))


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    # a pool large enough that the fuzzing's saves never evict the valid instance's four pages; 8 MiB slabs
    engines = _Engines(tmp_path_factory.mktemp("fuzz-engine"))
    engine = engines.start("--pool-size", "256MiB")
    descriptors = Descriptors(tmp_path_factory.mktemp("fuzz-fds"))
    valid = Owner(engine, VALID, "fuzz-valid", tp_size=1)
    half = Owner(engine, HALF, "fuzz-half", tp_size=2)
    channel = grpc.insecure_channel(engine.target)
    s = Setup(engine, valid.client.info().lane_socket, valid, half, descriptors, channel, pb_grpc.EngineStub(channel))
    try:
        assert valid.status.sealed and not half.status.sealed
        assert valid.client.save(valid.key, VALID_HASHES, [0, 1, 2, 3]).completed == 4
        s.original = valid.blocks([0, 1, 2, 3])
        # a CUDA layer makes the engine import torch (if it has it) once: done here, outside the timed bursts
        cuda = pb.LayerSpec(
            name="l0",
            dtype="float16",
            segment_bytes=8,
            segments=1,
            layout_tag="t",
            num_blocks=1,
            strides=[8],
            memory=pb.MemoryHandle(cuda=pb.CudaIpcHandle(storage_size=8)),
        )
        s.stub.Info(pb.InfoRequest(), timeout=10)  # this channel's connection is part of the baseline
        s.baseline_fds = engine_fds(engine)
        with LaneConn(s.lane_path) as conn:
            reply = conn.call(fq.encode_register(_register_request("fz-cuda", [cuda]).SerializeToString()))
            assert reply is not None and reply[0] == fq.STATUS_CODES["FAILED_PRECONDITION"], reply
        wait_until(lambda: engine_fds(engine) == s.baseline_fds, 10, "the engine to close the warm-up connection")
        yield s
    finally:
        channel.close()
        valid.close()
        half.close()
        descriptors.close()
        engines.stop_all()


# -------------------------------------------------------------------- a raw lane connection


class LaneConn:
    """One lane connection (one session) driven frame by frame."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(path)

    def __enter__(self) -> LaneConn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, frame: bytes, fds: Sequence[int] = (), split: int = 0) -> None:
        """Sends `frame`; `fds` travel with its first `split` bytes (all of it when 0)."""
        if fds:
            head = frame[: split or len(frame)]
            sent = socket.send_fds(self.sock, [head], list(fds))
            self.sock.sendall(frame[sent:])
        else:
            self.sock.sendall(frame)

    def reply(self) -> tuple[int, bytes] | None:
        """The next answer frame, or None when the engine closed the connection."""
        try:
            return fq.read_frame(self.sock)
        except (ConnectionError, BrokenPipeError):
            return None

    def call(self, frame: bytes, fds: Sequence[int] = (), split: int = 0) -> tuple[int, bytes] | None:
        self.send(frame, fds, split)
        return self.reply()

    def close(self) -> None:
        self.sock.close()


# -------------------------------------------------------------------- strategies
#
# Each strategy mixes valid values (so requests reach the deep paths: mapping, seal, copies, leases), edge values
# (0, limits, limits + 1, 2**63, 2**64 - 1, NUL and newline in strings) and random ones.

u32 = st.one_of(st.sampled_from([0, 1, 2, 3, 7, 64, U32]), st.integers(0, U32))
u64 = st.one_of(st.sampled_from([0, 1, 2, 15, 16, 17, 1024, 2**31, 2**32, 2**62, 2**63, U64]), st.integers(0, U64))
texts = st.text(max_size=24)
bad_texts = st.one_of(st.sampled_from(["", "a b", "x" * 300, "é", "a\n", "a\x00b", "\n"]), texts)
FUZZ_IDS = ["fz-a", "fz-b", "fz-c"]
any_instance = st.one_of(st.sampled_from([VALID, VALID, HALF, *FUZZ_IDS, "nope"]), bad_texts)
namespaces = st.one_of(st.sampled_from(["ns", "ns", "fuzz-valid", "fuzz-half"]), bad_texts)
one_hash = st.one_of(st.sampled_from([*VALID_HASHES, b"x", b"\x00" * 64, b"\x00" * 65, b""]), st.binary(max_size=100))
any_hashes = st.one_of(  # for gRPC, which carries hashes of any lengths
    st.just(VALID_HASHES),
    st.lists(st.sampled_from(VALID_HASHES), max_size=8),
    st.lists(st.binary(min_size=1, max_size=64), max_size=40),
    st.lists(one_hash, max_size=40),
)
lane_hashes = st.one_of(  # the lane carries hashes of one length, 1..255 bytes
    st.just(VALID_HASHES),
    st.lists(st.sampled_from(FUZZ_HASHES), max_size=8),
    st.lists(st.sampled_from(VALID_HASHES + FUZZ_HASHES), max_size=8),
    st.one_of(st.sampled_from([1, 32, 64, 65, 255]), st.integers(1, 255)).flatmap(
        lambda n: st.lists(st.binary(min_size=n, max_size=n), max_size=40)
    ),
)
block_id = st.one_of(st.integers(0, BLOCKS - 1), st.sampled_from([BLOCKS, BLOCKS + 1, 2**31, U32]), u32)
OWNED_KEYS = [("fz-a", 0, 0), (VALID, 0, 0), (HALF, 0, 0), (HALF, 1, 0), ("fz-a", 1, 0), ("fz-b", 0, 0)]


@st.composite
def worker_keys(draw: Any) -> tuple[str, int, int]:
    """Mostly fz-a's first worker (what a burst's prelude registers), else one that exists, else anything."""
    choice = draw(st.sampled_from(["prelude", "prelude", "owned", "any"]))
    if choice == "prelude":
        return ("fz-a", 0, 0)
    if choice == "owned":
        return draw(st.sampled_from(OWNED_KEYS))
    return draw(any_instance), draw(st.one_of(st.integers(0, 2), u32)), draw(st.one_of(st.just(0), u32))


@st.composite
def hashes_and_ids(draw: Any) -> tuple[list[bytes], list[int]]:
    if draw(st.booleans()):  # a run of the fuzz hashes (saved, then loaded, by the bursts)
        start = draw(st.integers(0, len(FUZZ_HASHES) - 1))
        hs = FUZZ_HASHES[start : start + draw(st.integers(1, len(FUZZ_HASHES)))]
    else:
        hs = draw(lane_hashes)
    in_range = draw(st.sampled_from([True, True, True, False]))
    ids = st.integers(0, BLOCKS - 1) if in_range else st.one_of(st.integers(0, BLOCKS - 1), block_id)
    return hs, draw(st.lists(ids, min_size=len(hs), max_size=len(hs)))


# ---- registrations


@dataclass
class Register:
    """A RegisterRequest and the kinds of the descriptors sent with it, in order."""

    request: pb.RegisterRequest
    kinds: list[str]


def _register_request(
    instance_id: str, layers: list[pb.LayerSpec], tp_size: int = 1, groups: list[pb.KvGroup] | None = None
) -> pb.RegisterRequest:
    return pb.RegisterRequest(
        instance_id=instance_id,
        namespace="ns",
        tp_rank=0,
        tp_size=tp_size,
        pp_rank=0,
        world_size=tp_size,
        block_size=16,
        layers=layers,
        groups=groups or [],
    )


@st.composite
def valid_groups(draw: Any, most: int) -> list[pb.KvGroup]:
    """Mostly none (one full-attention group); else up to `most` valid KV cache groups of a hybrid model."""
    if most == 0 or draw(st.sampled_from([True, True, False])):
        return []
    kind = st.sampled_from(["full", "sliding", "chunked", "mamba"])
    spans = st.sampled_from([2, 16, 64, 4096])
    groups = []
    for k in draw(st.lists(kind, min_size=1, max_size=most)):
        span = draw(spans) if k in ("sliding", "chunked") else 0
        groups.append(pb.KvGroup(kind=k, block_size=draw(st.sampled_from([16, 16, 32, 1])), span=span))
    return groups


@st.composite
def wild_groups(draw: Any) -> list[pb.KvGroup]:
    """KV cache groups with any kind, block size and span, or more of them than the engine takes."""
    group = st.builds(
        pb.KvGroup,
        kind=st.one_of(st.sampled_from(["full", "sliding", "mamba", "Full", ""]), texts),
        block_size=u32,
        span=u32,
    )
    return draw(
        st.one_of(
            st.lists(group, max_size=4),
            st.lists(st.just(pb.KvGroup(kind="full", block_size=16)), min_size=65, max_size=66),
        )
    )


@st.composite
def valid_layer(draw: Any, name: str, fd: int = 0, size: int = FUZZ_SHM_BYTES, groups: int = 1) -> pb.LayerSpec:
    """A layer that fits the fuzz memfd: any segment size, split or not, 8-byte aligned or not, in one of `groups`
    KV cache groups."""
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
        group_id=draw(st.integers(0, groups - 1)),
        layout_tag=draw(st.sampled_from([LAYOUT_TAG, "amx"])),
        num_blocks=num_blocks,
        strides=strides,
        memory=pb.MemoryHandle(
            shm=pb.ShmHandle(fd=fd, offset=draw(st.sampled_from([0, 3, 64, 4096])), size=size),
        ),
    )


fd_indexes = st.one_of(st.integers(0, 5), st.sampled_from([252, 253, U32]), u32)
shm_sizes = st.one_of(st.sampled_from([0, 1, 4096, 4097, FUZZ_SHM_BYTES, FUZZ_SHM_BYTES + 1, U64]), u64)


@st.composite
def memory_handles(draw: Any) -> pb.MemoryHandle | None:
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
    offset = draw(st.one_of(st.sampled_from([0, 8, 1000, FUZZ_SHM_BYTES - 1]), u64))
    return pb.MemoryHandle(shm=pb.ShmHandle(fd=draw(fd_indexes), offset=offset, size=draw(shm_sizes)))


MUTATIONS = [  # hypothesis draws early entries more often: the ones that reach the OS and numpy come first
    "fd",
    "size",
    "stride_value",
    "memory",
    "num_blocks",
    "strides",
    "offset",
    "segment_bytes",
    "segments",
    "name",
    "dtype",
    "layout_tag",
    "group_id",
]


@st.composite
def mutated_layer(draw: Any, name: str) -> pb.LayerSpec:
    """A valid layer with one field replaced by an edge or random value (the descriptor index, the size and the
    strides, whose values reach the kernel and numpy, more often than the rest)."""
    layer = draw(valid_layer(name))
    what = draw(st.sampled_from(["fd", "size", "stride_value", *MUTATIONS]))
    if what in ("name", "dtype", "layout_tag"):
        setattr(layer, what, draw(bad_texts))
    elif what == "fd":
        layer.memory.shm.fd = draw(fd_indexes)
    elif what == "size":
        layer.memory.shm.size = draw(shm_sizes)
    elif what == "segment_bytes":
        layer.segment_bytes = draw(st.one_of(st.sampled_from([0, 2**30, 2**30 + 1, 2**63, U64]), u64))
    elif what == "segments":
        layer.segments = draw(st.sampled_from([0, 3, U32, 3 - layer.segments]))
    elif what == "num_blocks":
        layer.num_blocks = draw(st.one_of(st.sampled_from([0, 1, 2**32, 2**63, U64]), u64))
    elif what == "strides":
        layer.strides[:] = draw(st.lists(st.one_of(st.sampled_from([0, 1, 2**63, U64]), u64), max_size=3))
    elif what == "stride_value":
        i = draw(st.sampled_from([0, 0, len(layer.strides) - 1]))
        layer.strides[i] = draw(st.one_of(st.sampled_from([U64, 2**63, 2**63 - 1, 0, 1, 7, 2**31, 2**32]), u64))
        if draw(st.booleans()):
            layer.num_blocks = 1  # the block stride then spans nothing, so no extent check bounds it
    elif what == "memory":
        memory = draw(memory_handles())
        if memory is None:
            layer.ClearField("memory")
        else:
            layer.memory.CopyFrom(memory)
    elif what == "offset":
        layer.memory.shm.offset = draw(st.one_of(st.sampled_from([1, 7, FUZZ_SHM_BYTES - 8, FUZZ_SHM_BYTES]), u64))
    else:
        layer.group_id = draw(u32)
    return layer


@st.composite
def wild_layer(draw: Any) -> pb.LayerSpec:
    """Every field drawn on its own."""
    kwargs: dict[str, Any] = dict(
        name=draw(st.one_of(st.sampled_from(["l0", "l1"]), bad_texts)),
        dtype=draw(st.one_of(st.sampled_from(["float16", "FP8", "torch.float16"]), bad_texts)),
        segment_bytes=draw(st.one_of(st.sampled_from([0, 1, 8, 1024, 2**30, 2**30 + 1]), u64)),
        segments=draw(st.sampled_from([1, 2, 0, 3, U32])),
        group_id=draw(u32),
        layout_tag=draw(st.one_of(st.just("t"), bad_texts)),
        num_blocks=draw(st.one_of(st.sampled_from([0, 1, 2, 16, U64]), u64)),
        strides=draw(st.lists(st.one_of(st.sampled_from([0, 8, 1024, 65536]), u64), max_size=3)),
    )
    memory = draw(memory_handles())
    if memory is not None:
        kwargs["memory"] = memory
    return pb.LayerSpec(**kwargs)


@st.composite
def registrations(draw: Any, kinds: list[str]) -> Register:
    tp_size = draw(st.sampled_from([1, 1, 2]))
    names = draw(
        st.lists(
            st.sampled_from([f"model.layers.{i}.self_attn.attn" for i in range(4)]), min_size=1, max_size=3, unique=True
        )
    )
    # the descriptors: mostly the good memfd first, then anything
    first = draw(st.one_of(st.just("memfd"), st.sampled_from(kinds)))
    sent = [first, *draw(st.lists(st.sampled_from(kinds), max_size=3))]
    if draw(st.sampled_from([False] * 9 + [True])):
        sent = []
    groups = draw(valid_groups(len(names)))
    mutate = draw(st.sampled_from(["valid", "valid", "one", "one", "wild"]))  # "one": one layer mutated
    if mutate == "valid":
        layers = [draw(valid_layer(n, groups=len(groups) or 1)) for n in names]
    elif mutate == "one":
        bad = draw(st.integers(0, len(names) - 1))
        layers = [
            draw(mutated_layer(n) if i == bad else valid_layer(n, groups=len(groups) or 1)) for i, n in enumerate(names)
        ]
    else:
        layers = draw(st.lists(wild_layer(), max_size=4))
    request = pb.RegisterRequest(
        instance_id=draw(st.sampled_from(FUZZ_IDS)),
        namespace="ns",
        tp_rank=draw(st.integers(0, tp_size - 1)),
        tp_size=tp_size,
        pp_rank=0,
        world_size=tp_size,
        block_size=16,
        layers=layers,
        groups=groups,
    )
    if draw(st.sampled_from([False, False, False, True])):  # and/or an instance-wide field out of range, or naming
        # the owners' instances
        what = draw(
            st.sampled_from(
                ["instance_id", "namespace", "tp_rank", "tp_size", "pp_rank", "world_size", "block_size", "groups"]
            )
        )
        if what == "instance_id":
            request.instance_id = draw(any_instance)
        elif what == "namespace":
            request.namespace = draw(namespaces)
        elif what == "groups":
            del request.groups[:]
            request.groups.extend(draw(wild_groups()))
        elif what == "block_size":
            request.block_size = draw(st.one_of(st.sampled_from([0, 2**20, 2**20 + 1]), u32))
        else:
            setattr(request, what, draw(st.one_of(st.integers(0, 4), u32)))
    return Register(request, sent)


@st.composite
def preludes(draw: Any) -> Call:
    """A valid registration of fz-a by the burst's session (sealed when tp_size is 1), so that the calls after it
    reach the data path: block ranges, the store, copies, leases."""
    tp_size = draw(st.sampled_from([1, 1, 2]))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(draw(st.integers(1, 3)))]
    layers = [draw(valid_layer(n)) for n in names]
    groups = draw(valid_groups(len(names)))
    for i, layer in enumerate(layers):
        layer.num_blocks = BLOCKS  # every block id below BLOCKS is in range
        layer.group_id = i % len(groups) if groups else 0  # every group has a layer
    request = _register_request("fz-a", layers, tp_size, groups)
    return Call("REGISTER", "answer", [fq.encode_register(request.SerializeToString())], ["memfd"], request=request)


# ---- calls


@dataclass
class Call:
    """One step of a burst. `how`: "answer" (a complete frame: an answer must come, the connection stays open),
    "hangup" (a header the lane refuses: INVALID_ARGUMENT, then the engine closes), "silent" (a frame cut short,
    then end of stream: no answer), "pipelined" (several complete frames in one write, as many answers),
    "reconnect" (a new session), or "grpc"."""

    name: str
    how: str
    frames: list[bytes] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)  # descriptors sent with the first frame
    split: int = 0
    method: str = ""
    request: Any = None

    def __repr__(self) -> str:
        what = repr(self.request) if self.request is not None else repr([f[:200] for f in self.frames])
        return f"Call({self.name}, {self.how}, kinds={self.kinds}, split={self.split}, {what[:1500]})"


@st.composite
def lane_frames(draw: Any, kinds: list[str]) -> tuple[str, bytes, list[str], Any]:
    """(name, frame, descriptor kinds, the request it encodes) for one well-formed lane frame."""
    op = draw(st.sampled_from(["REGISTER"] * 3 + ["SAVE"] * 4 + ["LOAD"] * 4 + ["QUERY", "RELEASE", "UNREG", "HELLO"]))
    fds: list[str] = []
    if draw(st.sampled_from([False] * 7 + [True])):  # descriptors where none are expected
        fds = draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=3))
    if op == "REGISTER":
        reg = draw(registrations(kinds))
        return op, fq.encode_register(reg.request.SerializeToString()), reg.kinds, reg.request
    if op in ("SAVE", "LOAD"):
        key = draw(worker_keys())
        hs, ids = draw(hashes_and_ids())
        if op == "SAVE":
            return op, fq.encode_save(key, hs, ids), fds, (key, hs, ids)
        lease = draw(st.one_of(st.integers(0, 30), u64))
        return op, fq.encode_load(key, hs, ids, lease), fds, (key, hs, ids, lease)
    if op == "QUERY":
        instance, hs, ttl = draw(any_instance), draw(lane_hashes), draw(st.one_of(st.sampled_from([0, 1]), u32))
        return op, fq.encode_query(instance, hs, ttl), fds, (instance, hs, ttl)
    if op == "RELEASE":
        instance, lease = draw(any_instance), draw(st.one_of(st.integers(0, 30), u64))
        return op, fq.encode_release(instance, lease), fds, (instance, lease)
    if op == "UNREG":
        key = draw(worker_keys())
        return op, fq.encode_unregister(key), fds, key
    token = draw(st.one_of(st.just(""), texts))
    return op, fq.encode_hello(token), fds, token


def _header(length: int, op: int) -> bytes:
    return struct.pack("<IB", length, op)


@st.composite
def mutated(draw: Any, body: bytes) -> bytes:
    b = bytearray(body)
    how = draw(st.sampled_from(["flip", "flip", "truncate", "extend", "splice"]))
    if how == "flip" and b:
        for _ in range(draw(st.integers(1, 4))):
            b[draw(st.integers(0, len(b) - 1))] = draw(st.integers(0, 255))
    elif how == "truncate":
        del b[draw(st.integers(0, len(b))) :]
    elif how == "extend":
        b += draw(st.binary(min_size=1, max_size=16))
    else:
        at = draw(st.integers(0, len(b)))
        b[at:at] = draw(st.binary(min_size=1, max_size=8))
    return bytes(b)


@st.composite
def calls(draw: Any, kinds: list[str]) -> Call:
    kind = draw(
        st.sampled_from(
            ["lane"] * 8 + ["mutated"] * 2 + ["random", "header", "cut", "pipelined"] + ["roundtrip", "grpc", "grpc"]
        )
    )
    if draw(st.sampled_from([False] * 30 + [True])):
        return Call("reconnect", "reconnect")
    if kind == "lane":
        name, frame, fds, request = draw(lane_frames(kinds))
        split = draw(st.sampled_from([0, 0, 1, 5, len(frame) // 2]))
        return Call(name, "answer", [frame], fds, split, request=request)
    if kind == "mutated":  # a valid frame whose body was damaged; the header still tells its true length
        name, frame, fds, request = draw(lane_frames(kinds))
        body = draw(mutated(frame[5:]))
        return Call(f"{name} (mutated)", "answer", [_header(len(body), frame[4]) + body], fds, request=request)
    if kind == "random":  # any known op with any body
        op = draw(st.sampled_from(sorted(fq.FRAME_LIMITS)))
        body = draw(st.binary(max_size=300))
        fds = draw(st.lists(st.sampled_from(kinds), max_size=2)) if op == fq.OP_REGISTER else []
        return Call(f"random {fq.OP_NAMES[op]}", "answer", [_header(len(body), op) + body], fds)
    if kind == "header":  # a header the lane refuses at once: unknown op, or a body over its op's limit
        if draw(st.booleans()):
            op = draw(st.integers(0, 255).filter(lambda o: o not in fq.FRAME_LIMITS))
            return Call("unknown op", "hangup", [_header(draw(st.integers(0, 64)), op)])
        op = draw(st.sampled_from(sorted(fq.FRAME_LIMITS)))
        length = draw(st.one_of(st.just(fq.FRAME_LIMITS[op] + 1), st.integers(fq.FRAME_LIMITS[op] + 1, U32)))
        return Call(f"oversized {fq.OP_NAMES[op]}", "hangup", [_header(length, op)])
    if kind == "cut":  # a frame cut short, then end of stream
        name, frame, fds, _ = draw(lane_frames(kinds))
        return Call(f"{name} (cut)", "silent", [frame[: draw(st.integers(0, len(frame) - 1))]], fds)
    if kind == "roundtrip":  # a save of fuzz hashes, then a load of them into other blocks: the copies both ways
        start = draw(st.integers(0, len(FUZZ_HASHES) - 1))
        hs = FUZZ_HASHES[start : start + draw(st.integers(1, len(FUZZ_HASHES)))]
        src = draw(st.lists(st.integers(0, BLOCKS - 1), min_size=len(hs), max_size=len(hs)))
        dst = draw(st.lists(st.integers(0, BLOCKS - 1), min_size=len(hs), max_size=len(hs)))
        key = ("fz-a", 0, 0)
        return Call("roundtrip", "pipelined", [fq.encode_save(key, hs, src), fq.encode_load(key, hs, dst)])
    if kind == "pipelined":  # the first frame's descriptors go with the first write, as a client would send them
        drawn = [draw(lane_frames(kinds)) for _ in range(draw(st.integers(2, 4)))]
        return Call("pipelined", "pipelined", [f[1] for f in drawn], drawn[0][2])
    method = draw(st.sampled_from(["Query", "Query", "Release", "Info"]))
    if method == "Query":
        request: Any = pb.QueryRequest(
            instance_id=draw(any_instance),
            block_hashes=draw(any_hashes),
            request_id=draw(st.one_of(st.just(""), texts, st.text(min_size=250, max_size=300))),
            lease_ttl_ms=draw(st.one_of(st.sampled_from([0, 1, 3_600_000, 3_600_001]), u32)),
        )
    elif method == "Release":
        request = pb.ReleaseRequest(instance_id=draw(any_instance), lease_id=draw(st.one_of(st.integers(0, 30), u64)))
    else:
        request = pb.InfoRequest()
    return Call(f"grpc.{method}", "grpc", method=method, request=request)


# -------------------------------------------------------------------- running calls


class Fuzzer:
    """Runs calls on one lane connection at a time (a session), reconnecting where the engine hangs up."""

    def __init__(self, setup: Setup, prelude: Call | None) -> None:
        self.setup = setup
        self.prelude = prelude
        self.conn = LaneConn(setup.lane_path)
        if prelude is not None:
            self.run(prelude)

    def close(self) -> None:
        self.conn.close()

    def reconnect(self) -> None:
        """A new connection: a new session, which registers the prelude's worker again (as a worker would once
        its session is gone)."""
        self.conn.close()
        self.conn = LaneConn(self.setup.lane_path)
        if self.prelude is not None:
            self.run(self.prelude)

    def run(self, call: Call) -> None:
        s = self.setup
        s.made[call.name.split(" ")[0]] += 1
        if call.how == "reconnect":
            self.reconnect()
            return
        if call.how == "grpc":
            try:
                getattr(s.stub, call.method)(call.request, timeout=30)
            except grpc.RpcError as e:
                assert e.code() in ALLOWED_GRPC, f"{call!r} answered {e.code().name}: {e.details()}"
            return
        fds = [s.descriptors.fds[k] for k in call.kinds]
        if call.how == "pipelined":
            self.conn.send(b"".join(call.frames), fds, len(call.frames[0]))
            for i in range(len(call.frames)):
                self._check_answer(call, self.conn.reply(), i)
            return
        (frame,) = call.frames
        if call.how == "silent":
            if frame:
                self.conn.send(frame, fds)
            self.conn.sock.shutdown(socket.SHUT_WR)
            reply = self.conn.reply()
            assert reply is None, f"{call!r}: the engine answered an incomplete frame with {reply!r}"
            self.reconnect()
            return
        try:
            self.conn.send(frame, fds, call.split)
        except (BrokenPipeError, ConnectionResetError):
            raise AssertionError(f"{call!r}: the engine closed the connection before the frame was sent") from None
        reply = self.conn.reply()
        if call.how == "hangup":
            assert reply is not None and reply[0] == INVALID, f"{call!r}: answered {reply!r}"
            assert self.conn.reply() is None, f"{call!r}: the engine kept the connection"
            self.reconnect()
            return
        self._check_answer(call, reply)

    def _check_answer(self, call: Call, reply: tuple[int, bytes] | None, index: int = 0) -> None:
        """An answer came, with an allowed code, or OK and the shape of its op's answer; tallies how deep it got."""
        assert reply is not None, f"{call!r}: the engine hung up on complete frame {index} instead of answering"
        code, body = reply
        op = call.frames[index][4]
        name = fq.STATUS_NAMES.get(code, str(code))
        self.setup.answers[fq.OP_NAMES.get(op, "?"), name] += 1
        if code != 0:
            assert code in ALLOWED_LANE, f"{call!r} answered {name}: {body.decode(errors='replace')}"[:6000]
            return
        deep = False
        if op == fq.OP_REGISTER:
            status = pb.InstanceStatus.FromString(body)
            assert status.registered >= 1 and status.world_size >= 1
            deep = status.sealed
        elif op in (fq.OP_SAVE, fq.OP_SAVE_GROUPS):
            deep = fq.decode_save_ok(body)[0] > 0  # written: copied out of the worker's memory
        elif op in (fq.OP_LOAD, fq.OP_LOAD_GROUPS):
            outcome, loaded, _, _ = fq.decode_load_ok(body)
            assert outcome in fq.OUTCOMES.values()
            deep = loaded > 0  # copied into the worker's memory
        elif op == fq.OP_QUERY:
            deep = fq.decode_query_ok(body)[0] > 0  # hits: a lease
        elif op == fq.OP_UNREGISTER:
            assert len(body) == 4
        else:
            assert body == b"", (call, body)
        if deep:
            self.setup.answers[fq.OP_NAMES[op], "deep"] += 1


def check_engine_healthy(setup: Setup) -> None:
    """Alive, serving, the valid instance byte-exact; once the fuzzing sessions are gone, nothing they registered
    and no descriptor they sent is left."""
    engine = setup.engine
    assert engine.alive()
    assert "Traceback" not in engine.stderr(), engine.stderr()
    health = health_pb2_grpc.HealthStub(setup.channel)
    r = health.Check(health_pb2.HealthCheckRequest(service="kvseal.v1.Engine"), timeout=10)
    assert r.status == health_pb2.HealthCheckResponse.SERVING
    for path in ("/health", "/metrics", "/v1/namespaces", "/v1/instances"):
        assert engine.get(path)[0] == 200, path
    # the valid instance still serves its four blocks, byte-exact, into other block ids
    by_grpc = setup.stub.Query(pb.QueryRequest(instance_id=VALID, block_hashes=VALID_HASHES), timeout=10)
    assert by_grpc.hits == 4
    setup.stub.Release(pb.ReleaseRequest(instance_id=VALID, lease_id=by_grpc.lease_id), timeout=10)
    valid = setup.valid
    q = valid.client.query(VALID, VALID_HASHES)
    assert q.hits == 4
    valid.shared.array[[8, 9, 10, 11, 24, 25, 26, 27]] = 0
    r = valid.client.load(valid.key, VALID_HASHES, [8, 9, 10, 11], lease_id=q.lease_id)
    assert (r.outcome, r.loaded) == (pb.LoadResponse.LOADED, 4)
    assert valid.blocks([8, 9, 10, 11]) == setup.original
    assert valid.client.session_alive() and setup.half.client.session_alive()

    def settled() -> bool:
        instances = sorted(i["instance_id"] for i in engine.get_json("/v1/instances"))
        return instances == [HALF, VALID] and engine_fds(engine) == setup.baseline_fds

    wait_until(settled, 10, "the engine to drop the closed sessions' instances and descriptors")


# -------------------------------------------------------------------- tests


def test_malformed_call_bursts(setup: Setup) -> None:
    kinds = setup.descriptors.kinds

    @settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(
        prelude=st.one_of(preludes(), preludes(), preludes(), st.none()),
        burst=st.lists(calls(kinds), min_size=1, max_size=8),
    )
    def bursts(prelude: Call | None, burst: list[Call]) -> None:
        fuzzer = Fuzzer(setup, prelude)
        try:
            for call in burst:
                fuzzer.run(call)
        finally:
            fuzzer.close()

    bursts()
    made, answers = setup.made, setup.answers
    every = ["REGISTER", "SAVE", "LOAD", "QUERY", "RELEASE", "UNREG", "HELLO", "random", "unknown", "oversized"]
    every += ["pipelined", "grpc.Query", "grpc.Release", "grpc.Info"]
    assert sum(made.values()) >= 300 and all(made[name] for name in every), made
    # the bursts reached the deep paths: seals, copies both ways, leases, and each refusal of the trust model
    deep = ["Register", "Save", "Load"]
    assert all(answers[name, "deep"] for name in deep), answers
    for code in ("PERMISSION_DENIED", "FAILED_PRECONDITION", "NOT_FOUND", "INVALID_ARGUMENT"):
        assert sum(n for (_, c), n in answers.items() if c == code), (code, answers)
    check_engine_healthy(setup)


def test_every_kind_of_descriptor(setup: Setup) -> None:
    """A registration whose one layer is on each kind of descriptor in turn: only a read-write memfd sealed against
    shrinking is mapped; every other kind is INVALID_ARGUMENT naming the field, and nothing stays registered."""
    layer = pb.LayerSpec(
        name="l0",
        dtype="float16",
        segment_bytes=4096,
        segments=1,
        layout_tag="t",
        num_blocks=1,
        strides=[4096],
        memory=pb.MemoryHandle(shm=pb.ShmHandle(fd=0, offset=0, size=4096)),
    )
    frame = fq.encode_register(_register_request("fz-kinds", [layer]).SerializeToString())
    answers = {}
    with LaneConn(setup.lane_path) as conn:
        for kind, fd in setup.descriptors.fds.items():
            reply = conn.call(frame, [fd])
            assert reply is not None, kind
            answers[kind] = fq.STATUS_NAMES.get(reply[0], str(reply[0])), reply[1].decode(errors="replace")
            if reply[0] == 0:
                assert conn.call(fq.encode_unregister(("fz-kinds", 0, 0))) == (0, struct.pack("<I", 0))
    accepted = {kind for kind, (code, _) in answers.items() if code == "OK"}
    assert accepted == {"memfd", "memfd-small"}, answers
    for kind, (code, message) in answers.items():
        if kind not in accepted:
            assert code == "INVALID_ARGUMENT" and "layers[0].memory.shm" in message, (kind, code, message)
    check_engine_healthy(setup)


def test_other_sessions_cannot_touch_the_owners_workers(setup: Setup) -> None:
    """Another connection of the same user may query the owners' instances, but not register over, save, load or
    unregister their workers, whatever it sends with it."""
    layer = pb.LayerSpec(
        name="model.layers.0.self_attn.attn",
        dtype="float16",
        segment_bytes=SEGMENT,
        segments=1,
        layout_tag=LAYOUT_TAG,
        num_blocks=BLOCKS,
        strides=[SEGMENT],
        memory=pb.MemoryHandle(shm=pb.ShmHandle(fd=0, offset=0, size=FUZZ_SHM_BYTES)),
    )
    denied = fq.STATUS_CODES["PERMISSION_DENIED"]
    with LaneConn(setup.lane_path) as conn:
        for instance_id, tp_size in ((VALID, 1), (HALF, 2)):
            request = _register_request(instance_id, [layer], tp_size)
            request.namespace = f"fuzz-{instance_id}"
            reply = conn.call(fq.encode_register(request.SerializeToString()), [setup.descriptors.fds["memfd"]])
            assert reply is not None and reply[0] == denied and b"another session" in reply[1], reply
            key = (instance_id, 0, 0)
            for frame in (
                fq.encode_save(key, FUZZ_HASHES[:2], [0, 1]),
                fq.encode_load(key, VALID_HASHES, [8, 9, 10, 11]),
                fq.encode_unregister(key),
            ):
                reply = conn.call(frame)
                assert reply is not None and reply[0] == denied and b"another session" in reply[1], reply
        reply = conn.call(fq.encode_query(VALID, VALID_HASHES))
        assert reply is not None and reply[0] == 0
        hits, lease_id, _, _, _ = fq.decode_query_ok(reply[1])
        assert hits == 4
        assert conn.call(fq.encode_release(VALID, lease_id)) == (0, b"")
    check_engine_healthy(setup)


def test_oversized_requests(setup: Setup) -> None:
    too_many = [b"h"] * (MAX_BLOCKS_PER_REQUEST + 1)
    with pytest.raises(grpc.RpcError) as info:
        setup.stub.Query(pb.QueryRequest(instance_id=VALID, block_hashes=too_many), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with LaneConn(setup.lane_path) as conn:
        for frame in (
            fq.encode_save((VALID, 0, 0), too_many, [0] * len(too_many)),
            fq.encode_query(VALID, too_many),
            fq.encode_load((VALID, 0, 0), [b"h" * 65], [0]),
        ):
            reply = conn.call(frame)
            assert reply is not None and reply[0] == INVALID, reply
        # 10^6 tiny layers: within the frame limit, refused from the wire format at the 4097th
        million = b"\x0a\x05fz-mm" + b"\x42\x00" * 1_000_000
        reply = conn.call(fq.encode_register(million))
        assert reply is not None and reply[0] == INVALID and f"at most {MAX_LAYERS} layers" in reply[1].decode()
        # the most descriptors one frame may carry: all delivered, the one indexed mapped, every one closed after
        memfd = setup.descriptors.fds["memfd"]
        layer = pb.LayerSpec(
            name="l0",
            dtype="float16",
            segment_bytes=64,
            segments=1,
            layout_tag="t",
            num_blocks=4,
            strides=[64],
            memory=pb.MemoryHandle(shm=pb.ShmHandle(fd=fq.MAX_FDS - 1, offset=0, size=FUZZ_SHM_BYTES)),
        )
        small = setup.descriptors.fds["memfd-small"]
        fds = [small] * (fq.MAX_FDS - 1) + [memfd]
        reply = conn.call(fq.encode_register(_register_request("fz-many", [layer]).SerializeToString()), fds)
        assert reply is not None and reply[0] == 0, reply
        assert pb.InstanceStatus.FromString(reply[1]).sealed
        assert conn.call(fq.encode_unregister(("fz-many", 0, 0))) == (0, struct.pack("<I", 0))
        assert conn.call(fq.encode_hello("")) == (0, b"")  # the connection still serves
    for op, limit in fq.FRAME_LIMITS.items():  # a header over the op's limit: refused before any body is sent
        with LaneConn(setup.lane_path) as conn:
            conn.send(_header(limit + 1, op))
            reply = conn.reply()
            assert reply is not None and reply[0] == INVALID and b"limit" in reply[1], (op, reply)
            assert conn.reply() is None
    big = b"\x00" * (65 << 20)
    with pytest.raises(grpc.RpcError) as info:
        setup.stub.Query(pb.QueryRequest(instance_id=VALID, block_hashes=[big]), timeout=60)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    del big
    check_engine_healthy(setup)


def test_page_larger_than_a_slab_is_refused_cleanly(setup: Setup) -> None:
    """Ten 1 MiB layers (views of one 1 MiB memfd) make a 10 MiB page: more than the 8 MiB slab. The seal is
    refused with RESOURCE_EXHAUSTED and leaves no instance behind."""
    shared = SharedArray((1, FUZZ_SHM_BYTES))
    layers = [layer_from_array(f"big.{i}", shared.array, shared, layout_tag="t", dtype="uint8") for i in range(10)]
    fields = dict(instance_id="too-big", namespace="ns", tp_rank=0, tp_size=1, pp_rank=0, world_size=1, block_size=16)
    try:
        with EngineClient(setup.engine.target) as client:
            with pytest.raises(ResourceExhausted, match="--pool-size"):
                client.register(layers=layers, **fields)
            assert all(i["instance_id"] != "too-big" for i in setup.engine.get_json("/v1/instances"))
            status = client.register(layers=layers[:7], **fields)  # 7 MiB fits
            assert status.sealed and status.page_bytes == 7 * FUZZ_SHM_BYTES
            assert client.unregister(("too-big", 0, 0)) == 0
    finally:
        shared.close()
    check_engine_healthy(setup)


def _one_layer(fd: int, instance_id: str = "fz-regress", namespace: str = "ns", **changes: Any) -> Any:
    layer = pb.LayerSpec(
        name="model.layers.0.self_attn.attn",
        dtype="float16",
        segment_bytes=SEGMENT,
        segments=1,
        layout_tag=LAYOUT_TAG,
        num_blocks=BLOCKS,
        strides=[SEGMENT],
        memory=pb.MemoryHandle(shm=pb.ShmHandle(fd=fd, offset=0, size=FUZZ_SHM_BYTES)),
    )
    for key, value in changes.items():
        if key == "strides":
            layer.strides[:] = value
        else:
            setattr(layer, key, value)
    return dict(
        instance_id=instance_id,
        namespace=namespace,
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        world_size=1,
        block_size=16,
        layers=[layer],
    )


@pytest.mark.parametrize(
    "case",
    [
        "block-stride-2**64-1-one-block",
        "block-stride-2**63-one-block",
        "newline-after-instance-id",
        "newline-after-namespace",
        "newline-after-layer-name",
        "write-sealed-memfd",
    ],
)
def test_regressions_found_by_fuzzing(setup: Setup, case: str) -> None:
    """Registrations the fuzzer found answered INTERNAL (or accepted) before the fixes: a block stride above 2**63
    on a one-block layer (OverflowError from numpy at seal, after the instance was already marked sealed), names
    with a trailing newline, which `^...$` patterns let through, and a memfd sealed against writes as well as
    shrinking (mmap of it read-write fails with EPERM)."""
    fds = setup.descriptors.fds
    memfd = fds["memfd"]
    request = {
        "block-stride-2**64-1-one-block": lambda: _one_layer(memfd, num_blocks=1, strides=[U64]),
        "block-stride-2**63-one-block": lambda: _one_layer(memfd, num_blocks=1, strides=[2**63]),
        "newline-after-instance-id": lambda: _one_layer(memfd, instance_id="fz-regress\n"),
        "newline-after-namespace": lambda: _one_layer(memfd, namespace="ns\n"),
        "newline-after-layer-name": lambda: _one_layer(memfd, name="model.layers.0.self_attn.attn\n"),
        "write-sealed-memfd": lambda: _one_layer(fds["memfd-write-sealed"]),
    }[case]()
    with EngineClient(setup.engine.target) as client:
        with pytest.raises(InvalidArgument):
            client.register(**request)
        # nothing half-registered is left behind
        with pytest.raises(NotFound):
            client.save((request["instance_id"], 0, 0), [b"h"], [0])
        # the largest stride numpy takes is fine
        ok = _one_layer(memfd, instance_id="fz-regress-ok", num_blocks=1, strides=[2**63 - 1])
        assert client.register(**ok).sealed
        assert client.save(("fz-regress-ok", 0, 0), [case.encode()], [0]).written == 1
        assert client.unregister(("fz-regress-ok", 0, 0)) == 0
    check_engine_healthy(setup)


# -------------------------------------------------------------------- fields over their limits (issue 19, item 12)

MB = 1 << 20
U16_MAX = 0xFFFF  # the lane frames instance_id, request_id and the token with a u16 length: their longest


def _cuda_layer(**handles: bytes) -> pb.LayerSpec:
    cuda = pb.CudaIpcHandle(storage_size=8, **handles)
    return pb.LayerSpec(
        name="l0",
        dtype="float16",
        segment_bytes=8,
        segments=1,
        layout_tag="t",
        num_blocks=1,
        strides=[8],
        memory=pb.MemoryHandle(cuda=cuda),
    )


def _register_body(**changes: Any) -> bytes:
    """A valid one-layer RegisterRequest (no descriptor travels: the length checks come first) with `changes`:
    instance_id/namespace, or layer fields."""
    request = pb.RegisterRequest(**_one_layer(0, instance_id=changes.pop("instance_id", "fz-long")))
    if "namespace" in changes:
        request.namespace = changes.pop("namespace")
    request.groups.extend(changes.pop("groups", []))
    if "layer" in changes:
        request.layers[0].CopyFrom(changes.pop("layer"))
    layer = request.layers[0]
    for key, value in changes.items():
        if key == "strides":
            layer.strides[:] = value
        else:
            setattr(layer, key, value)
    return request.SerializeToString()


GRPC_LONG = {  # field -> (method, request)
    "Describe.instance_id": ("Describe", lambda s: pb.DescribeRequest(instance_id="x" * MB)),
    "Query.instance_id": ("Query", lambda s: pb.QueryRequest(instance_id="x" * MB, block_hashes=VALID_HASHES)),
    "Query.request_id": ("Query", lambda s: pb.QueryRequest(instance_id=VALID, request_id="r" * MB)),
    "Query.block_hashes[0]": ("Query", lambda s: pb.QueryRequest(instance_id=VALID, block_hashes=[b"h" * MB])),
    "Query.block_hashes": ("Query", lambda s: pb.QueryRequest(instance_id=VALID, block_hashes=[b"h"] * MB)),
    "Release.instance_id": ("Release", lambda s: pb.ReleaseRequest(instance_id="x" * MB, lease_id=1)),
    "Compare.namespace_final": ("Compare", lambda s: pb.CompareRequest(namespace_final="n" * MB)),
    "Compare.other_namespace_final": (
        "Compare",
        lambda s: pb.CompareRequest(namespace_final=s.valid.status.namespace_final, other_namespace_final="n" * MB),
    ),
    "Compare.other_descriptor": (  # 1 MB is within its limit: read, and refused as no descriptor
        "Compare",
        lambda s: pb.CompareRequest(namespace_final=s.valid.status.namespace_final, other_descriptor=b"{" * MB),
    ),
    "Compare.other_descriptor (5 MiB)": (
        "Compare",
        lambda s: pb.CompareRequest(namespace_final=s.valid.status.namespace_final, other_descriptor=b"{" * 5 * MB),
    ),
}

LANE_LONG = {  # field -> frame
    "token": lambda: fq.encode_hello("t" * U16_MAX),
    "Query.instance_id": lambda: fq.encode_query("x" * U16_MAX, VALID_HASHES),
    "Query.request_id": lambda: fq.encode_query(VALID, VALID_HASHES, request_id="r" * U16_MAX),
    "Query.block_hashes": lambda: fq.encode_query(VALID, [b"h"] * MB),
    "Release.instance_id": lambda: fq.encode_release("x" * U16_MAX, 1),
    "Save.instance_id": lambda: fq.encode_save(("x" * U16_MAX, 0, 0), VALID_HASHES, [0, 1, 2, 3]),
    "Save.block_hashes": lambda: fq.encode_save(("fz-a", 0, 0), [b"h"] * MB, [0] * MB),
    "Load.instance_id": lambda: fq.encode_load(("x" * U16_MAX, 0, 0), VALID_HASHES, [0, 1, 2, 3]),
    "Unregister.instance_id": lambda: fq.encode_unregister(("x" * U16_MAX, 0, 0)),
    "Register.instance_id": lambda: fq.encode_register(_register_body(instance_id="x" * MB)),
    "Register.namespace": lambda: fq.encode_register(_register_body(namespace="n" * MB)),
    "Register.layers[0].name": lambda: fq.encode_register(_register_body(name="l" * MB)),
    "Register.layers[0].dtype": lambda: fq.encode_register(_register_body(dtype="d" * MB)),
    "Register.layers[0].layout_tag": lambda: fq.encode_register(_register_body(layout_tag="t" * MB)),
    "Register.layers[0].strides": lambda: fq.encode_register(_register_body(strides=[1] * MB)),
    "Register.groups": lambda: fq.encode_register(_register_body(groups=[pb.KvGroup(kind="full")] * (MB // 8))),
    "Register.groups[0].kind": lambda: fq.encode_register(_register_body(groups=[pb.KvGroup(kind="k" * MB)])),
    **{
        f"Register.layers[0].memory.cuda.{name}": lambda name=name: fq.encode_register(  # type: ignore[misc]
            _register_body(layer=_cuda_layer(**{name: b"c" * MB}))
        )
        for name in ("handle", "ref_counter_handle", "event_handle")
    },
}


def _field_named(case: str) -> str:
    """The field a message must name: 'Query.block_hashes[0]' -> 'block_hashes[0]'."""
    return case.split(" ")[0].split(".", 1)[-1]


@pytest.mark.parametrize("case", list(GRPC_LONG))
def test_a_long_field_on_grpc_is_invalid_argument_naming_it_briefly(setup: Setup, case: str) -> None:
    """Issue 19, item 12: a 1 MB instance_id on Query once answered gRPC's "metadata size exceeds hard limit" (the
    engine echoed it in its error). Every field over its limit is INVALID_ARGUMENT naming it in a short message."""
    method, request = GRPC_LONG[case]
    with pytest.raises(grpc.RpcError) as info:
        getattr(setup.stub, method)(request(setup), timeout=30)
    message = info.value.details() or ""
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, info.value.code(), message[:300])
    assert _field_named(case) in message and len(message.encode()) < 200, (case, message[:300])


@pytest.mark.parametrize("case", list(LANE_LONG))
def test_a_long_field_on_the_lane_is_invalid_argument_naming_it_briefly(setup: Setup, case: str) -> None:
    """The lane's fields framed with a u16 length are sent at their longest (64 KiB - 1), the others at 1 MB."""
    with LaneConn(setup.lane_path) as conn:
        reply = conn.call(LANE_LONG[case]())
        assert reply is not None, case
        code, body = reply
        message = body.decode()
        assert code == INVALID, (case, code, message[:300])
        assert _field_named(case) in message and len(body) < 200, (case, message[:300])
        assert conn.call(fq.encode_hello("")) == (0, b"")  # the connection still serves
