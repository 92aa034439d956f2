"""Who is registered, and who may touch it: instances, their workers, the sessions that hold them, and the memory
their workers have the engine map.

Who may do what (the trust model, enforced here): every call names its `Caller`. A worker registers through a
`Session` (one lane connection, whose uid the kernel reported); its worker key, registration and mappings belong to
that session: another session's Save, Load, Unregister or re-Register of it is refused (PERMISSION_DENIED) while the
session lives, and everything goes when the session ends. An instance belongs to the uid of its first worker: its
other workers must have that uid, and only that uid or a privileged caller (the engine's own user, root, a token
holder) may query it or release its leases. Blocks are shared only within one tenant: the instances of one uid
(the engine's own user and root count as one tenant), so no user can read another's prompts by probing hashes, nor
plant blocks another user then loads.

A Registry has no lock of its own: the engine calls it under its lock.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from kvseal.copy.copier import WorkerCopier
from kvseal.core.layout import InstanceRegistry, Layout, SealedInstance, WorkerRegistration
from kvseal.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted, quote
from kvseal.ssd.tier import NamespaceKey

WorkerKey = tuple[str, int, int]  # (instance_id, tp_rank, pp_rank)


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is calling, as the kernel (SO_PEERCRED, the TCP socket table) or the token says."""

    uid: int | None  # None: a token holder, whose uid nobody knows
    pid: int = 0
    privileged: bool = False  # the engine's own user, root, or a token holder: may query any instance


class Session:
    """One lane connection. The workers it registered are its own, and are dropped when it ends."""

    def __init__(self, caller: Caller) -> None:
        self.caller = caller
        self.workers: set[WorkerKey] = set()


@dataclass(frozen=True, slots=True)
class InstanceStatus:
    instance_id: str
    sealed: bool
    registered: int
    world_size: int
    namespace: str = ""
    namespace_final: str = ""
    fingerprint: str = ""
    digest: str = ""
    descriptor: bytes = b""
    num_layers: int = 0
    page_bytes: int = 0
    block_size: int = 0
    tp_size: int = 0


class Worker:
    """One registered worker: its memory, mapped, and (once its instance is sealed) its copier."""

    def __init__(
        self, reg: WorkerRegistration, memories: list[Any], offsets: list[int], mapped_bytes: int, session: Session
    ) -> None:
        self.registration = reg
        self.session = session
        self.memories = memories  # per layer, in registration order
        self.offsets = offsets  # per layer: where its block 0 starts in its memory
        self.mapped_bytes = mapped_bytes  # of the worker's memfds, counted against its uid's cap
        self.num_blocks = min(layer.num_blocks for layer in reg.layers)
        groups = max(len(reg.groups), 1)
        # per group: the block tables a Save or Load must carry for it (0: this worker holds none of its layers)
        self.tables = [0] * groups
        self.group_bytes = [0] * groups  # per group: bytes this worker moves per block
        for layer in reg.layers:
            g = layer.geometry.group_id
            self.tables[g] = max(self.tables[g], layer.table + 1)
            self.group_bytes[g] += layer.geometry.slot_bytes
        # once sealed: per (group, table), the copier of those layers' slots; per group, the page cells it writes
        self.copiers: dict[tuple[int, int], WorkerCopier] = {}
        self.cell_masks: list[int] = []


class Instance:
    def __init__(self, instance_id: str, uid: int | None) -> None:
        self.uid = uid  # the owner: the uid of its first worker
        self.registry = InstanceRegistry(instance_id)
        self.workers: dict[tuple[int, int], Worker] = {}
        self.ns_ids: tuple[int, ...] = ()  # once sealed: the store namespace of each group's pages

    @property
    def ns_id(self) -> int:
        """The store namespace of a one-group instance (the SSD and peer tiers serve only those so far)."""
        return self.ns_ids[0]

    @property
    def instance_id(self) -> str:
        return self.registry.instance_id

    @property
    def sealed(self) -> SealedInstance | None:
        return self.registry.sealed

    @property
    def key(self) -> NamespaceKey:
        """Whose blocks, under which final namespace (sealed instances only)."""
        assert self.sealed is not None
        return tenant(self.uid), self.sealed.namespace_final

    def part_key(self, group: int) -> NamespaceKey:
        """Whose blocks, under which store namespace, for one group's pages (the SSD keeps them apart too)."""
        assert self.sealed is not None
        return tenant(self.uid), self.sealed.parts[group].name

    def status(self) -> InstanceStatus:
        reg = self.registry
        sealed = reg.sealed
        first = next(iter(reg.workers.values()), None)
        base = InstanceStatus(
            instance_id=reg.instance_id,
            sealed=sealed is not None,
            registered=len(reg.workers),
            world_size=reg.world_size or 0,
            namespace=first.namespace if first else "",
            block_size=first.block_size if first else 0,
            tp_size=first.tp_size if first else 0,
        )
        if sealed is None:
            return base
        return dataclasses.replace(
            base,
            namespace_final=sealed.namespace_final,
            fingerprint=sealed.layout.fingerprint,
            digest=sealed.layout.digest.hex(),
            descriptor=sealed.layout.descriptor,
            num_layers=len(sealed.layout.layers),
            page_bytes=sealed.layout.page_bytes,
        )


class Registry:
    def __init__(self, max_mapped_per_uid: int = 0) -> None:
        """`max_mapped_per_uid`: bytes of their memfds that the workers of one uid may have the engine map and fault
        in at once (0: no cap); the engine's own user and root are not capped."""
        self.instances: dict[str, Instance] = {}
        # every layout sealed since start, by namespace_final: one of several groups is stored as a namespace per
        # group, so only this names the whole layout once its instances are gone (Compare)
        self.layouts: dict[str, Layout] = {}
        self.max_mapped_per_uid = max_mapped_per_uid
        self._mapped: dict[int | None, int] = {}  # uid -> bytes its workers have mapped (or are mapping)

    # ---------------------------------------------------------------- registration

    def check_may_register(self, reg: WorkerRegistration, session: Session) -> None:
        inst = self.instances.get(reg.instance_id)
        if inst is None:
            return
        if inst.uid != session.caller.uid:
            raise PermissionDenied(
                f"instance_id {quote(reg.instance_id)} belongs to another user (uid {inst.uid}): pick another "
                "instance_id"
            )
        w = inst.workers.get(reg.key)
        if w is not None and w.session is not session:
            raise PermissionDenied(
                f"worker tp_rank {reg.tp_rank} pp_rank {reg.pp_rank} of instance {quote(reg.instance_id)} is held by "
                f"another session (pid {w.session.caller.pid}); it is released when that session ends"
            )

    def reserve_mapping(self, reg: WorkerRegistration, session: Session, size: int) -> None:
        """Counts `size` bytes of mappings against the session's uid, or refuses them past --max-mapped-per-uid.
        A worker registered again by its session will drop its old mappings: they do not count."""
        uid = session.caller.uid
        used = self._mapped.get(uid, 0)
        inst = self.instances.get(reg.instance_id)
        old = inst.workers.get(reg.key) if inst is not None else None
        replaced = old.mapped_bytes if old is not None and old.session is session else 0
        cap = self.max_mapped_per_uid
        if cap and not same_user(session.caller) and used - replaced + size > cap:
            raise ResourceExhausted(
                f"uid {uid}: this registration maps {_mib(size)} of shared memory and uid {uid}'s workers already "
                f"have {_mib(used - replaced)} mapped, over the engine's cap of {_mib(cap)} per uid "
                "(kvseal serve --max-mapped-per-uid): register fewer or smaller layers, or end other workers"
            )
        self._mapped[uid] = used + size

    def unreserve(self, uid: int | None, size: int) -> None:
        """`size` bytes of mappings no longer count against `uid` (they go with the last view of them)."""
        left = self._mapped.get(uid, 0) - size
        if left > 0:
            self._mapped[uid] = left
        else:
            self._mapped.pop(uid, None)

    def mapped_bytes(self, uid: int) -> int:
        return self._mapped.get(uid, 0)

    def commit(self, inst: Instance, workers: dict[tuple[int, int], Worker], reg: WorkerRegistration) -> None:
        """Makes `workers` (the instance's workers with the new one) the instance's, registered; cannot fail."""
        replaced = inst.workers.get(reg.key)
        new = workers[reg.key]
        if replaced is not None:  # this session registers the worker again: its old mappings go
            self.unreserve(new.session.caller.uid, replaced.mapped_bytes)
        self.instances[reg.instance_id] = inst
        inst.workers = workers
        if inst.sealed is not None:
            self.layouts[inst.sealed.namespace_final] = inst.sealed.layout
        new.session.workers.add((reg.instance_id, *reg.key))

    def drop(self, inst: Instance, key: tuple[int, int]) -> int:
        """Drops one worker (and its instance with its last one). Returns the workers left."""
        w = inst.workers.pop(key)
        w.session.workers.discard((inst.instance_id, *key))
        self.unreserve(w.session.caller.uid, w.mapped_bytes)
        inst.registry.remove(key)
        if not inst.workers:
            del self.instances[inst.instance_id]
        return len(inst.workers)

    def session_workers(self, session: Session) -> list[tuple[Instance, tuple[int, int]]]:
        """The workers `session` holds now (what its end drops)."""
        held = []
        for instance_id, tp_rank, pp_rank in list(session.workers):
            inst = self.instances.get(instance_id)
            w = inst.workers.get((tp_rank, pp_rank)) if inst is not None else None
            if inst is not None and w is not None and w.session is session:
                held.append((inst, (tp_rank, pp_rank)))
        return held

    # ---------------------------------------------------------------- lookup

    def find_instance(self, instance_id: str) -> Instance:
        if not instance_id:
            raise InvalidArgument("instance_id must not be empty")
        inst = self.instances.get(instance_id)
        if inst is None:
            raise NotFound(f"instance_id {quote(instance_id)} is not registered (register its workers first)")
        return inst

    def find_sealed(self, instance_id: str) -> Instance:
        inst = self.find_instance(instance_id)
        if inst.sealed is None:
            raise FailedPrecondition(f"registration incomplete: {inst.registry.progress()} for {quote(instance_id)}")
        return inst

    def find_worker(self, worker: WorkerKey) -> tuple[Instance, Worker]:
        inst = self.find_instance(worker[0])
        w = inst.workers.get((worker[1], worker[2]))
        if w is None:
            raise NotFound(
                f"worker tp_rank {worker[1]} pp_rank {worker[2]} of instance {quote(worker[0])} is not registered"
            )
        return inst, w

    def owned_worker(self, worker: WorkerKey, session: Session) -> tuple[Instance, Worker]:
        inst, w = self.find_worker(worker)
        if w.session is not session:
            raise PermissionDenied(
                f"worker tp_rank {worker[1]} pp_rank {worker[2]} of instance {quote(worker[0])} belongs to another "
                f"session (pid {w.session.caller.pid}): only the connection that registered it may use it"
            )
        return inst, w

    def workers(self) -> int:
        return sum(len(i.workers) for i in self.instances.values())


def same_user(caller: Caller) -> bool:
    return caller.uid in (os.getuid(), 0)


def tenant(uid: int | None) -> int:
    """Whose blocks an instance's are: its owner's uid, with root and the engine's own user as one tenant."""
    assert uid is not None  # instances are registered over the lane, where the kernel names the uid
    return os.getuid() if uid in (os.getuid(), 0) else uid


def check_access(inst: Instance, caller: Caller) -> None:
    if not caller.privileged and caller.uid != inst.uid:
        raise PermissionDenied(f"instance_id {quote(inst.instance_id)} belongs to another user")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
