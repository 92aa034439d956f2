"""The engine: instances and their workers, the store, the arena and the copies, behind one lock.

Who may do what (the trust model, enforced here): every call names its caller. A worker registers through a
`Session` (one lane connection, whose uid the kernel reported); its worker key, registration and mappings belong to
that session: another session's Save, Load, Unregister or re-Register of it is refused (PERMISSION_DENIED) while the
session lives, and everything goes when the session ends. An instance belongs to the uid of its first worker: its
other workers must have that uid, and only that uid or a privileged `Peer` (the engine's own user, root, a token
holder) may query it or release its leases. Blocks are shared only within one tenant: the instances of one uid
(the engine's own user and root count as one tenant), so no user can read another's prompts by probing hashes, nor
plant blocks another user then loads.

Thread model: lane and gRPC handlers call these methods concurrently. Book-keeping (registry, store) happens under
`_lock`; copies happen outside it on pages the store keeps alive for the copy (inflight for saves, pinned for
loads), so a long copy never blocks queries. A worker's mapped memory stays mapped while any copy still refers
to it, even if the worker is dropped meanwhile (the views keep the mapping alive).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from kvseal.copy.copier import SlotSource, WorkerCopier
from kvseal.copy.cuda import cuda_runtime
from kvseal.core.layout import (
    InstanceRegistry,
    LayerRegistration,
    Layout,
    LayoutDifference,
    SealedInstance,
    WorkerRegistration,
    diff_layouts,
    explain_difference,
    layout_from_descriptor,
    validate_registration,
)
from kvseal.core.store import BlockStore, SavePlan, StoreStatistics, page_stride
from kvseal.engine.lock import LockStatistics, TimedLock
from kvseal.engine.memory import (
    Arena,
    CudaSpec,
    ShmLayer,
    ShmPlan,
    ShmSpec,
    layer_extent,
    map_cuda_storage,
    map_shm,
    plan_shm,
)
from kvseal.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted, quote
from kvseal.limits import MAX_BLOCKS_PER_REQUEST, MAX_HASH_BYTES, MAX_REQUEST_ID_CHARS
from kvseal.ssd.tier import DiskTier, NamespaceKey, TierStatistics, WriteItem

log = logging.getLogger("kvseal.engine")

WorkerKey = tuple[str, int, int]  # (instance_id, tp_rank, pp_rank)
PEER_RETRY_S = 2.0  # a prefix no peer could give is not asked for again before this
MAX_PEER_MISSES = 65536
SETTLE_S = 30.0  # how long a timed-out transfer (Mooncake: its progress timeout, 10 s) may still write pages
# between two steps of emptying a slab the lock is free this long, so that threads waiting for it get it (a lock
# released and at once taken again by the same thread mostly goes to that thread)
RECLAIM_YIELD_S = 50e-6
SAVE_STEP = 512  # hashes a Save reserves per engine-lock hold (tiny pages, evicting: ~5 ms of bookkeeping)


class PeerSource(Protocol):
    """Other nodes, as a query that misses sees them (kvseal.peer.client.PeerFetcher)."""

    def lookup(self, namespace_final: str, hashes: list[bytes]) -> tuple[str, int] | None:
        """(address, count): the peer holding the longest prefix of `hashes`, or None."""
        ...

    def fetch(
        self,
        address: str,
        namespace_final: str,
        layout: Layout,
        hashes: list[bytes],
        offsets: list[int],
        destinations: list[memoryview],
    ) -> tuple[int, bool]:
        """Fills destinations (pool pages at arena `offsets`) with the peer's pages. Returns how many leading
        pages arrived whole and verified, and whether a transfer that gave up may still write the others (then
        they are not reused before wait_settled)."""
        ...

    def wait_settled(self, timeout_s: float) -> bool:
        """Waits until no transfer that gave up can still write pool pages; False if one still may."""
        ...


@dataclass(frozen=True, slots=True)
class PeerPin:
    """Pages pinned for another node's fetch: their arena offsets and views, under `lease_id` (0: none held)."""

    lease_id: int
    offsets: list[int]
    views: list[memoryview]
    refusal: str = ""
    message: str = ""


@dataclass(frozen=True, slots=True)
class Peer:
    """Who is calling, as the kernel (SO_PEERCRED, the TCP socket table) or the token says."""

    uid: int | None  # None: a token holder, whose uid nobody knows
    pid: int = 0
    privileged: bool = False  # the engine's own user, root, or a token holder: may query any instance


class Session:
    """One lane connection. The workers it registered are its own, and are dropped when it ends."""

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
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


@dataclass(frozen=True, slots=True)
class SaveResult:
    written: int
    skipped: int
    not_stored: int
    completed: int
    namespace_final: str


@dataclass(frozen=True, slots=True)
class LoadResult:
    outcome: str  # loaded | missing | refused
    loaded: int
    reason: str = ""
    message: str = ""


@dataclass(frozen=True, slots=True)
class QueryResult:
    hits: int
    lease_id: int
    lease_ttl_ms: int
    namespace_final: str
    loading: bool = False


@dataclass(slots=True)
class EngineCounters:
    save_bytes: int = 0
    save_seconds: float = 0.0
    saves: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0
    loads: int = 0  # refusals are counted per namespace by the store


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    store: StoreStatistics
    counters: EngineCounters
    instances: int
    workers: int
    ssd: TierStatistics | None = None


class _Worker:
    def __init__(
        self, reg: WorkerRegistration, memories: list[Any], offsets: list[int], mapped_bytes: int, session: Session
    ) -> None:
        self.registration = reg
        self.session = session
        self.memories = memories  # per layer, in registration order
        self.offsets = offsets  # per layer: where its block 0 starts in its memory
        self.mapped_bytes = mapped_bytes  # of the worker's memfds, counted against its uid's cap
        self.num_blocks = min(layer.num_blocks for layer in reg.layers)
        self.copier: WorkerCopier | None = None
        self.cell_mask = 0
        self.slot_bytes = sum(layer.geometry.slot_bytes for layer in reg.layers)  # bytes moved per block


class _Instance:
    def __init__(self, instance_id: str, uid: int | None) -> None:
        self.uid = uid  # the owner: the uid of its first worker
        self.registry = InstanceRegistry(instance_id)
        self.workers: dict[tuple[int, int], _Worker] = {}
        self.ns_id = -1

    @property
    def sealed(self) -> SealedInstance | None:
        return self.registry.sealed

    @property
    def key(self) -> NamespaceKey:
        """Whose blocks, under which final namespace (sealed instances only)."""
        assert self.sealed is not None
        return _tenant(self.uid), self.sealed.namespace_final


class Engine:
    def __init__(
        self,
        pool_bytes: int,
        *,
        slab_bytes: int = 64 << 20,
        prefault: bool = True,
        lease_ttl_s: float = 30.0,
        inflight_timeout_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        ssd: DiskTier | None = None,
        max_mapped_per_uid: int = 0,
    ) -> None:
        """`ssd`: an opened SSD tier; sealed blocks are written through to it and queries continue from it.
        `max_mapped_per_uid`: bytes of their memfds that the workers of one uid may have the engine map and fault in
        at once (0: no cap); the engine's own user and root are not capped."""
        self.store = BlockStore(
            pool_bytes,
            slab_bytes=slab_bytes,
            clock=clock,
            lease_ttl_s=lease_ttl_s,
            inflight_timeout_s=inflight_timeout_s,
        )
        self.arena = Arena(self.store.arena_bytes, prefault=prefault)
        self.counters = EngineCounters()
        self._lock = TimedLock()  # every hold is timed: lock_statistics(), /metrics
        self._instances: dict[str, _Instance] = {}
        self.max_mapped_per_uid = max_mapped_per_uid
        self._mapped: dict[int | None, int] = {}  # uid -> bytes its workers have mapped (or are mapping)
        self.ssd = ssd
        self._refilling: set[int] = set()  # pages being read from SSD
        self._refills = ThreadPoolExecutor(2, thread_name_prefix="kvseal-refill") if ssd is not None else None
        self._peers: PeerSource | None = None
        self._fetches: ThreadPoolExecutor | None = None
        self._peer_misses: dict[tuple[int, bytes], float] = {}  # (ns_id, first missing hash) -> ask again after

    def close(self) -> None:
        """Finishes SSD refills and writes (the tier seals its segments). The pool stays mapped."""
        for pool in (self._refills, self._fetches):
            if pool is not None:
                pool.shutdown(wait=True)
        if self.ssd is not None:
            self.ssd.close()

    # ---------------------------------------------------------------- registration

    def register(self, reg: WorkerRegistration, session: Session, fds: Sequence[int] = ()) -> InstanceStatus:
        """Registers one worker for `session`, mapping its memory from `fds` (the descriptors that came with the
        registration; the caller closes them). Seals the instance when it is the last worker. On error nothing
        changes."""
        validate_registration(reg)
        if session.peer.uid is None:
            raise PermissionDenied("workers register over the local lane, where the kernel names their uid")
        if any(isinstance(layer.memory, CudaSpec) for layer in reg.layers) and not _same_user(session.peer):
            raise PermissionDenied(
                "CUDA IPC handles are accepted only from the engine's own user or root (the driver does not tie a "
                "handle to the process that exported it): run the engine as the inference server's user"
            )
        for i, layer in enumerate(reg.layers):
            if not isinstance(layer.memory, ShmSpec | CudaSpec):
                raise InvalidArgument(f"layers[{i}].memory must be set (shm or cuda)")
        with self._lock:
            self._check_may_register(reg, session)
        shm = [
            ShmLayer(f"layers[{i}].memory", layer.memory, _extent(layer))
            for i, layer in enumerate(reg.layers)
            if isinstance(layer.memory, ShmSpec)
        ]
        plan = plan_shm(shm, fds)  # checks every descriptor and bound; maps nothing yet
        uid = session.peer.uid
        with self._lock:
            self._reserve_mapping(reg, session, plan.bytes)
        try:
            memories, offsets = self._map_memory(reg, plan)
        except BaseException:
            with self._lock:
                self._unreserve(uid, plan.bytes)
            raise
        with self._lock:
            try:
                self._check_may_register(reg, session)  # again: another session may have come in while we mapped
                inst = self._instances.get(reg.instance_id) or _Instance(reg.instance_id, uid)
                before = (dict(inst.registry.workers), inst.registry.sealed)
                workers = {**inst.workers, reg.key: _Worker(reg, memories, offsets, plan.bytes, session)}
                try:
                    sealed = inst.registry.add(reg)
                    copiers = self._plan_copies(workers, sealed) if sealed is not None else {}
                except Exception:
                    inst.registry.workers, inst.registry.sealed = before
                    raise
            except BaseException:
                self._unreserve(uid, plan.bytes)
                raise
            # nothing below can fail: commit
            replaced = inst.workers.get(reg.key)
            if replaced is not None:  # this session registers the worker again: its old mappings go
                self._unreserve(uid, replaced.mapped_bytes)
            self._instances[reg.instance_id] = inst
            inst.workers = workers
            session.workers.add((reg.instance_id, *reg.key))
            if sealed is not None:
                inst.ns_id = self.store.namespace(sealed.namespace_final, sealed.layout, _tenant(inst.uid))
                for key, w in workers.items():
                    w.copier = copiers[key]
                    w.cell_mask = sealed.cell_mask(key)
            return self._status(inst)

    def _check_may_register(self, reg: WorkerRegistration, session: Session) -> None:
        inst = self._instances.get(reg.instance_id)
        if inst is None:
            return
        if inst.uid != session.peer.uid:
            raise PermissionDenied(
                f"instance_id {quote(reg.instance_id)} belongs to another user (uid {inst.uid}): pick another "
                "instance_id"
            )
        w = inst.workers.get(reg.key)
        if w is not None and w.session is not session:
            raise PermissionDenied(
                f"worker tp_rank {reg.tp_rank} pp_rank {reg.pp_rank} of instance {quote(reg.instance_id)} is held by "
                f"another session (pid {w.session.peer.pid}); it is released when that session ends"
            )

    def _reserve_mapping(self, reg: WorkerRegistration, session: Session, size: int) -> None:
        """Counts `size` bytes of mappings against the session's uid, or refuses them past --max-mapped-per-uid.
        A worker registered again by its session will drop its old mappings: they do not count. Under the lock."""
        uid = session.peer.uid
        used = self._mapped.get(uid, 0)
        inst = self._instances.get(reg.instance_id)
        old = inst.workers.get(reg.key) if inst is not None else None
        replaced = old.mapped_bytes if old is not None and old.session is session else 0
        cap = self.max_mapped_per_uid
        if cap and not _same_user(session.peer) and used - replaced + size > cap:
            raise ResourceExhausted(
                f"uid {uid}: this registration maps {_mib(size)} of shared memory and uid {uid}'s workers already "
                f"have {_mib(used - replaced)} mapped, over the engine's cap of {_mib(cap)} per uid "
                "(kvseal serve --max-mapped-per-uid): register fewer or smaller layers, or end other workers"
            )
        self._mapped[uid] = used + size

    def _map_memory(self, reg: WorkerRegistration, plan: ShmPlan) -> tuple[list[Any], list[int]]:
        """Per layer, in registration order: the memory its blocks are in and the offset of block 0 there."""
        shm = iter(map_shm(plan))
        memories: list[Any] = []
        offsets: list[int] = []
        for i, layer in enumerate(reg.layers):
            if isinstance(layer.memory, CudaSpec):
                memories.append(map_cuda_storage(f"layers[{i}].memory", layer.memory, _extent(layer)))
                offsets.append(layer.memory.offset)
                # page-locked once, here and not under the engine's lock (a large pool takes a second or more)
                cuda_runtime().pin(self.arena.bytes.ctypes.data, self.arena.size)
            else:
                memory, offset = next(shm)
                memories.append(memory)
                offsets.append(offset)
        return memories, offsets

    def _plan_copies(
        self, workers: dict[tuple[int, int], _Worker], sealed: SealedInstance
    ) -> dict[tuple[int, int], WorkerCopier]:
        """The copiers of a sealed instance's workers (pure: raises before anything is changed)."""
        layout = sealed.layout
        if layout.page_bytes > self.store.max_page_bytes():
            raise ResourceExhausted(
                f"a page of this layout holds {layout.page_bytes} bytes ({layout.num_slots} slots) but the pool's "
                f"largest page is {self.store.max_page_bytes()} bytes: raise --pool-size (and --slab-size)"
            )
        copiers = {}
        for key, worker in workers.items():
            sources = []
            for layer, memory, offset in zip(worker.registration.layers, worker.memories, worker.offsets, strict=True):
                g = layer.geometry
                slot = layout.slot(sealed.layer_ids[g.name], key[0])
                sources.append(
                    SlotSource(
                        memory=memory,
                        src_offset=offset,
                        block_stride=layer.strides[0],
                        segment_stride=layer.strides[1] if g.segments == 2 else 0,
                        num_blocks=layer.num_blocks,
                        segments=g.segments,
                        segment_bytes=g.segment_bytes,
                        dst_offset=layout.slot_offsets[slot],
                    )
                )
            copiers[key] = WorkerCopier(sources, self.arena.bytes, page_stride(layout.page_bytes))
        return copiers

    def unregister(self, worker: WorkerKey, session: Session) -> int:
        """Drops a worker's registration and mappings and every lease of its instance. Returns the workers left."""
        with self._lock:
            inst, _ = self._owned_worker(worker, session)
            return self._drop(inst, (worker[1], worker[2]))

    def _drop(self, inst: _Instance, key: tuple[int, int]) -> int:
        w = inst.workers.pop(key)
        w.session.workers.discard((inst.registry.instance_id, *key))
        self._unreserve(w.session.peer.uid, w.mapped_bytes)
        inst.registry.remove(key)
        self.store.release_owner(inst.registry.instance_id)
        if not inst.workers:
            del self._instances[inst.registry.instance_id]
        return len(inst.workers)

    def _unreserve(self, uid: int | None, size: int) -> None:
        """`size` bytes of mappings no longer count against `uid` (they go with the last view of them). Under the
        lock."""
        left = self._mapped.get(uid, 0) - size
        if left > 0:
            self._mapped[uid] = left
        else:
            self._mapped.pop(uid, None)

    def mapped_bytes(self, uid: int) -> int:
        """Bytes of shared memory the workers of `uid` have the engine map."""
        with self._lock:
            return self._mapped.get(uid, 0)

    def close_session(self, session: Session) -> None:
        """The session ended (its connection closed): every worker it registered goes, with its instance's leases."""
        with self._lock:
            for instance_id, tp_rank, pp_rank in list(session.workers):
                inst = self._instances.get(instance_id)
                w = inst.workers.get((tp_rank, pp_rank)) if inst is not None else None
                if inst is not None and w is not None and w.session is session:
                    self._drop(inst, (tp_rank, pp_rank))
            session.workers.clear()

    # ---------------------------------------------------------------- data path

    def save(
        self, worker: WorkerKey, hashes: Sequence[bytes], block_ids: Sequence[int], session: Session
    ) -> SaveResult:
        """Reserves pages for the hashes SAVE_STEP at a time (one engine-lock hold each, so that a Save of
        thousands of tiny blocks does not stall every query), copies every reserved block in one call, then
        finishes the steps' plans. A hash repeated across steps is copied twice into its one page: harmless."""
        hashes, block_ids = _check_blocks(hashes, block_ids)
        plans: list[tuple[int, SavePlan]] = []
        ok = False
        elapsed = 0.0
        try:
            for first in range(0, max(len(hashes), 1), SAVE_STEP):
                step = hashes[first : first + SAVE_STEP]
                inst, w, sealed, plan = self._begin_save(worker, session, step, block_ids if not first else [])
                plans.append((first, plan))
            ids = [block_ids[first + i] for first, plan in plans for i in plan.positions]
            offsets = [o for _, plan in plans for o in plan.offsets]
            start = time.perf_counter()
            w.copier.save(ids, offsets)
            elapsed = time.perf_counter() - start
            ok = True
        finally:
            completed = 0
            for _, plan in plans:
                with self._lock:
                    sealed_pages = self.store.finish_save_pages(plan, ok)
                    completed += len(sealed_pages)
                    if self.ssd is not None and sealed_pages:
                        self._write_through(inst.key, sealed.layout, sealed_pages)
            if plans:
                with self._lock:
                    self.counters.saves += 1
                    self.counters.save_bytes += len(ids if ok else ()) * w.slot_bytes
                    self.counters.save_seconds += elapsed
        return SaveResult(
            written=sum(len(plan.pages) for _, plan in plans),
            skipped=sum(plan.skipped for _, plan in plans),
            not_stored=sum(plan.not_stored for _, plan in plans),
            completed=completed,
            namespace_final=sealed.namespace_final,
        )

    def _begin_save(
        self, worker: WorkerKey, session: Session, hashes: list[bytes], block_ids: list[int]
    ) -> tuple[_Instance, _Worker, SealedInstance, SavePlan]:
        """One step of a Save: `block_ids` are range-checked (the first step gets them all)."""
        while True:
            with self._lock:
                inst, w = self._owned_worker(worker, session)
                self._find_sealed(worker[0])
                _check_block_range(block_ids, w.num_blocks)
                sealed = inst.sealed
                assert sealed is not None and w.copier is not None
                # a slab of another class is emptied for these pages in bounded steps, the lock released between
                if not self.store.reclaim(inst.ns_id, sealed.layout, hashes):
                    return inst, w, sealed, self.store.begin_save(inst.ns_id, sealed.layout, hashes, w.cell_mask)
            time.sleep(RECLAIM_YIELD_S)

    def load(
        self,
        worker: WorkerKey,
        hashes: Sequence[bytes],
        block_ids: Sequence[int],
        session: Session,
        lease_id: int = 0,
    ) -> LoadResult:
        hashes, block_ids = _check_blocks(hashes, block_ids)
        with self._lock:
            inst, w = self._owned_worker(worker, session)
            self._find_sealed(worker[0])
            _check_block_range(block_ids, w.num_blocks)
            sealed = inst.sealed
            assert sealed is not None and w.copier is not None
            plan = self.store.begin_load(
                inst.ns_id,
                sealed.layout,
                hashes,
                lease_id=lease_id,
                owner=worker[0],
                worker_key=(worker[1], worker[2]),
            )
        start = time.perf_counter()
        try:
            w.copier.load(block_ids[: len(plan.pages)], plan.offsets)
        finally:
            elapsed = time.perf_counter() - start
            with self._lock:
                self.store.finish_load(plan)
                self.counters.loads += 1
                self.counters.load_bytes += len(plan.pages) * w.slot_bytes
                self.counters.load_seconds += elapsed
        return LoadResult(plan.outcome, len(plan.pages), plan.reason, plan.message)

    def query(
        self, instance_id: str, hashes: Sequence[bytes], peer: Peer, lease_ttl_ms: int = 0, request_id: str = ""
    ) -> QueryResult:
        """`lease_ttl_ms` (0: the engine's) is capped at the engine's --lease-ttl; the answer says what was granted.
        When the prefix continues on SSD the answer is `loading` (no hits, no lease) while those blocks are read
        into the pool: the caller asks again."""
        hashes = _check_hashes(hashes)
        if lease_ttl_ms < 0:
            raise InvalidArgument(f"lease_ttl_ms must be >= 0, got {lease_ttl_ms}")
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidArgument(f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters")
        with self._lock:
            inst = self._find_sealed(instance_id)
            _check_access(inst, peer)
            sealed = inst.sealed
            assert sealed is not None
            cap_s = self.store.lease_ttl_s
            ttl_s = min(lease_ttl_ms / 1000, cap_s) if lease_ttl_ms else cap_s
            result = self.store.query(
                inst.ns_id, sealed.layout, hashes, owner=instance_id, shares=len(inst.workers), ttl_s=ttl_s
            )
            found = QueryResult(result.hits, result.lease_id, int(ttl_s * 1000), sealed.namespace_final)
            loading = QueryResult(0, 0, int(ttl_s * 1000), sealed.namespace_final, loading=True)
            more = self._continuation(inst, hashes, result.hits) if result.hits < len(hashes) else ""
            if more == "loading":
                if result.lease_id:
                    self.store.release(result.lease_id, instance_id)
                return loading
        if more != "ask":
            return found
        source = self._peers
        assert source is not None
        offered = source.lookup(sealed.namespace_final, hashes[result.hits :])  # the MetaServer: not under the lock
        with self._lock:
            if offered is not None and self._start_peer_fetch(inst, hashes, result.hits, offered):
                if result.lease_id:
                    self.store.release(result.lease_id, instance_id)
                return loading
            self._note_peer_miss(inst.ns_id, hashes[result.hits])
        return found

    def release(self, instance_id: str, lease_id: int, peer: Peer) -> None:
        if lease_id <= 0:
            raise InvalidArgument("lease_id must be a lease returned by Query (> 0)")
        with self._lock:
            _check_access(self._find_instance(instance_id), peer)
            self.store.release(lease_id, instance_id)

    # ---------------------------------------------------------------- SSD tier

    def _write_through(self, key: NamespaceKey, layout: Layout, pages: list[int]) -> None:
        """Hands freshly sealed pages the SSD does not hold to its writers, pinned until written. Under the lock."""
        assert self.ssd is not None
        hashes = [self.store.page_hash(pid) for pid in pages]
        absent = self.ssd.absent(key, hashes)
        if not absent:
            return
        pages = [pages[i] for i in absent]
        self.store.pin_pages(pages)
        items = [WriteItem(hashes[i], self._page_view(pid, layout)) for i, pid in zip(absent, pages, strict=True)]

        def written(ok: bool) -> None:
            with self._lock:
                self.store.unpin_pages(pages)

        if not self.ssd.write(key, layout, items, written):
            self.store.unpin_pages(pages)

    def _page_view(self, pid: int, layout: Layout) -> memoryview:
        at = self.store.page_offset(pid)
        return memoryview(self.arena.bytes[at : at + layout.page_bytes])

    def _continuation(self, inst: _Instance, hashes: list[bytes], start: int) -> str:
        """Where the blocks from hashes[start] on may come from: 'loading' (a refill from SSD or a peer is under way,
        perhaps started now), 'ask' (ask the MetaServer which peer holds them) or '' (nowhere). Under the lock."""
        assert inst.sealed is not None
        pid = self.store.page(inst.ns_id, hashes[start])
        if pid is not None:  # inflight: a refill under way, or a worker's save (not ours to wait for)
            return "loading" if pid in self._refilling else ""
        if self.ssd is not None and self._refill_from_ssd(inst, hashes, start):
            return "loading"
        if self._peers is None or inst.key[0] != _tenant(os.getuid()):  # other users' blocks never leave the node
            return ""
        retry_at = self._peer_misses.get((inst.ns_id, hashes[start]))
        if retry_at is not None:
            if time.monotonic() < retry_at:
                return ""
            del self._peer_misses[(inst.ns_id, hashes[start])]
        return "ask"

    def _begin_refill(self, inst: _Instance, wanted: list[bytes]) -> SavePlan | None:
        """Inflight pages for a refill of `wanted` (full cell mask), or None when the first cannot be had."""
        assert inst.sealed is not None
        layout = inst.sealed.layout
        plan = self.store.begin_save(inst.ns_id, layout, wanted, (1 << layout.num_slots) - 1)
        if not plan.pages or plan.positions[0] != 0:
            self.store.finish_save(plan, ok=False)
            return None  # no room for the first block, or it came meanwhile: serve what memory has
        self._refilling.update(plan.pages)
        return plan

    def _finish_refill(
        self, key: NamespaceKey, layout: Layout, plan: SavePlan, good: Sequence[bool], *, new: bool = False
    ) -> None:
        """Seals the refill's pages that passed every check, drops the others. `new`: the blocks came from
        elsewhere than this node's SSD, which they are written through to."""
        kept, dropped = self.store.split_plan(plan, good)
        with self._lock:
            sealed = self.store.finish_save_pages(kept, ok=True)
            self.store.finish_save(dropped, ok=False)
            self._refilling.difference_update(plan.pages)
            if new and sealed and self.ssd is not None:
                self._write_through(key, layout, sealed)

    def _refill_from_ssd(self, inst: _Instance, hashes: list[bytes], start: int) -> bool:
        """Starts reading the blocks from hashes[start] on from SSD if it has them and the pool has room."""
        assert self.ssd is not None and inst.sealed is not None
        run = self.ssd.prefix(inst.key, hashes[start:])
        if run == 0:
            return False
        wanted = hashes[start : start + run]
        plan = self._begin_refill(inst, wanted)
        if plan is None:
            return False
        assert self._refills is not None
        self._refills.submit(self._refill, inst.key, inst.sealed.layout, [wanted[k] for k in plan.positions], plan)
        return True

    def _refill(self, key: NamespaceKey, layout: Layout, hashes: list[bytes], plan: SavePlan) -> None:
        """Reads SSD records into a refill's inflight pages and seals those that passed every check."""
        assert self.ssd is not None
        destinations = [memoryview(self.arena.bytes[at : at + layout.page_bytes]) for at in plan.offsets]
        try:
            results = self.ssd.read(key, layout, hashes, destinations)
        except Exception:
            log.exception("ssd refill failed")
            results = ["io"] * len(hashes)
        self._finish_refill(key, layout, plan, [r == "" for r in results])

    # ---------------------------------------------------------------- peers (other nodes)

    def use_peers(self, source: PeerSource) -> None:
        """Queries that miss ask `source` (the MetaServer and the peer fetch client) for the rest of the prefix."""
        self._peers = source
        self._fetches = ThreadPoolExecutor(4, thread_name_prefix="kvseal-fetch")

    def _start_peer_fetch(self, inst: _Instance, hashes: list[bytes], start: int, offered: tuple[str, int]) -> bool:
        """Starts fetching hashes[start : start + count] from the peer at `address`. Under the lock."""
        address, count = offered
        if inst.sealed is None or count <= 0:
            return False
        wanted = hashes[start : start + min(count, len(hashes) - start)]
        plan = self._begin_refill(inst, wanted)
        if plan is None:
            return False
        assert self._fetches is not None
        hashes = [wanted[k] for k in plan.positions]
        self._fetches.submit(self._fetch, inst.key, inst.sealed, address, hashes, plan)
        return True

    def _fetch(
        self, key: NamespaceKey, sealed: SealedInstance, address: str, hashes: list[bytes], plan: SavePlan
    ) -> None:
        """Fetches a peer's pages into the refill's inflight pages; seals the leading pages that arrived whole and
        verified, and writes them through to SSD. Any failure is a miss of the rest, never a partial page."""
        assert self._peers is not None
        layout = sealed.layout
        destinations = [memoryview(self.arena.bytes[at : at + layout.page_bytes]) for at in plan.offsets]
        unsettled = False
        try:
            got, unsettled = self._peers.fetch(
                address, sealed.namespace_final, layout, hashes, plan.offsets, destinations
            )
        except Exception:
            log.exception("peer fetch from %s failed", address)
            got = 0
        good = [i < got for i in range(len(hashes))]
        if unsettled:  # a transfer that timed out may still write the pages it was given: not to be reused yet
            kept, dropped = self.store.split_plan(plan, good)
            self._finish_refill(key, layout, kept, [True] * len(kept.pages), new=True)
            with self._lock:
                self._refilling.difference_update(dropped.pages)  # queries see the miss at once
            if not self._peers.wait_settled(SETTLE_S):
                log.error("a timed-out peer transfer still runs after %.0f s: its pages are freed anyway", SETTLE_S)
            with self._lock:
                self.store.finish_save(dropped, ok=False)
        else:
            self._finish_refill(key, layout, plan, good, new=True)
        if got < len(hashes):
            with self._lock:
                self._note_peer_miss(plan.namespace_id, hashes[got])

    def _note_peer_miss(self, ns_id: int, first_missing: bytes) -> None:
        """No peer gave the blocks from `first_missing` on: do not ask again for PEER_RETRY_S. Under the lock."""
        now = time.monotonic()
        if len(self._peer_misses) >= MAX_PEER_MISSES:  # every cold prompt leaves one: keep the live ones only
            self._peer_misses = {k: t for k, t in self._peer_misses.items() if t > now}
            if len(self._peer_misses) >= MAX_PEER_MISSES:
                self._peer_misses.clear()
        self._peer_misses[(ns_id, first_missing)] = now + PEER_RETRY_S

    def pin_for_peer(
        self, namespace_final: str, digest: bytes, page_bytes: int, hashes: Sequence[bytes], owner: str, ttl_s: float
    ) -> PeerPin:
        """Pins the leading `hashes` this node holds for another node's fetch, under a lease of `owner` that expires
        after `ttl_s`. Only the engine's own user's blocks are offered (the only ones announced). A layout digest
        or page size other than this node's under the same final namespace is refused."""
        hashes = _check_hashes(hashes)
        with self._lock:
            ns_id = self.store.namespace_id(_tenant(os.getuid()), namespace_final)
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
            views = [self._page_view(pid, layout) for pid in lease.pages]
            return PeerPin(result.lease_id, offsets, views)

    def unpin_for_peer(self, lease_id: int, owner: str) -> None:
        with self._lock:
            if self.store.lease(lease_id) is not None:  # it may have expired meanwhile
                self.store.release(lease_id, owner)

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

    def lock_statistics(self) -> LockStatistics:
        """How long the engine lock was held: a histogram of holds and the longest, with where (no lock taken)."""
        return self._lock.statistics()

    # ---------------------------------------------------------------- lookup

    def _find_instance(self, instance_id: str) -> _Instance:
        if not instance_id:
            raise InvalidArgument("instance_id must not be empty")
        inst = self._instances.get(instance_id)
        if inst is None:
            raise NotFound(f"instance_id {quote(instance_id)} is not registered (register its workers first)")
        return inst

    def _find_sealed(self, instance_id: str) -> _Instance:
        inst = self._find_instance(instance_id)
        if inst.sealed is None:
            raise FailedPrecondition(f"registration incomplete: {inst.registry.progress()} for {quote(instance_id)}")
        return inst

    def _find_worker(self, worker: WorkerKey) -> tuple[_Instance, _Worker]:
        inst = self._find_instance(worker[0])
        w = inst.workers.get((worker[1], worker[2]))
        if w is None:
            raise NotFound(
                f"worker tp_rank {worker[1]} pp_rank {worker[2]} of instance {quote(worker[0])} is not registered"
            )
        return inst, w

    def _owned_worker(self, worker: WorkerKey, session: Session) -> tuple[_Instance, _Worker]:
        inst, w = self._find_worker(worker)
        if w.session is not session:
            raise PermissionDenied(
                f"worker tp_rank {worker[1]} pp_rank {worker[2]} of instance {quote(worker[0])} belongs to another "
                f"session (pid {w.session.peer.pid}): only the connection that registered it may use it"
            )
        return inst, w

    # ---------------------------------------------------------------- views

    def status(self, instance_id: str) -> InstanceStatus:
        with self._lock:
            return self._status(self._find_instance(instance_id))

    def _status(self, inst: _Instance) -> InstanceStatus:
        reg = inst.registry
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

    def instances(self) -> list[InstanceStatus]:
        with self._lock:
            return [self._status(inst) for inst in self._instances.values()]

    def namespaces(self) -> list[dict[str, Any]]:
        """One entry per (user, final namespace) held in memory or on SSD."""
        with self._lock:
            on_ssd = self.ssd.namespaces() if self.ssd is not None else {}
            out = []
            for ns, layout in self.store.namespace_stats():
                key = (ns.tenant, ns.namespace_final)
                ssd_blocks, ssd_bytes, _ = on_ssd.pop(key, (0, 0, b""))
                out.append(
                    _namespace_view(key, layout)
                    | {
                        "resident_blocks": ns.resident_blocks,
                        "resident_bytes": ns.resident_bytes,
                        "ssd_blocks": ssd_blocks,
                        "ssd_bytes": ssd_bytes,
                        "hits": ns.hits,
                        "misses": ns.misses,
                        "refused": dict(ns.refused),
                        "last_used": ns.last_used,
                    }
                )
            for key, (ssd_blocks, ssd_bytes, descriptor) in on_ssd.items():  # on SSD only (e.g. after a restart)
                layout = layout_from_descriptor(descriptor)
                assert layout is not None  # the tier keeps only namespaces whose descriptor builds
                out.append(
                    _namespace_view(key, layout)
                    | {
                        "resident_blocks": 0,
                        "resident_bytes": 0,
                        "ssd_blocks": ssd_blocks,
                        "ssd_bytes": ssd_bytes,
                        "hits": 0,
                        "misses": 0,
                        "refused": {},
                        "last_used": 0.0,
                    }
                )
            return out

    def compare(
        self, namespace_final: str, other_namespace_final: str = "", other_descriptor: bytes = b""
    ) -> tuple[list[LayoutDifference], str]:
        """How the layout of `namespace_final` (held here, in memory or on SSD) differs from another one held here or
        from another engine's descriptor: the differences and one line naming them (empty: compatible)."""
        if not namespace_final:
            raise InvalidArgument("namespace_final must not be empty")
        left = self._layout_named(namespace_final, "namespace_final")
        if other_namespace_final:
            right, other = self._layout_named(other_namespace_final, "other_namespace_final"), other_namespace_final
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

    def _layout_named(self, namespace_final: str, field: str) -> Layout:
        with self._lock:
            for ns, layout in self.store.namespace_stats():
                if ns.namespace_final == namespace_final:
                    return layout
            if self.ssd is not None:
                for (_, name), (_, _, descriptor) in self.ssd.namespaces().items():
                    if name == namespace_final and (layout := layout_from_descriptor(descriptor)) is not None:
                        return layout
        raise NotFound(f"{field} {quote(namespace_final)} is not held by this engine (see /v1/namespaces)")

    def purge(self, namespace_final: str, uid: int | None = None) -> list[dict[str, Any]]:
        """Drops a final namespace (every user's, or the one of `uid`) from memory and SSD. Pages a lease or a copy
        pins stay until released. One entry per (user, namespace) purged; empty when there is none."""
        with self._lock:
            keys = {
                (ns.tenant, ns.namespace_final)
                for ns, _ in self.store.namespace_stats()
                if ns.namespace_final == namespace_final and uid in (None, ns.tenant)
            }
            if self.ssd is not None:
                keys |= {k for k in self.ssd.namespaces() if k[1] == namespace_final and uid in (None, k[0])}
            out = []
            for key in sorted(keys):
                ns_id = self.store.namespace_id(*key)
                freed, left = self.store.purge(ns_id) if ns_id is not None else (0, 0)
                ssd_blocks = self.ssd.purge(key) if self.ssd is not None else 0
                out.append(
                    {
                        "namespace": key[1],
                        "uid": key[0],
                        "memory_blocks": freed,
                        "memory_blocks_in_use": left,
                        "ssd_blocks": ssd_blocks,
                    }
                )
            return out

    # ---------------------------------------------------------------- what other nodes may learn

    def track_blocks(self) -> None:
        """Start recording which blocks become resident or stop being (for block_changes)."""
        with self._lock:
            self.store.track_changes()

    def block_changes(self) -> dict[tuple[str, bytes], bool]:
        """(namespace_final, hash) -> resident now (True) or not (False), for every change since the last call.
        Only the engine's own user's blocks: other users' never leave the node."""
        own = _tenant(os.getuid())
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
        own = _tenant(os.getuid())
        with self._lock:
            return {
                ns.namespace_final: self.store.sealed_hashes(i)
                for i, (ns, _) in enumerate(self.store.namespace_stats())
                if ns.tenant == own and ns.resident_blocks
            }

    def statistics(self) -> EngineStatistics:
        with self._lock:
            return EngineStatistics(
                store=self.store.statistics(),
                counters=dataclasses.replace(self.counters),
                instances=len(self._instances),
                workers=sum(len(i.workers) for i in self._instances.values()),
                ssd=self.ssd.statistics() if self.ssd is not None else None,
            )


def _namespace_view(key: NamespaceKey, layout: Layout) -> dict[str, Any]:
    tenant, final = key
    return {
        "namespace": final,
        "client_namespace": final.rsplit(".", 1)[0],
        "uid": tenant,
        "fingerprint": layout.fingerprint,
        "digest": layout.digest.hex(),
        "block_size": layout.block_size,
        "tp_size": layout.tp_size,
        "num_layers": len(layout.layers),
        "page_bytes": layout.page_bytes,
        "descriptor": layout.descriptor.decode(),
    }


def _extent(layer: LayerRegistration) -> int:
    g = layer.geometry
    return layer_extent(layer.num_blocks, g.segments, g.segment_bytes, layer.strides)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _same_user(peer: Peer) -> bool:
    return peer.uid in (os.getuid(), 0)


def _tenant(uid: int | None) -> int:
    """Whose blocks an instance's are: its owner's uid, with root and the engine's own user as one tenant."""
    assert uid is not None  # instances are registered over the lane, where the kernel names the uid
    return os.getuid() if uid in (os.getuid(), 0) else uid


def _check_access(inst: _Instance, peer: Peer) -> None:
    if not peer.privileged and peer.uid != inst.uid:
        raise PermissionDenied(f"instance_id {quote(inst.registry.instance_id)} belongs to another user")


def _check_hashes(hashes: Sequence[bytes]) -> list[bytes]:
    """The checked hashes as a list: a protobuf repeated field builds a new bytes object on every access, so it
    is walked once here and the list is what the store and the copier walk."""
    if len(hashes) > MAX_BLOCKS_PER_REQUEST:
        raise InvalidArgument(f"block_hashes: at most {MAX_BLOCKS_PER_REQUEST} per request, got {len(hashes)}")
    hashes = list(hashes)
    if hashes and (min(map(len, hashes)) == 0 or max(map(len, hashes)) > MAX_HASH_BYTES):
        bad = next(i for i, h in enumerate(hashes) if not 0 < len(h) <= MAX_HASH_BYTES)
        raise InvalidArgument(f"block_hashes[{bad}] must be 1..{MAX_HASH_BYTES} bytes, got {len(hashes[bad])}")
    return hashes


def _check_blocks(hashes: Sequence[bytes], block_ids: Sequence[int]) -> tuple[list[bytes], list[int]]:
    """The checked hashes and block ids, as lists (see _check_hashes)."""
    hashes = _check_hashes(hashes)
    if len(block_ids) != len(hashes):
        raise InvalidArgument(f"block_ids has {len(block_ids)} entries but block_hashes has {len(hashes)}")
    return hashes, list(block_ids)


def _check_block_range(block_ids: Sequence[int], num_blocks: int) -> None:
    if block_ids and max(block_ids) >= num_blocks:
        bad = next(i for i, b in enumerate(block_ids) if b >= num_blocks)
        raise InvalidArgument(
            f"block_ids[{bad}] = {block_ids[bad]} is out of range: the worker registered {num_blocks} blocks"
        )
