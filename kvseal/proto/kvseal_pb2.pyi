from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShmHandle(_message.Message):
    __slots__ = ("offset", "size", "fd")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    offset: int
    size: int
    fd: int
    def __init__(self, offset: _Optional[int] = ..., size: _Optional[int] = ..., fd: _Optional[int] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("device", "handle", "storage_size", "storage_offset", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "offset")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    device: int
    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    offset: int
    def __init__(self, device: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_size: _Optional[int] = ..., storage_offset: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., offset: _Optional[int] = ...) -> None: ...

class MemoryHandle(_message.Message):
    __slots__ = ("shm", "cuda")
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    shm: ShmHandle
    cuda: CudaIpcHandle
    def __init__(self, shm: _Optional[_Union[ShmHandle, _Mapping]] = ..., cuda: _Optional[_Union[CudaIpcHandle, _Mapping]] = ...) -> None: ...

class LayerSpec(_message.Message):
    __slots__ = ("name", "dtype", "segment_bytes", "segments", "group_id", "layout_tag", "num_blocks", "strides", "memory", "table")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_TAG_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STRIDES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    segment_bytes: int
    segments: int
    group_id: int
    layout_tag: str
    num_blocks: int
    strides: _containers.RepeatedScalarFieldContainer[int]
    memory: MemoryHandle
    table: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., segment_bytes: _Optional[int] = ..., segments: _Optional[int] = ..., group_id: _Optional[int] = ..., layout_tag: _Optional[str] = ..., num_blocks: _Optional[int] = ..., strides: _Optional[_Iterable[int]] = ..., memory: _Optional[_Union[MemoryHandle, _Mapping]] = ..., table: _Optional[int] = ...) -> None: ...

class WorkerId(_message.Message):
    __slots__ = ("instance_id", "tp_rank", "pp_rank")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    tp_rank: int
    pp_rank: int
    def __init__(self, instance_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., pp_rank: _Optional[int] = ...) -> None: ...

class InstanceStatus(_message.Message):
    __slots__ = ("sealed", "registered", "world_size", "namespace_final", "fingerprint", "digest", "num_layers", "page_bytes", "descriptor")
    SEALED_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FINAL_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    sealed: bool
    registered: int
    world_size: int
    namespace_final: str
    fingerprint: str
    digest: str
    num_layers: int
    page_bytes: int
    descriptor: bytes
    def __init__(self, sealed: _Optional[bool] = ..., registered: _Optional[int] = ..., world_size: _Optional[int] = ..., namespace_final: _Optional[str] = ..., fingerprint: _Optional[str] = ..., digest: _Optional[str] = ..., num_layers: _Optional[int] = ..., page_bytes: _Optional[int] = ..., descriptor: _Optional[bytes] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("instance_id",)
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    def __init__(self, instance_id: _Optional[str] = ...) -> None: ...

class KvGroup(_message.Message):
    __slots__ = ("kind", "block_size", "span")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPAN_FIELD_NUMBER: _ClassVar[int]
    kind: str
    block_size: int
    span: int
    def __init__(self, kind: _Optional[str] = ..., block_size: _Optional[int] = ..., span: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("instance_id", "namespace", "tp_rank", "tp_size", "pp_rank", "world_size", "block_size", "layers", "groups", "eagle_groups")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    EAGLE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    namespace: str
    tp_rank: int
    tp_size: int
    pp_rank: int
    world_size: int
    block_size: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerSpec]
    groups: _containers.RepeatedCompositeFieldContainer[KvGroup]
    eagle_groups: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, instance_id: _Optional[str] = ..., namespace: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., pp_rank: _Optional[int] = ..., world_size: _Optional[int] = ..., block_size: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerSpec, _Mapping]]] = ..., groups: _Optional[_Iterable[_Union[KvGroup, _Mapping]]] = ..., eagle_groups: _Optional[_Iterable[int]] = ...) -> None: ...

class SaveResponse(_message.Message):
    __slots__ = ("written", "skipped", "not_stored", "completed", "namespace_final")
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    NOT_STORED_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FINAL_FIELD_NUMBER: _ClassVar[int]
    written: int
    skipped: int
    not_stored: int
    completed: int
    namespace_final: str
    def __init__(self, written: _Optional[int] = ..., skipped: _Optional[int] = ..., not_stored: _Optional[int] = ..., completed: _Optional[int] = ..., namespace_final: _Optional[str] = ...) -> None: ...

class QueryRequest(_message.Message):
    __slots__ = ("instance_id", "block_hashes", "request_id", "lease_ttl_ms", "max_tokens")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    request_id: str
    lease_ttl_ms: int
    max_tokens: int
    def __init__(self, instance_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., request_id: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class QueryResponse(_message.Message):
    __slots__ = ("hits", "lease_id", "loading", "namespace_final", "lease_ttl_ms")
    HITS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LOADING_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FINAL_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    hits: int
    lease_id: int
    loading: bool
    namespace_final: str
    lease_ttl_ms: int
    def __init__(self, hits: _Optional[int] = ..., lease_id: _Optional[int] = ..., loading: _Optional[bool] = ..., namespace_final: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("outcome", "loaded", "reason", "message")
    class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OUTCOME_UNSPECIFIED: _ClassVar[LoadResponse.Outcome]
        LOADED: _ClassVar[LoadResponse.Outcome]
        MISSING: _ClassVar[LoadResponse.Outcome]
        REFUSED: _ClassVar[LoadResponse.Outcome]
    OUTCOME_UNSPECIFIED: LoadResponse.Outcome
    LOADED: LoadResponse.Outcome
    MISSING: LoadResponse.Outcome
    REFUSED: LoadResponse.Outcome
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    outcome: LoadResponse.Outcome
    loaded: int
    reason: str
    message: str
    def __init__(self, outcome: _Optional[_Union[LoadResponse.Outcome, str]] = ..., loaded: _Optional[int] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("instance_id", "lease_id")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    lease_id: int
    def __init__(self, instance_id: _Optional[str] = ..., lease_id: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("version", "pool_bytes", "lane_socket", "node_id")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    LANE_SOCKET_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    version: str
    pool_bytes: int
    lane_socket: str
    node_id: str
    def __init__(self, version: _Optional[str] = ..., pool_bytes: _Optional[int] = ..., lane_socket: _Optional[str] = ..., node_id: _Optional[str] = ...) -> None: ...

class CompareRequest(_message.Message):
    __slots__ = ("namespace_final", "other_namespace_final", "other_descriptor")
    NAMESPACE_FINAL_FIELD_NUMBER: _ClassVar[int]
    OTHER_NAMESPACE_FINAL_FIELD_NUMBER: _ClassVar[int]
    OTHER_DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    namespace_final: str
    other_namespace_final: str
    other_descriptor: bytes
    def __init__(self, namespace_final: _Optional[str] = ..., other_namespace_final: _Optional[str] = ..., other_descriptor: _Optional[bytes] = ...) -> None: ...

class LayoutDifference(_message.Message):
    __slots__ = ("field", "layer", "left", "right")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    RIGHT_FIELD_NUMBER: _ClassVar[int]
    field: str
    layer: str
    left: str
    right: str
    def __init__(self, field: _Optional[str] = ..., layer: _Optional[str] = ..., left: _Optional[str] = ..., right: _Optional[str] = ...) -> None: ...

class CompareResponse(_message.Message):
    __slots__ = ("compatible", "message", "differences")
    COMPATIBLE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DIFFERENCES_FIELD_NUMBER: _ClassVar[int]
    compatible: bool
    message: str
    differences: _containers.RepeatedCompositeFieldContainer[LayoutDifference]
    def __init__(self, compatible: _Optional[bool] = ..., message: _Optional[str] = ..., differences: _Optional[_Iterable[_Union[LayoutDifference, _Mapping]]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "session", "address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    session: str
    address: str
    def __init__(self, node_id: _Optional[str] = ..., session: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("epoch", "stale_after_ms", "new_session")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STALE_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    NEW_SESSION_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    stale_after_ms: int
    new_session: bool
    def __init__(self, epoch: _Optional[str] = ..., stale_after_ms: _Optional[int] = ..., new_session: _Optional[bool] = ...) -> None: ...

class NamespaceBlocks(_message.Message):
    __slots__ = ("namespace_final", "block_hashes")
    NAMESPACE_FINAL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace_final: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace_final: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class BlocksRequest(_message.Message):
    __slots__ = ("node_id", "session", "blocks")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    session: str
    blocks: _containers.RepeatedCompositeFieldContainer[NamespaceBlocks]
    def __init__(self, node_id: _Optional[str] = ..., session: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[NamespaceBlocks, _Mapping]]] = ...) -> None: ...

class BlocksResponse(_message.Message):
    __slots__ = ("changed",)
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    changed: int
    def __init__(self, changed: _Optional[int] = ...) -> None: ...

class QueryPrefixRequest(_message.Message):
    __slots__ = ("namespace_final", "block_hashes")
    NAMESPACE_FINAL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace_final: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace_final: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class NodePrefix(_message.Message):
    __slots__ = ("node_id", "address", "prefix")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    prefix: int
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., prefix: _Optional[int] = ...) -> None: ...

class QueryPrefixResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodePrefix]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodePrefix, _Mapping]]] = ...) -> None: ...

class UnregisterNodeRequest(_message.Message):
    __slots__ = ("node_id", "session")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    session: str
    def __init__(self, node_id: _Optional[str] = ..., session: _Optional[str] = ...) -> None: ...

class UnregisterNodeResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    def __init__(self, removed: _Optional[bool] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node_id", "address", "expires_in_ms", "blocks")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_MS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    expires_in_ms: int
    blocks: int
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., expires_in_ms: _Optional[int] = ..., blocks: _Optional[int] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ...) -> None: ...
