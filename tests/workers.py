"""Worker processes for process-level tests: each holds CPU torch KV tensors shared with the engine through
kvseal.client.layer_from_tensor, and obeys commands sent over a pipe.

Workers are separate Python processes made by a multiprocessing *forkserver* that has imported torch once
(importing torch takes seconds on a 2-CPU machine; forking the server takes milliseconds). The forkserver is
itself a fresh interpreter, not a fork of the test process, so a worker shares no threads, channels or state
with pytest.

    w = Worker.start(engine.target)            # returns at once; the first command waits for the process
    status = w.register(instance_id="A", namespace="m", tp_rank=0, tp_size=2, world_size=2, layers=layers, seed=1)
    w.save(hashes, block_ids); w.read(block_ids) -> {layer name: [bytes of each block]}

Errors the engine answers come back as the kvseal.errors exception the client raised (same class and message).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvseal import errors

CALL_TIMEOUT_S = 60.0
KV_SHAPE = (32, 2, 16, 32)  # [num_blocks, kv heads, block_size, 2 * head_size] per rank

_CTX: Any = None


def context() -> Any:
    global _CTX
    if _CTX is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "numpy", "kvseal.errors"])
        _CTX = ctx
    return _CTX


@dataclass(frozen=True)
class LayerDef:
    name: str
    shape: tuple[int, ...] = KV_SHAPE
    dtype: str = "float16"
    layout_tag: str = "cpu-LBHNC"


def attn_layers(n: int, **kwargs: Any) -> list[LayerDef]:
    return [LayerDef(f"model.layers.{i}.self_attn.attn", **kwargs) for i in range(n)]


class WorkerDied(Exception):
    pass


class Worker:
    """The test's handle on one worker process."""

    def __init__(self, target: str, token: str | None = None, name: str = "worker") -> None:
        ctx = context()
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, target, token), name=name, daemon=True)
        self.process.start()
        child.close()
        self.name = name
        self._ready = False
        self.worker_key: tuple[str, int, int] | None = None

    @classmethod
    def start(cls, target: str, token: str | None = None, name: str = "worker") -> Worker:
        return cls(target, token, name)

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def _recv(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"{self.name} (pid {self.pid}) did not answer within {timeout}s")
        try:
            return self._conn.recv()
        except EOFError:
            self.process.join(5)
            raise WorkerDied(f"{self.name} exited with {self.process.exitcode}") from None

    def call(self, command: str, timeout: float = CALL_TIMEOUT_S, **kwargs: Any) -> Any:
        if not self._ready:
            kind, value = self._recv(timeout)
            assert kind == "ready", (kind, value)
            self._ready = True
        self._conn.send((command, kwargs))
        reply = self._recv(timeout)
        if reply[0] == "ok":
            return reply[1]
        _, cls_name, message, tb = reply
        cls = getattr(errors, cls_name, None)
        if isinstance(cls, type) and issubclass(cls, errors.KvsealError):
            raise cls(message)
        raise RuntimeError(f"{self.name} failed with {cls_name}: {message}\n{tb}")

    # ------------------------------------------------------------ commands

    def register(
        self,
        *,
        instance_id: str,
        namespace: str,
        tp_rank: int,
        tp_size: int,
        world_size: int,
        layers: Sequence[LayerDef],
        seed: int,
        block_size: int = 16,
        one_allocation: bool = False,
    ) -> Any:
        """Allocates (once) and registers KV tensors for `layers`, in that order. Returns pb.InstanceStatus.
        With one_allocation every layer is a view into one tensor, as vLLM allocates them."""
        status = self.call(
            "register",
            instance_id=instance_id,
            namespace=namespace,
            tp_rank=tp_rank,
            tp_size=tp_size,
            world_size=world_size,
            layers=list(layers),
            seed=seed,
            block_size=block_size,
            one_allocation=one_allocation,
        )
        self.worker_key = (instance_id, tp_rank, 0)
        return status

    def reconnect(self) -> None:
        """Closes this worker's lane connection (its session: the engine drops what it registered) and opens a
        new client, as a restarted process would."""
        self.call("reconnect")

    def unregister(self) -> int:
        return self.call("unregister")

    def session_alive(self) -> bool:
        return self.call("session_alive")

    def save(self, hashes: Sequence[bytes], block_ids: Sequence[int]) -> Any:
        return self.call("save", hashes=list(hashes), block_ids=list(block_ids))

    def load(self, hashes: Sequence[bytes], block_ids: Sequence[int], lease_id: int = 0) -> Any:
        return self.call("load", hashes=list(hashes), block_ids=list(block_ids), lease_id=lease_id)

    def query(self, hashes: Sequence[bytes], lease_ttl_ms: int = 0) -> Any:
        return self.call("query", hashes=list(hashes), lease_ttl_ms=lease_ttl_ms)

    def read(self, block_ids: Sequence[int]) -> dict[str, list[bytes]]:
        """The bytes of the given blocks, per layer name."""
        return self.call("read", block_ids=list(block_ids))

    def kill(self) -> None:
        """SIGKILL, as a crash: no goodbye to the engine."""
        os.kill(self.pid, signal.SIGKILL)
        self.process.join(10)
        assert self.process.exitcode == -signal.SIGKILL, self.process.exitcode

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._conn.send(("exit", {}))
            except OSError:
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        self._conn.close()


# ---------------------------------------------------------------- inside the worker process


def _serve(conn: multiprocessing.connection.Connection, target: str, token: str | None) -> None:
    import torch

    torch.set_num_threads(1)
    state = _State(target, token)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            command, kwargs = conn.recv()
        except EOFError:
            return
        if command == "exit":
            state.shutdown()
            return
        try:
            conn.send(("ok", getattr(state, command)(**kwargs)))
        except errors.KvsealError as e:
            conn.send(("err", type(e).__name__, str(e), ""))
        except Exception as e:
            conn.send(("err", type(e).__name__, str(e), traceback.format_exc()))


class _State:
    def __init__(self, target: str, token: str | None) -> None:
        from kvseal.client import EngineClient

        self.target, self.token = target, token
        self.client = EngineClient(target, token=token)
        self.tensors: dict[str, Any] = {}  # layer name -> KV tensor [num_blocks, ...]
        self.order: list[str] = []
        self.key: tuple[str, int, int] | None = None
        self.keep: list[Any] = []  # memory the tensors live in

    def _allocate(self, layers: list[LayerDef], seed: int, one_allocation: bool) -> None:
        import torch

        gen = torch.Generator().manual_seed(seed)
        if one_allocation:
            first = layers[0]
            assert all(layer.shape == first.shape and layer.dtype == first.dtype for layer in layers)
            whole = torch.randn((len(layers), *first.shape), generator=gen).to(getattr(torch, first.dtype))
            for i, layer in enumerate(layers):
                self.tensors[layer.name] = whole[i]
        else:  # separate allocations, each on pages of its own (small heap tensors would share pages)
            from kvseal.memfd import SharedArray

            for layer in layers:
                t = torch.randn(layer.shape, generator=gen).to(getattr(torch, layer.dtype))
                shared = SharedArray((t.numel() * t.element_size(),))
                self.keep.append(shared)
                own = torch.from_numpy(shared.array).view(t.dtype).view(t.shape)
                own.copy_(t)
                self.tensors[layer.name] = own

    def register(
        self,
        *,
        instance_id: str,
        namespace: str,
        tp_rank: int,
        tp_size: int,
        world_size: int,
        layers: list[LayerDef],
        seed: int,
        block_size: int,
        one_allocation: bool,
    ) -> Any:
        from kvseal.client import layer_from_tensor

        missing = [layer for layer in layers if layer.name not in self.tensors]
        if missing:
            self._allocate(missing, seed, one_allocation)
        specs = [
            layer_from_tensor(layer.name, self.tensors[layer.name], layout_tag=layer.layout_tag) for layer in layers
        ]
        status = self.client.register(
            instance_id=instance_id,
            namespace=namespace,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=0,
            world_size=world_size,
            block_size=block_size,
            layers=specs,
        )
        self.key = (instance_id, tp_rank, 0)
        self.order = [layer.name for layer in layers]
        return status

    def reconnect(self) -> None:
        from kvseal.client import EngineClient

        self.client.close()
        self.client = EngineClient(self.target, token=self.token)

    def unregister(self) -> int:
        assert self.key is not None
        return self.client.unregister(self.key)

    def session_alive(self) -> bool:
        return self.client.session_alive()

    def save(self, hashes: list[bytes], block_ids: list[int]) -> Any:
        assert self.key is not None
        return self.client.save(self.key, hashes, block_ids)

    def load(self, hashes: list[bytes], block_ids: list[int], lease_id: int) -> Any:
        assert self.key is not None
        return self.client.load(self.key, hashes, block_ids, lease_id=lease_id)

    def query(self, hashes: list[bytes], lease_ttl_ms: int) -> Any:
        assert self.key is not None
        return self.client.query(self.key[0], hashes, lease_ttl_ms=lease_ttl_ms)

    def read(self, block_ids: list[int]) -> dict[str, list[bytes]]:
        import torch

        out = {}
        for name in self.order:
            t = self.tensors[name]
            out[name] = [t[b].contiguous().view(torch.uint8).numpy().tobytes() for b in block_ids]
        return out

    def shutdown(self) -> None:
        self.client.close()
