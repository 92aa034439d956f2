"""The engine: the registry of instances, the store, the arena, the copies and the tiers below, behind one lock.

The trust model (who may register, save, load and query what) is kvseal.engine.registry's; where a miss continues
(SSD, peers) and the I/O that brings blocks back is kvseal.engine.tiers'; the hit on an instance of several KV cache
groups is kvseal.engine.groups'; what the admin endpoints show is kvseal.engine.views'. This module holds the lock
and the data path.

Thread model: lane and gRPC handlers call these methods concurrently. Book-keeping (registry, store) happens under
`_lock`; copies happen outside it on pages the store keeps alive for the copy (inflight for saves, pinned for
loads), so a long copy never blocks queries. A worker's mapped memory stays mapped while any copy still refers
to it, even if the worker is dropped meanwhile (the views keep the mapping alive).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any

from kvseal.core.eviction import EVICTION_POLICIES
from kvseal.core.layout import (
    LayoutDifference,
    SealedInstance,
    WorkerRegistration,
    diff_layouts,
    explain_difference,
    layout_from_descriptor,
    validate_registration,
)
from kvseal.core.store import BlockStore, LoadPlan, SavePlan
from kvseal.engine import attach, views
from kvseal.engine.groups import GroupQueries
from kvseal.engine.lock import LockStatistics, TimedLock
from kvseal.engine.memory import (
    Arena,
    CudaSpec,
    ShmSpec,
)
from kvseal.engine.registry import (
    Caller,
    Instance,
    InstanceStatus,
    Registry,
    Session,
    Worker,
    WorkerKey,
    check_access,
    same_user,
    tenant,
)
from kvseal.engine.results import (
    EngineCounters,
    EngineStatistics,
    LoadResult,
    PeerPin,
    QueryResult,
    SaveResult,
)
from kvseal.engine.tiers import Continuation, PeerSource, Tiers
from kvseal.errors import InvalidArgument, PermissionDenied
from kvseal.limits import MAX_BLOCKS_PER_REQUEST, MAX_HASH_BYTES, MAX_REQUEST_ID_CHARS
from kvseal.ssd.null import NullTier
from kvseal.ssd.tier import Tier
from kvseal.wire.lane import HashArray

__all__ = [
    "SAVE_STEP",
    "Caller",
    "Engine",
    "EngineStatistics",
    "InstanceStatus",
    "LoadResult",
    "PeerPin",
    "PeerSource",
    "QueryResult",
    "SaveResult",
    "Session",
    "WorkerKey",
]

# between two steps of emptying a slab the lock is free this long, so that threads waiting for it get it (a lock
# released and at once taken again by the same thread mostly goes to that thread)
RECLAIM_YIELD_S = 50e-6
SAVE_STEP = 512  # hashes a Save reserves per engine-lock hold (tiny pages, evicting: ~5 ms of bookkeeping)
Run = tuple[int, Sequence[bytes], Sequence[Sequence[int]]]  # (group, hashes, block ids per block table of the group)


class Engine:
    def __init__(
        self,
        pool_bytes: int,
        *,
        slab_bytes: int = 64 << 20,
        prefault: bool = True,
        lease_ttl_s: float = 30.0,
        inflight_timeout_s: float = 60.0,
        eviction: str = EVICTION_POLICIES[0],
        clock: Callable[[], float] = time.monotonic,
        ssd: Tier | None = None,
        max_mapped_per_uid: int = 0,
    ) -> None:
        """`eviction`: the pool's policy (kvseal.core.eviction.EVICTION_POLICIES). `ssd`: an opened SSD tier;
        sealed blocks are written through to it and queries continue from it.
        `max_mapped_per_uid`: bytes of their memfds that the workers of one uid may have the engine map and fault in
        at once (0: no cap); the engine's own user and root are not capped."""
        self.store = BlockStore(
            pool_bytes,
            slab_bytes=slab_bytes,
            clock=clock,
            lease_ttl_s=lease_ttl_s,
            inflight_timeout_s=inflight_timeout_s,
            eviction=eviction,
        )
        self.arena = Arena(self.store.arena_bytes, prefault=prefault)
        self.counters = EngineCounters()
        self._lock = TimedLock()  # every hold is timed: lock_statistics(), /metrics
        self.registry = Registry(max_mapped_per_uid)
        self.tiers = Tiers(self._lock, self.store, self.arena, ssd if ssd is not None else NullTier())
        self._groups = GroupQueries(self._lock, self.store, self.tiers)

    @property
    def pool_bytes(self) -> int:
        """Bytes of the pool's arena (what Info reports)."""
        return self.store.arena_bytes

    def close(self) -> None:
        """Finishes SSD refills, peer fetches and writes (the tier seals its segments). The pool stays mapped."""
        self.tiers.close()

    # ---------------------------------------------------------------- registration

    def register(self, reg: WorkerRegistration, session: Session, fds: Sequence[int] = ()) -> InstanceStatus:
        """Registers one worker for `session`, mapping its memory from `fds` (the descriptors that came with the
        registration; the caller closes them). Seals the instance when it is the last worker. On error nothing
        changes."""
        validate_registration(reg)
        if session.caller.uid is None:
            raise PermissionDenied("workers register over the local lane, where the kernel names their uid")
        if any(isinstance(layer.memory, CudaSpec) for layer in reg.layers) and not same_user(session.caller):
            raise PermissionDenied(
                "CUDA IPC handles are accepted only from the engine's own user or root (the driver does not tie a "
                "handle to the process that exported it): run the engine as the inference server's user"
            )
        for i, layer in enumerate(reg.layers):
            if not isinstance(layer.memory, ShmSpec | CudaSpec):
                raise InvalidArgument(f"layers[{i}].memory must be set (shm or cuda)")
        with self._lock:
            self.registry.check_may_register(reg, session)
        plan = attach.plan_shm(reg, fds)  # checks every descriptor and bound; maps nothing yet
        uid = session.caller.uid
        with self._lock:
            self.registry.reserve_mapping(reg, session, plan.bytes)
        try:
            memories, offsets = attach.map_memory(reg, plan, self.arena)
        except BaseException:
            with self._lock:
                self.registry.unreserve(uid, plan.bytes)
            raise
        with self._lock:
            try:
                self.registry.check_may_register(reg, session)  # again: another session may have come in meanwhile
                inst = self.registry.instances.get(reg.instance_id) or Instance(reg.instance_id, uid)
                before = (dict(inst.registry.workers), inst.registry.sealed)
                workers = {**inst.workers, reg.key: Worker(reg, memories, offsets, plan.bytes, session)}
                try:
                    sealed = inst.registry.add(reg)
                    copiers = {}
                    if sealed is not None:
                        copiers = attach.plan_copies(workers, sealed, self.store.max_page_bytes(), self.arena)
                except Exception:
                    inst.registry.workers, inst.registry.sealed = before
                    raise
            except BaseException:
                self.registry.unreserve(uid, plan.bytes)
                raise
            # nothing below can fail: commit
            self.registry.commit(inst, workers, reg)
            if sealed is not None:
                inst.ns_ids = tuple(self.store.namespace(p.name, p.layout, tenant(inst.uid)) for p in sealed.parts)
                for key, w in workers.items():
                    w.copiers = copiers[key]
                    w.cell_masks = [sealed.cell_mask(key, p.group) for p in sealed.parts]
            return inst.status()

    def unregister(self, worker: WorkerKey, session: Session) -> int:
        """Drops a worker's registration and mappings and every lease of its instance. Returns the workers left."""
        with self._lock:
            inst, _ = self.registry.owned_worker(worker, session)
            return self._drop(inst, (worker[1], worker[2]))

    def _drop(self, inst: Instance, key: tuple[int, int]) -> int:
        left = self.registry.drop(inst, key)
        self.store.release_owner(inst.instance_id)
        return left

    def mapped_bytes(self, uid: int) -> int:
        """Bytes of shared memory the workers of `uid` have the engine map."""
        with self._lock:
            return self.registry.mapped_bytes(uid)

    def close_session(self, session: Session) -> None:
        """The session ended (its connection closed): every worker it registered goes, with its instance's leases."""
        with self._lock:
            for inst, key in self.registry.session_workers(session):
                self._drop(inst, key)
            session.workers.clear()

    # ---------------------------------------------------------------- data path

    def save(
        self, worker: WorkerKey, hashes: Sequence[bytes], block_ids: Sequence[int], session: Session
    ) -> SaveResult:
        """A Save of group 0's blocks through one block table (every layout of one group)."""
        return self.save_groups(worker, [(0, hashes, [block_ids])], session)

    def save_groups(self, worker: WorkerKey, runs: Sequence[Run], session: Session) -> SaveResult:
        """Saves each run's blocks: (group, hashes, block ids per table of that group). A worker that holds none of
        a group's layers skips its runs (another worker writes those pages)."""
        checked = _check_runs(runs, as_lists=True) or [(0, [], [[]])]
        results = [self._save_run(worker, session, *run) for run in checked]
        return SaveResult(
            written=sum(r.written for r in results),
            skipped=sum(r.skipped for r in results),
            not_stored=sum(r.not_stored for r in results),
            completed=sum(r.completed for r in results),
            namespace_final=results[0].namespace_final,
        )

    def _save_run(
        self, worker: WorkerKey, session: Session, group: int, hashes: Sequence[bytes], tables: list[list[int]]
    ) -> SaveResult:
        """Reserves pages for the hashes SAVE_STEP at a time (one engine-lock hold each, so that a Save of
        thousands of tiny blocks does not stall every query), copies every reserved block in one call per table,
        then finishes the steps' plans. A hash repeated across steps is copied twice into its one page: harmless."""
        plans: list[tuple[int, SavePlan]] = []
        ok = False
        elapsed = 0.0
        copied = 0
        try:
            for first in range(0, max(len(hashes), 1), SAVE_STEP):
                step = hashes[first : first + SAVE_STEP]
                inst, w, sealed, plan = self._begin_save(worker, session, group, step, tables if not first else [])
                if plan is None:
                    break
                plans.append((first, plan))
            offsets = list(chain.from_iterable(plan.offsets for _, plan in plans))
            copied = len(offsets)
            # every hash got a page (the common case): the plans' positions are 0..n-1 in order, the ids the tables'
            every = copied == len(hashes)
            positions = [] if every else [first + i for first, plan in plans for i in plan.positions]
            start = time.perf_counter()
            for table in range(w.tables[group]):
                copier = w.copiers.get((group, table))
                if copier is not None:  # a table of the group whose layers this worker does not hold: none
                    ids = tables[table]
                    copier.save(ids if every else [ids[k] for k in positions], offsets)
            elapsed = time.perf_counter() - start
            ok = True
        finally:
            completed = 0
            for _, plan in plans:
                with self._lock:
                    sealed_pages = self.store.finish_save_pages(plan, ok)
                    completed += len(sealed_pages)
                    part = sealed.parts[group]
                    self.tiers.write_through(inst.part_key(group), part.layout, sealed_pages)
            if plans:
                with self._lock:
                    self.counters.saves += 1
                    self.counters.save_bytes += copied * w.group_bytes[group]
                    self.counters.save_seconds += elapsed
        return SaveResult(
            written=sum(len(plan.pages) for _, plan in plans),
            skipped=sum(plan.skipped for _, plan in plans),
            not_stored=sum(plan.not_stored for _, plan in plans),
            completed=completed,
            namespace_final=sealed.namespace_final,
        )

    def _begin_save(
        self, worker: WorkerKey, session: Session, group: int, hashes: Sequence[bytes], tables: list[list[int]]
    ) -> tuple[Instance, Worker, SealedInstance, SavePlan | None]:
        """One step of a Save (None: this worker holds none of the group's layers). `tables` are checked (the
        first step gets them all)."""
        while True:
            with self._lock:
                inst, w = self.registry.owned_worker(worker, session)
                self.registry.find_sealed(worker[0])
                sealed = inst.sealed
                assert sealed is not None
                _check_tables(sealed, w, group, tables)
                if not w.tables[group]:
                    return inst, w, sealed, None
                ns_id, layout = inst.ns_ids[group], sealed.parts[group].layout
                # a slab of another class is emptied for these pages in bounded steps, the lock released between
                if not self.store.reclaim(ns_id, layout, hashes):
                    return inst, w, sealed, self.store.begin_save(ns_id, layout, hashes, w.cell_masks[group])
            time.sleep(RECLAIM_YIELD_S)

    def load(
        self,
        worker: WorkerKey,
        hashes: Sequence[bytes],
        block_ids: Sequence[int],
        session: Session,
        lease_id: int = 0,
    ) -> LoadResult:
        """A Load of group 0's blocks through one block table (every layout of one group)."""
        return self.load_groups(worker, [(0, hashes, [block_ids])], session, lease_id)

    def load_groups(self, worker: WorkerKey, runs: Sequence[Run], session: Session, lease_id: int = 0) -> LoadResult:
        """Copies each run's resident blocks (group, hashes, block ids per table) into the worker's memory, run
        after run, up to the first block that is missing or refused (the outcome names it); `loaded` counts the
        blocks loaded. The lease (one share: this worker's) is consumed whatever the outcome."""
        checked = _check_runs(runs, as_lists=False) or [(0, [], [[]])]
        with self._lock:
            inst, w = self.registry.owned_worker(worker, session)
            self.registry.find_sealed(worker[0])
            sealed = inst.sealed
            assert sealed is not None
            for group, _, tables in checked:
                _check_tables(sealed, w, group, tables)
            plans: list[tuple[int, list[list[int]], LoadPlan]] = []
            for group, hashes, tables in checked:
                if not w.tables[group] and plans:
                    continue
                plan = self.store.begin_load(
                    inst.ns_ids[group],
                    sealed.parts[group].layout,
                    hashes if w.tables[group] else [],
                    lease_id=0 if plans else lease_id,  # consumed once, by the first plan
                    owner=worker[0],
                    worker_key=(worker[1], worker[2]),
                )
                plans.append((group, tables, plan))
                if plan.outcome != "loaded":
                    break
        start = time.perf_counter()
        try:
            for group, tables, plan in plans:
                n = len(plan.pages)
                for table in range(w.tables[group]):
                    copier = w.copiers.get((group, table))
                    if copier is not None:
                        copier.load(tables[table][:n], plan.offsets)
        finally:
            elapsed = time.perf_counter() - start
            with self._lock:
                for group, _, plan in plans:
                    self.store.finish_load(plan)
                    self.counters.load_bytes += len(plan.pages) * w.group_bytes[group]
                self.counters.loads += 1
                self.counters.load_seconds += elapsed
        last = plans[-1][2]
        return LoadResult(last.outcome, sum(len(p.pages) for _, _, p in plans), last.reason, last.message)

    def query(
        self,
        instance_id: str,
        hashes: Sequence[bytes],
        caller: Caller,
        lease_ttl_ms: int = 0,
        request_id: str = "",
        max_tokens: int = 0,
    ) -> QueryResult:
        """`lease_ttl_ms` (0: the engine's) is capped at the engine's --lease-ttl; the answer says what was granted.
        When the prefix continues on SSD or a peer the answer is `loading` (no hits, no lease) while those blocks
        are brought into the pool: the caller asks again. An instance of several KV cache groups (or one a drafter
        reads) gets the hybrid hit (hybrid_query): `max_tokens` (0: every hash's) bounds it."""
        hashes = _check_hashes(hashes)
        if lease_ttl_ms < 0:
            raise InvalidArgument(f"lease_ttl_ms must be >= 0, got {lease_ttl_ms}")
        if max_tokens < 0:
            raise InvalidArgument(f"max_tokens must be >= 0, got {max_tokens}")
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidArgument(f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters")
        ask = None
        with self._lock:
            inst = self.registry.find_sealed(instance_id)
            check_access(inst, caller)
            sealed = inst.sealed
            assert sealed is not None
            cap_s = self.store.lease_ttl_s
            ttl_s = min(lease_ttl_ms / 1000, cap_s) if lease_ttl_ms else cap_s
            if _is_hybrid(sealed):
                hashes = list(hashes)
                found, ask = self._groups.query(inst, sealed, hashes, max_tokens, ttl_s)
                if ask is None:
                    return found
            else:
                if max_tokens:
                    hashes = hashes[: max_tokens // sealed.layout.block_size]
                result = self.store.query(
                    inst.ns_id, sealed.layout, hashes, owner=instance_id, shares=len(inst.workers), ttl_s=ttl_s
                )
                found = QueryResult(result.hits, result.lease_id, int(ttl_s * 1000), sealed.namespace_final)
                more = Continuation.NOWHERE
                if result.hits < len(hashes):
                    hashes = list(hashes)  # the tiers below take bytes objects
                    more = self.tiers.continuation(inst, hashes, result.hits)
                if more is Continuation.LOADING:
                    if result.lease_id:
                        self.store.release(result.lease_id, instance_id)
                    return found.still_loading()
                if more is Continuation.NOWHERE:
                    return found
        if ask is not None:
            return self._groups.from_peers(inst, sealed, found, ask)
        assert isinstance(hashes, list)  # made one where the hit fell short
        offered = self.tiers.lookup(sealed.namespace_final, hashes[result.hits :])  # the MetaServer: not locked
        with self._lock:
            if offered is not None and self.tiers.start_peer_fetch(inst, hashes, result.hits, offered):
                if result.lease_id:
                    self.store.release(result.lease_id, instance_id)
                return found.still_loading()
            self.tiers.note_peer_miss(inst.ns_id, hashes[result.hits])
        return found

    def release(self, instance_id: str, lease_id: int, caller: Caller) -> None:
        if lease_id <= 0:
            raise InvalidArgument("lease_id must be a lease returned by Query (> 0)")
        with self._lock:
            check_access(self.registry.find_instance(instance_id), caller)
            self.store.release(lease_id, instance_id)

    # ---------------------------------------------------------------- other nodes

    def use_peers(self, source: PeerSource) -> None:
        """Queries that miss ask `source` (the MetaServer and the peer fetch client) for the rest of the prefix."""
        self.tiers.use_peers(source)

    def pin_for_peer(
        self, namespace_final: str, digest: bytes, page_bytes: int, hashes: Sequence[bytes], owner: str, ttl_s: float
    ) -> PeerPin:
        """Pins the leading `hashes` this node holds for another node's fetch, under a lease of `owner` that expires
        after `ttl_s`. Only the engine's own user's blocks are offered (the only ones announced). A layout digest
        or page size other than this node's under the same final namespace is refused."""
        hashes = _check_hashes(hashes)
        with self._lock:
            ns_id = self.store.namespace_id(tenant(os.getuid()), namespace_final)
            if ns_id is None:
                return PeerPin(0, [], [])
            layout = self.store.layout_of(ns_id)
            if layout.digest != digest:
                return PeerPin(0, [], [], "digest", f"{namespace_final} has layout digest {layout.digest.hex()} here")
            if layout.page_bytes != page_bytes:
                return PeerPin(0, [], [], "page_bytes", f"{namespace_final} has {layout.page_bytes}-byte pages here")
            result = self.store.query(ns_id, layout, hashes, owner=owner, shares=1, ttl_s=ttl_s, count=False)
            if not result.lease_id:
                return PeerPin(0, [], [])
            lease = self.store.lease(result.lease_id)
            assert lease is not None
            offsets = [self.store.page_offset(pid) for pid in lease.pages]
            views = [self.tiers.page_view(pid, layout) for pid in lease.pages]
            return PeerPin(result.lease_id, offsets, views)

    def unpin_for_peer(self, lease_id: int, owner: str) -> None:
        with self._lock:
            if self.store.lease(lease_id) is not None:  # it may have expired meanwhile
                self.store.release(lease_id, owner)

    def track_blocks(self) -> None:
        """Start recording which blocks become resident or stop being (for block_changes)."""
        with self._lock:
            self.store.track_changes()

    def block_changes(self) -> dict[tuple[str, bytes], bool]:
        """(namespace_final, hash) -> resident now (True) or not (False), for every change since the last call.
        Only the engine's own user's blocks: other users' never leave the node."""
        own = tenant(os.getuid())
        with self._lock:
            changes = self.store.take_changes()
            names = {
                i: ns.namespace_final for i, (ns, _) in enumerate(self.store.namespace_stats()) if ns.tenant == own
            }
        out: dict[tuple[str, bytes], bool] = {}
        for sealed, ns_id, block_hash in changes:
            name = names.get(ns_id)
            if name is not None:
                out[(name, block_hash)] = sealed  # the last change of a block is what holds now
        return out

    def resident_blocks(self) -> dict[str, list[bytes]]:
        """Every resident block of the engine's own user, per final namespace (a node announcing all it holds)."""
        own = tenant(os.getuid())
        with self._lock:
            return {
                ns.namespace_final: self.store.sealed_hashes(i)
                for i, (ns, _) in enumerate(self.store.namespace_stats())
                if ns.tenant == own and ns.resident_blocks
            }

    # ---------------------------------------------------------------- timers

    def tick(self) -> None:
        """Expires leases and inflight pages even when no request comes (called periodically by the server), and
        finishes emptying a slab that a refill began emptying, one bounded step per lock hold."""
        with self._lock:
            self.store.expire()
            more = self.store.reclaim_step()
        while more:
            time.sleep(RECLAIM_YIELD_S)
            with self._lock:
                more = self.store.reclaim_step()

    # ---------------------------------------------------------------- admin and views

    def status(self, instance_id: str) -> InstanceStatus:
        with self._lock:
            return self.registry.find_instance(instance_id).status()

    def instances(self) -> list[InstanceStatus]:
        with self._lock:
            return [inst.status() for inst in self.registry.instances.values()]

    def namespaces(self) -> list[dict[str, Any]]:
        """One entry per (user, final namespace) held in memory or on SSD."""
        with self._lock:
            return views.namespace_views(self.store, self.tiers.ssd)

    def compare(
        self, namespace_final: str, other_namespace_final: str = "", other_descriptor: bytes = b""
    ) -> tuple[list[LayoutDifference], str]:
        """How the layout of `namespace_final` (held here, in memory or on SSD) differs from another one held here or
        from another engine's descriptor: the differences and one line naming them (empty: compatible)."""
        if not namespace_final:
            raise InvalidArgument("namespace_final must not be empty")
        with self._lock:
            sealed = self.registry.layouts
            left = views.layout_named(self.store, self.tiers.ssd, namespace_final, "namespace_final", sealed)
            if other_namespace_final:
                field = "other_namespace_final"
                right = views.layout_named(self.store, self.tiers.ssd, other_namespace_final, field, sealed)
        if other_namespace_final:
            other = other_namespace_final
        elif other_descriptor:
            parsed = layout_from_descriptor(other_descriptor)
            if parsed is None:
                raise InvalidArgument(
                    "other_descriptor is not a layout descriptor this engine reads (another descriptor format, or not "
                    "canonical JSON)"
                )
            right, other = parsed, "the other"
        else:
            raise InvalidArgument("name the other layout: other_namespace_final or other_descriptor")
        return diff_layouts(left, right), explain_difference(left, right, namespace_final, other)

    def purge(self, namespace_final: str, uid: int | None = None) -> list[dict[str, Any]]:
        """Drops a final namespace (every user's, or the one of `uid`) from memory and SSD. Pages a lease or a copy
        pins stay until released. One entry per (user, namespace) purged; empty when there is none."""
        with self._lock:
            out = []
            for key in sorted(views.held_keys(self.store, self.tiers.ssd, namespace_final, uid)):
                ns_id = self.store.namespace_id(*key)
                freed, left = self.store.purge(ns_id) if ns_id is not None else (0, 0)
                out.append(
                    {
                        "namespace": key[1],
                        "uid": key[0],
                        "memory_blocks": freed,
                        "memory_blocks_in_use": left,
                        "ssd_blocks": self.tiers.ssd.purge(key),
                    }
                )
            return out

    def statistics(self) -> EngineStatistics:
        with self._lock:
            ssd = self.tiers.ssd.statistics()
            return EngineStatistics(
                store=self.store.statistics(),
                counters=dataclasses.replace(self.counters),
                instances=len(self.registry.instances),
                workers=self.registry.workers(),
                ssd=ssd if ssd.devices else None,
            )

    def lock_statistics(self) -> LockStatistics:
        """How long the engine lock was held: a histogram of holds and the longest, with where (no lock taken)."""
        return self._lock.statistics()


def _check_hashes(hashes: Sequence[bytes]) -> Sequence[bytes]:
    """The checked hashes: a lane frame's HashArray as it is (one length for all, checked at once: the native
    index reads its buffer), anything else as a list (a protobuf repeated field builds a new bytes object on every
    access, so it is walked once here and the list is what the store and the copier walk)."""
    if len(hashes) > MAX_BLOCKS_PER_REQUEST:
        raise InvalidArgument(f"block_hashes: at most {MAX_BLOCKS_PER_REQUEST} per request, got {len(hashes)}")
    if isinstance(hashes, HashArray):
        if hashes.n and not 0 < hashes.size <= MAX_HASH_BYTES:
            raise InvalidArgument(f"block_hashes[0] must be 1..{MAX_HASH_BYTES} bytes, got {hashes.size}")
        return hashes
    hashes = list(hashes)
    if hashes and (min(map(len, hashes)) == 0 or max(map(len, hashes)) > MAX_HASH_BYTES):
        bad = next(i for i, h in enumerate(hashes) if not 0 < len(h) <= MAX_HASH_BYTES)
        raise InvalidArgument(f"block_hashes[{bad}] must be 1..{MAX_HASH_BYTES} bytes, got {len(hashes[bad])}")
    return hashes


def _check_runs(runs: Sequence[Run], *, as_lists: bool) -> list[tuple[int, Sequence[bytes], list[list[int]]]]:
    """The checked runs (see _check_hashes; `as_lists`: the hashes as lists, for a save, which keeps a bytes object
    per page anyway): hashes and every table of a run agree in length, and the runs together stay within
    MAX_BLOCKS_PER_REQUEST."""
    out = []
    total = 0
    for i, (group, hashes, tables) in enumerate(runs):
        hashes = _check_hashes(hashes)
        if as_lists and isinstance(hashes, HashArray):
            hashes = hashes.tolist()
        total += len(hashes) * max(len(tables), 1)
        if total > MAX_BLOCKS_PER_REQUEST:
            raise InvalidArgument(f"block_ids: at most {MAX_BLOCKS_PER_REQUEST} per request over all runs")
        if not tables:
            raise InvalidArgument(f"runs[{i}].block_ids must hold at least one block table")
        for t, ids in enumerate(tables):
            if len(ids) != len(hashes):
                raise InvalidArgument(
                    f"runs[{i}].block_ids[{t}] has {len(ids)} entries but block_hashes has {len(hashes)}"
                )
        out.append((group, hashes, [list(ids) for ids in tables]))
    return out


def _check_tables(sealed: SealedInstance, w: Worker, group: int, tables: list[list[int]]) -> None:
    """A run's group exists and carries every block table the worker's layers of that group use, in range."""
    if not 0 <= group < len(sealed.parts):
        raise InvalidArgument(f"group {group} names no KV cache group: the instance has {len(sealed.parts)}")
    if tables and len(tables) < w.tables[group]:
        raise InvalidArgument(
            f"group {group} needs {w.tables[group]} block tables (the worker's layers use them), got {len(tables)}"
        )
    for ids in tables:
        _check_block_range(ids, w.num_blocks)


def _is_hybrid(sealed: SealedInstance) -> bool:
    """Whether queries need the hybrid hit: several groups, or one that is not full attention at the hash's block
    size, or a drafter's block drop."""
    kind = sealed.parts[0].kind
    return (
        len(sealed.parts) > 1
        or kind.kind != "full"
        or kind.block_size != sealed.layout.block_size
        or bool(sealed.eagle_groups)
    )


def _check_block_range(block_ids: Sequence[int], num_blocks: int) -> None:
    if block_ids and max(block_ids) >= num_blocks:
        bad = next(i for i, b in enumerate(block_ids) if b >= num_blocks)
        raise InvalidArgument(
            f"block_ids[{bad}] = {block_ids[bad]} is out of range: the worker registered {num_blocks} blocks"
        )
