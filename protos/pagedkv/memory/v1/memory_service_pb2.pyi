from pagedkv.grant.v1 import grant_pb2 as _grant_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PoolBackend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOL_BACKEND_UNSPECIFIED: _ClassVar[PoolBackend]
    POOL_BACKEND_CPU: _ClassVar[PoolBackend]
    POOL_BACKEND_CUDA: _ClassVar[PoolBackend]

class FreeReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FREE_REASON_UNSPECIFIED: _ClassVar[FreeReason]
    FREE_REASON_FINISHED: _ClassVar[FreeReason]
    FREE_REASON_PREEMPTED: _ClassVar[FreeReason]
    FREE_REASON_ABORTED: _ClassVar[FreeReason]

class PoolSizingSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOL_SIZING_SOURCE_UNSPECIFIED: _ClassVar[PoolSizingSource]
    POOL_SIZING_SOURCE_NUM_BLOCKS: _ClassVar[PoolSizingSource]
    POOL_SIZING_SOURCE_KV_CACHE_MEMORY: _ClassVar[PoolSizingSource]
    POOL_SIZING_SOURCE_GPU_MEMORY_UTILIZATION: _ClassVar[PoolSizingSource]
    POOL_SIZING_SOURCE_DEFAULT: _ClassVar[PoolSizingSource]
POOL_BACKEND_UNSPECIFIED: PoolBackend
POOL_BACKEND_CPU: PoolBackend
POOL_BACKEND_CUDA: PoolBackend
FREE_REASON_UNSPECIFIED: FreeReason
FREE_REASON_FINISHED: FreeReason
FREE_REASON_PREEMPTED: FreeReason
FREE_REASON_ABORTED: FreeReason
POOL_SIZING_SOURCE_UNSPECIFIED: PoolSizingSource
POOL_SIZING_SOURCE_NUM_BLOCKS: PoolSizingSource
POOL_SIZING_SOURCE_KV_CACHE_MEMORY: PoolSizingSource
POOL_SIZING_SOURCE_GPU_MEMORY_UTILIZATION: PoolSizingSource
POOL_SIZING_SOURCE_DEFAULT: PoolSizingSource

class PoolLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "num_blocks")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    num_blocks: int
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class PoolDescriptor(_message.Message):
    __slots__ = ("pool_id", "generation", "backend", "layout", "dim_names", "shape", "strides", "nbytes", "block_nbytes", "shm_path", "cuda_ipc_handle", "cuda_offset", "cuda_device_uuid", "model", "owner_pid", "worker_socket", "host_num_blocks", "host_nbytes", "node_name", "transfer_sources", "kv_scales", "disk_tier")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DIM_NAMES_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDES_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    CUDA_OFFSET_FIELD_NUMBER: _ClassVar[int]
    CUDA_DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OWNER_PID_FIELD_NUMBER: _ClassVar[int]
    WORKER_SOCKET_FIELD_NUMBER: _ClassVar[int]
    HOST_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_NBYTES_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SOURCES_FIELD_NUMBER: _ClassVar[int]
    KV_SCALES_FIELD_NUMBER: _ClassVar[int]
    DISK_TIER_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    generation: int
    backend: PoolBackend
    layout: PoolLayout
    dim_names: _containers.RepeatedScalarFieldContainer[str]
    shape: _containers.RepeatedScalarFieldContainer[int]
    strides: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    block_nbytes: int
    shm_path: str
    cuda_ipc_handle: bytes
    cuda_offset: int
    cuda_device_uuid: str
    model: str
    owner_pid: int
    worker_socket: str
    host_num_blocks: int
    host_nbytes: int
    node_name: str
    transfer_sources: _containers.RepeatedCompositeFieldContainer[_grant_pb2.TransferSource]
    kv_scales: KvScales
    disk_tier: DiskTierInfo
    def __init__(self, pool_id: _Optional[str] = ..., generation: _Optional[int] = ..., backend: _Optional[_Union[PoolBackend, str]] = ..., layout: _Optional[_Union[PoolLayout, _Mapping]] = ..., dim_names: _Optional[_Iterable[str]] = ..., shape: _Optional[_Iterable[int]] = ..., strides: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., block_nbytes: _Optional[int] = ..., shm_path: _Optional[str] = ..., cuda_ipc_handle: _Optional[bytes] = ..., cuda_offset: _Optional[int] = ..., cuda_device_uuid: _Optional[str] = ..., model: _Optional[str] = ..., owner_pid: _Optional[int] = ..., worker_socket: _Optional[str] = ..., host_num_blocks: _Optional[int] = ..., host_nbytes: _Optional[int] = ..., node_name: _Optional[str] = ..., transfer_sources: _Optional[_Iterable[_Union[_grant_pb2.TransferSource, _Mapping]]] = ..., kv_scales: _Optional[_Union[KvScales, _Mapping]] = ..., disk_tier: _Optional[_Union[DiskTierInfo, _Mapping]] = ...) -> None: ...

class DiskTierInfo(_message.Message):
    __slots__ = ("folder", "slot_bytes", "slots_per_slab", "num_slots", "identity")
    FOLDER_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_PER_SLAB_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    folder: str
    slot_bytes: int
    slots_per_slab: int
    num_slots: int
    identity: bytes
    def __init__(self, folder: _Optional[str] = ..., slot_bytes: _Optional[int] = ..., slots_per_slab: _Optional[int] = ..., num_slots: _Optional[int] = ..., identity: _Optional[bytes] = ...) -> None: ...

class KvScales(_message.Message):
    __slots__ = ("k_scale", "v_scale", "source")
    K_SCALE_FIELD_NUMBER: _ClassVar[int]
    V_SCALE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    k_scale: _containers.RepeatedScalarFieldContainer[float]
    v_scale: _containers.RepeatedScalarFieldContainer[float]
    source: str
    def __init__(self, k_scale: _Optional[_Iterable[float]] = ..., v_scale: _Optional[_Iterable[float]] = ..., source: _Optional[str] = ...) -> None: ...

class CreateLeaseRequest(_message.Message):
    __slots__ = ("ttl_seconds", "owner")
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    ttl_seconds: float
    owner: str
    def __init__(self, ttl_seconds: _Optional[float] = ..., owner: _Optional[str] = ...) -> None: ...

class CreateLeaseResponse(_message.Message):
    __slots__ = ("lease_id", "ttl_seconds", "lease_secret", "max_blocks")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECRET_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    ttl_seconds: float
    lease_secret: str
    max_blocks: int
    def __init__(self, lease_id: _Optional[str] = ..., ttl_seconds: _Optional[float] = ..., lease_secret: _Optional[str] = ..., max_blocks: _Optional[int] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("expires_in_seconds",)
    EXPIRES_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    expires_in_seconds: float
    def __init__(self, expires_in_seconds: _Optional[float] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("freed_sequences",)
    FREED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    freed_sequences: int
    def __init__(self, freed_sequences: _Optional[int] = ...) -> None: ...

class GetPoolDescriptorRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetPoolDescriptorResponse(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: PoolDescriptor
    def __init__(self, pool: _Optional[_Union[PoolDescriptor, _Mapping]] = ...) -> None: ...

class SequenceBlockTable(_message.Message):
    __slots__ = ("seq_id", "num_tokens", "block_ids", "num_cached_tokens", "num_reloaded_tokens", "num_transferred_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_RELOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERRED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_tokens: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    num_reloaded_tokens: int
    num_transferred_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., num_tokens: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ..., num_reloaded_tokens: _Optional[int] = ..., num_transferred_tokens: _Optional[int] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("src", "dst", "src_medium", "dst_medium", "seq_id")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    SRC_MEDIUM_FIELD_NUMBER: _ClassVar[int]
    DST_MEDIUM_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    src_medium: _grant_pb2.Medium
    dst_medium: _grant_pb2.Medium
    seq_id: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ..., src_medium: _Optional[_Union[_grant_pb2.Medium, str]] = ..., dst_medium: _Optional[_Union[_grant_pb2.Medium, str]] = ..., seq_id: _Optional[int] = ...) -> None: ...

class SequenceAllocation(_message.Message):
    __slots__ = ("num_tokens", "token_ids", "cache_salt", "model_id", "remote_prefix")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    model_id: str
    remote_prefix: TransferTicket
    def __init__(self, num_tokens: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., model_id: _Optional[str] = ..., remote_prefix: _Optional[_Union[TransferTicket, _Mapping]] = ...) -> None: ...

class TransferTicket(_message.Message):
    __slots__ = ("node_name", "pool_generation", "layout", "block_ids", "block_epochs", "block_hashes", "source", "expires_at", "signature", "model")
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    POOL_GENERATION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    pool_generation: int
    layout: PoolLayout
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_epochs: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    source: _grant_pb2.TransferSource
    expires_at: float
    signature: bytes
    model: str
    def __init__(self, node_name: _Optional[str] = ..., pool_generation: _Optional[int] = ..., layout: _Optional[_Union[PoolLayout, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., block_epochs: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., source: _Optional[_Union[_grant_pb2.TransferSource, _Mapping]] = ..., expires_at: _Optional[float] = ..., signature: _Optional[bytes] = ..., model: _Optional[str] = ...) -> None: ...

class PublishTransferSourceRequest(_message.Message):
    __slots__ = ("pool_generation", "source", "signature", "withdraw")
    POOL_GENERATION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    WITHDRAW_FIELD_NUMBER: _ClassVar[int]
    pool_generation: int
    source: _grant_pb2.TransferSource
    signature: bytes
    withdraw: bool
    def __init__(self, pool_generation: _Optional[int] = ..., source: _Optional[_Union[_grant_pb2.TransferSource, _Mapping]] = ..., signature: _Optional[bytes] = ..., withdraw: bool = ...) -> None: ...

class PublishTransferSourceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetKvScalesRequest(_message.Message):
    __slots__ = ("pool_generation", "scales", "signature")
    POOL_GENERATION_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    pool_generation: int
    scales: KvScales
    signature: bytes
    def __init__(self, pool_generation: _Optional[int] = ..., scales: _Optional[_Union[KvScales, _Mapping]] = ..., signature: _Optional[bytes] = ...) -> None: ...

class SetKvScalesResponse(_message.Message):
    __slots__ = ("scales", "accepted")
    SCALES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    scales: KvScales
    accepted: bool
    def __init__(self, scales: _Optional[_Union[KvScales, _Mapping]] = ..., accepted: bool = ...) -> None: ...

class ExportPrefixRequest(_message.Message):
    __slots__ = ("lease_id", "token_ids", "model_id", "cache_salt")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    model_id: str
    cache_salt: str
    def __init__(self, lease_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., model_id: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class ExportPrefixResponse(_message.Message):
    __slots__ = ("num_tokens", "seq_id", "ticket")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    seq_id: int
    ticket: TransferTicket
    def __init__(self, num_tokens: _Optional[int] = ..., seq_id: _Optional[int] = ..., ticket: _Optional[_Union[TransferTicket, _Mapping]] = ...) -> None: ...

class AllocateSequencesRequest(_message.Message):
    __slots__ = ("lease_id", "sequences")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceAllocation]
    def __init__(self, lease_id: _Optional[str] = ..., sequences: _Optional[_Iterable[_Union[SequenceAllocation, _Mapping]]] = ...) -> None: ...

class AllocateSequencesResponse(_message.Message):
    __slots__ = ("sequences", "grants", "copies")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceBlockTable]
    grants: _containers.RepeatedCompositeFieldContainer[_grant_pb2.StepGrant]
    copies: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    def __init__(self, sequences: _Optional[_Iterable[_Union[SequenceBlockTable, _Mapping]]] = ..., grants: _Optional[_Iterable[_Union[_grant_pb2.StepGrant, _Mapping]]] = ..., copies: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ...) -> None: ...

class SlotAppend(_message.Message):
    __slots__ = ("seq_id", "num_tokens", "token_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_tokens: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., num_tokens: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AppendSlotsRequest(_message.Message):
    __slots__ = ("lease_id", "appends", "receipts")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    APPENDS_FIELD_NUMBER: _ClassVar[int]
    RECEIPTS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    appends: _containers.RepeatedCompositeFieldContainer[SlotAppend]
    receipts: _containers.RepeatedCompositeFieldContainer[_grant_pb2.StepReceipt]
    def __init__(self, lease_id: _Optional[str] = ..., appends: _Optional[_Iterable[_Union[SlotAppend, _Mapping]]] = ..., receipts: _Optional[_Iterable[_Union[_grant_pb2.StepReceipt, _Mapping]]] = ...) -> None: ...

class BlockTableUpdate(_message.Message):
    __slots__ = ("seq_id", "num_tokens", "first_changed", "block_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHANGED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_tokens: int
    first_changed: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., num_tokens: _Optional[int] = ..., first_changed: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AppendSlotsResponse(_message.Message):
    __slots__ = ("updates", "copies", "grants", "blocks_registered", "receipts_skipped", "committed_grants")
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    RECEIPTS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_GRANTS_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[BlockTableUpdate]
    copies: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    grants: _containers.RepeatedCompositeFieldContainer[_grant_pb2.StepGrant]
    blocks_registered: int
    receipts_skipped: int
    committed_grants: _containers.RepeatedCompositeFieldContainer[_grant_pb2.StepGrant]
    def __init__(self, updates: _Optional[_Iterable[_Union[BlockTableUpdate, _Mapping]]] = ..., copies: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., grants: _Optional[_Iterable[_Union[_grant_pb2.StepGrant, _Mapping]]] = ..., blocks_registered: _Optional[int] = ..., receipts_skipped: _Optional[int] = ..., committed_grants: _Optional[_Iterable[_Union[_grant_pb2.StepGrant, _Mapping]]] = ...) -> None: ...

class SequenceFork(_message.Message):
    __slots__ = ("parent_seq_id", "proven_only")
    PARENT_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROVEN_ONLY_FIELD_NUMBER: _ClassVar[int]
    parent_seq_id: int
    proven_only: bool
    def __init__(self, parent_seq_id: _Optional[int] = ..., proven_only: bool = ...) -> None: ...

class ForkSequencesRequest(_message.Message):
    __slots__ = ("lease_id", "forks")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    FORKS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    forks: _containers.RepeatedCompositeFieldContainer[SequenceFork]
    def __init__(self, lease_id: _Optional[str] = ..., forks: _Optional[_Iterable[_Union[SequenceFork, _Mapping]]] = ...) -> None: ...

class ForkSequencesResponse(_message.Message):
    __slots__ = ("children", "grants")
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    children: _containers.RepeatedCompositeFieldContainer[SequenceBlockTable]
    grants: _containers.RepeatedCompositeFieldContainer[_grant_pb2.StepGrant]
    def __init__(self, children: _Optional[_Iterable[_Union[SequenceBlockTable, _Mapping]]] = ..., grants: _Optional[_Iterable[_Union[_grant_pb2.StepGrant, _Mapping]]] = ...) -> None: ...

class FreeSequencesRequest(_message.Message):
    __slots__ = ("lease_id", "seq_ids", "reason")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    reason: FreeReason
    def __init__(self, lease_id: _Optional[str] = ..., seq_ids: _Optional[_Iterable[int]] = ..., reason: _Optional[_Union[FreeReason, str]] = ...) -> None: ...

class FreeSequencesResponse(_message.Message):
    __slots__ = ("freed_blocks",)
    FREED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    freed_blocks: int
    def __init__(self, freed_blocks: _Optional[int] = ...) -> None: ...

class GetBlockTableRequest(_message.Message):
    __slots__ = ("seq_id",)
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    def __init__(self, seq_id: _Optional[int] = ...) -> None: ...

class SequenceInfo(_message.Message):
    __slots__ = ("seq_id", "lease_id", "num_tokens", "block_ids", "ref_counts", "parent_seq_id", "media", "swapped")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTS_FIELD_NUMBER: _ClassVar[int]
    PARENT_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    lease_id: str
    num_tokens: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    ref_counts: _containers.RepeatedScalarFieldContainer[int]
    parent_seq_id: int
    media: _containers.RepeatedScalarFieldContainer[_grant_pb2.Medium]
    swapped: bool
    def __init__(self, seq_id: _Optional[int] = ..., lease_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., ref_counts: _Optional[_Iterable[int]] = ..., parent_seq_id: _Optional[int] = ..., media: _Optional[_Iterable[_Union[_grant_pb2.Medium, str]]] = ..., swapped: bool = ...) -> None: ...

class GetBlockTableResponse(_message.Message):
    __slots__ = ("sequence",)
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    sequence: SequenceInfo
    def __init__(self, sequence: _Optional[_Union[SequenceInfo, _Mapping]] = ...) -> None: ...

class ListSequencesRequest(_message.Message):
    __slots__ = ("lease_id", "page_size", "page_token")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    page_size: int
    page_token: str
    def __init__(self, lease_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListSequencesResponse(_message.Message):
    __slots__ = ("sequences", "next_page_token")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceInfo]
    next_page_token: str
    def __init__(self, sequences: _Optional[_Iterable[_Union[SequenceInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("total_blocks", "free_blocks", "cached_blocks", "used_blocks", "available_blocks", "block_size", "tokens_stored", "utilization", "num_sequences", "num_leases", "allocation_failures", "preemptions", "prefix_cache_queries", "prefix_cache_hits", "shared_block_refs", "generation", "prefix_cache_evictions", "prefix_caching", "host_total_blocks", "host_free_blocks", "host_cached_blocks", "host_used_blocks", "offloads", "reloads", "host_cache_hits", "swap_outs", "swap_ins", "swapped_sequences", "offloads_dropped", "host_cache_evictions", "kv_cache_dtype", "kv_bytes_per_token", "token_capacity", "pool_bytes", "disk", "pins", "sizing")
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_STORED_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_FAILURES_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    SHARED_BLOCK_REFS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    HOST_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OFFLOADS_FIELD_NUMBER: _ClassVar[int]
    RELOADS_FIELD_NUMBER: _ClassVar[int]
    HOST_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUTS_FIELD_NUMBER: _ClassVar[int]
    SWAP_INS_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    OFFLOADS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    HOST_CACHE_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    SIZING_FIELD_NUMBER: _ClassVar[int]
    total_blocks: int
    free_blocks: int
    cached_blocks: int
    used_blocks: int
    available_blocks: int
    block_size: int
    tokens_stored: int
    utilization: float
    num_sequences: int
    num_leases: int
    allocation_failures: int
    preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    shared_block_refs: int
    generation: int
    prefix_cache_evictions: int
    prefix_caching: bool
    host_total_blocks: int
    host_free_blocks: int
    host_cached_blocks: int
    host_used_blocks: int
    offloads: int
    reloads: int
    host_cache_hits: int
    swap_outs: int
    swap_ins: int
    swapped_sequences: int
    offloads_dropped: int
    host_cache_evictions: int
    kv_cache_dtype: str
    kv_bytes_per_token: int
    token_capacity: int
    pool_bytes: int
    disk: DiskTierStats
    pins: PinStats
    sizing: PoolSizing
    def __init__(self, total_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., available_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., tokens_stored: _Optional[int] = ..., utilization: _Optional[float] = ..., num_sequences: _Optional[int] = ..., num_leases: _Optional[int] = ..., allocation_failures: _Optional[int] = ..., preemptions: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., shared_block_refs: _Optional[int] = ..., generation: _Optional[int] = ..., prefix_cache_evictions: _Optional[int] = ..., prefix_caching: bool = ..., host_total_blocks: _Optional[int] = ..., host_free_blocks: _Optional[int] = ..., host_cached_blocks: _Optional[int] = ..., host_used_blocks: _Optional[int] = ..., offloads: _Optional[int] = ..., reloads: _Optional[int] = ..., host_cache_hits: _Optional[int] = ..., swap_outs: _Optional[int] = ..., swap_ins: _Optional[int] = ..., swapped_sequences: _Optional[int] = ..., offloads_dropped: _Optional[int] = ..., host_cache_evictions: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., kv_bytes_per_token: _Optional[int] = ..., token_capacity: _Optional[int] = ..., pool_bytes: _Optional[int] = ..., disk: _Optional[_Union[DiskTierStats, _Mapping]] = ..., pins: _Optional[_Union[PinStats, _Mapping]] = ..., sizing: _Optional[_Union[PoolSizing, _Mapping]] = ...) -> None: ...

class PoolSizing(_message.Message):
    __slots__ = ("source", "requested_bytes", "device_total_bytes", "utilization", "weight_bytes", "reserve_bytes", "workers_per_device", "max_num_batched_tokens", "weights_from")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_PER_DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FROM_FIELD_NUMBER: _ClassVar[int]
    source: PoolSizingSource
    requested_bytes: int
    device_total_bytes: int
    utilization: float
    weight_bytes: int
    reserve_bytes: int
    workers_per_device: int
    max_num_batched_tokens: int
    weights_from: str
    def __init__(self, source: _Optional[_Union[PoolSizingSource, str]] = ..., requested_bytes: _Optional[int] = ..., device_total_bytes: _Optional[int] = ..., utilization: _Optional[float] = ..., weight_bytes: _Optional[int] = ..., reserve_bytes: _Optional[int] = ..., workers_per_device: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., weights_from: _Optional[str] = ...) -> None: ...

class DiskTierStats(_message.Message):
    __slots__ = ("blocks", "bytes", "slots", "hits", "writes", "reads", "dropped", "checksum_failures", "evictions", "recovered")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    WRITES_FIELD_NUMBER: _ClassVar[int]
    READS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    bytes: int
    slots: int
    hits: int
    writes: int
    reads: int
    dropped: int
    checksum_failures: int
    evictions: int
    recovered: int
    def __init__(self, blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., slots: _Optional[int] = ..., hits: _Optional[int] = ..., writes: _Optional[int] = ..., reads: _Optional[int] = ..., dropped: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., evictions: _Optional[int] = ..., recovered: _Optional[int] = ...) -> None: ...

class PrefetchPrefixRequest(_message.Message):
    __slots__ = ("token_ids", "model_id", "cache_salt", "lease_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    model_id: str
    cache_salt: str
    lease_id: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., model_id: _Optional[str] = ..., cache_salt: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class PrefetchPrefixResponse(_message.Message):
    __slots__ = ("device_tokens", "host_tokens", "disk_tokens", "disk_reads_pending")
    DEVICE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISK_READS_PENDING_FIELD_NUMBER: _ClassVar[int]
    device_tokens: int
    host_tokens: int
    disk_tokens: int
    disk_reads_pending: int
    def __init__(self, device_tokens: _Optional[int] = ..., host_tokens: _Optional[int] = ..., disk_tokens: _Optional[int] = ..., disk_reads_pending: _Optional[int] = ...) -> None: ...

class TakeDiskWorkRequest(_message.Message):
    __slots__ = ("max_copies", "lease_id")
    MAX_COPIES_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    max_copies: int
    lease_id: str
    def __init__(self, max_copies: _Optional[int] = ..., lease_id: _Optional[str] = ...) -> None: ...

class TakeDiskWorkResponse(_message.Message):
    __slots__ = ("copies",)
    COPIES_FIELD_NUMBER: _ClassVar[int]
    copies: _containers.RepeatedCompositeFieldContainer[_grant_pb2.DiskCopy]
    def __init__(self, copies: _Optional[_Iterable[_Union[_grant_pb2.DiskCopy, _Mapping]]] = ...) -> None: ...

class SettleDiskWorkRequest(_message.Message):
    __slots__ = ("receipts", "lease_id")
    RECEIPTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    receipts: _containers.RepeatedCompositeFieldContainer[_grant_pb2.DiskReceipt]
    lease_id: str
    def __init__(self, receipts: _Optional[_Iterable[_Union[_grant_pb2.DiskReceipt, _Mapping]]] = ..., lease_id: _Optional[str] = ...) -> None: ...

class SettleDiskWorkResponse(_message.Message):
    __slots__ = ("settled",)
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    settled: int
    def __init__(self, settled: _Optional[int] = ...) -> None: ...

class ComputedTokens(_message.Message):
    __slots__ = ("seq_id", "num_computed_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_computed_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ...) -> None: ...

class CommitComputedTokensRequest(_message.Message):
    __slots__ = ("lease_id", "sequences", "receipts")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    RECEIPTS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    sequences: _containers.RepeatedCompositeFieldContainer[ComputedTokens]
    receipts: _containers.RepeatedCompositeFieldContainer[_grant_pb2.StepReceipt]
    def __init__(self, lease_id: _Optional[str] = ..., sequences: _Optional[_Iterable[_Union[ComputedTokens, _Mapping]]] = ..., receipts: _Optional[_Iterable[_Union[_grant_pb2.StepReceipt, _Mapping]]] = ...) -> None: ...

class CommitComputedTokensResponse(_message.Message):
    __slots__ = ("blocks_registered", "skipped", "grants")
    BLOCKS_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    blocks_registered: int
    skipped: int
    grants: _containers.RepeatedCompositeFieldContainer[_grant_pb2.StepGrant]
    def __init__(self, blocks_registered: _Optional[int] = ..., skipped: _Optional[int] = ..., grants: _Optional[_Iterable[_Union[_grant_pb2.StepGrant, _Mapping]]] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("blocks_cleared",)
    BLOCKS_CLEARED_FIELD_NUMBER: _ClassVar[int]
    blocks_cleared: int
    def __init__(self, blocks_cleared: _Optional[int] = ...) -> None: ...

class CheckInvariantsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckInvariantsResponse(_message.Message):
    __slots__ = ("ok", "violation", "stats")
    OK_FIELD_NUMBER: _ClassVar[int]
    VIOLATION_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    violation: str
    stats: GetStatsResponse
    def __init__(self, ok: bool = ..., violation: _Optional[str] = ..., stats: _Optional[_Union[GetStatsResponse, _Mapping]] = ...) -> None: ...

class StreamKvEventsRequest(_message.Message):
    __slots__ = ("from_sequence_number",)
    FROM_SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    from_sequence_number: int
    def __init__(self, from_sequence_number: _Optional[int] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("sequence_number", "block_stored", "block_removed", "all_cleared")
    SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_CLEARED_FIELD_NUMBER: _ClassVar[int]
    sequence_number: int
    block_stored: BlockStored
    block_removed: BlockRemoved
    all_cleared: AllBlocksCleared
    def __init__(self, sequence_number: _Optional[int] = ..., block_stored: _Optional[_Union[BlockStored, _Mapping]] = ..., block_removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., all_cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hash", "parent_block_hash", "block_id", "token_ids", "medium")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    parent_block_hash: bytes
    block_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    medium: _grant_pb2.Medium
    def __init__(self, block_hash: _Optional[bytes] = ..., parent_block_hash: _Optional[bytes] = ..., block_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., medium: _Optional[_Union[_grant_pb2.Medium, str]] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hash", "block_id", "medium")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    block_id: int
    medium: _grant_pb2.Medium
    def __init__(self, block_hash: _Optional[bytes] = ..., block_id: _Optional[int] = ..., medium: _Optional[_Union[_grant_pb2.Medium, str]] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SwapOutSequencesRequest(_message.Message):
    __slots__ = ("lease_id", "seq_ids")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[str] = ..., seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SwapOutSequencesResponse(_message.Message):
    __slots__ = ("device_blocks_released", "host_blocks_reserved")
    DEVICE_BLOCKS_RELEASED_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_RESERVED_FIELD_NUMBER: _ClassVar[int]
    device_blocks_released: int
    host_blocks_reserved: int
    def __init__(self, device_blocks_released: _Optional[int] = ..., host_blocks_reserved: _Optional[int] = ...) -> None: ...

class SwapInSequencesRequest(_message.Message):
    __slots__ = ("lease_id", "seq_ids", "appends")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    APPENDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    appends: _containers.RepeatedCompositeFieldContainer[SlotAppend]
    def __init__(self, lease_id: _Optional[str] = ..., seq_ids: _Optional[_Iterable[int]] = ..., appends: _Optional[_Iterable[_Union[SlotAppend, _Mapping]]] = ...) -> None: ...

class SwapInSequencesResponse(_message.Message):
    __slots__ = ("sequences", "grants", "copies")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceBlockTable]
    grants: _containers.RepeatedCompositeFieldContainer[_grant_pb2.StepGrant]
    copies: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    def __init__(self, sequences: _Optional[_Iterable[_Union[SequenceBlockTable, _Mapping]]] = ..., grants: _Optional[_Iterable[_Union[_grant_pb2.StepGrant, _Mapping]]] = ..., copies: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ...) -> None: ...

class LookupPrefixRequest(_message.Message):
    __slots__ = ("token_ids", "model_id", "cache_salt")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    model_id: str
    cache_salt: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., model_id: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class LookupPrefixResponse(_message.Message):
    __slots__ = ("cached_tokens", "device_tokens", "host_tokens")
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: int
    device_tokens: int
    host_tokens: int
    def __init__(self, cached_tokens: _Optional[int] = ..., device_tokens: _Optional[int] = ..., host_tokens: _Optional[int] = ...) -> None: ...

class PinPrefixRequest(_message.Message):
    __slots__ = ("lease_id", "token_ids", "model_id", "cache_salt", "ttl_seconds", "priority", "label")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    model_id: str
    cache_salt: str
    ttl_seconds: float
    priority: int
    label: str
    def __init__(self, lease_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., model_id: _Optional[str] = ..., cache_salt: _Optional[str] = ..., ttl_seconds: _Optional[float] = ..., priority: _Optional[int] = ..., label: _Optional[str] = ...) -> None: ...

class PrefixPin(_message.Message):
    __slots__ = ("pin_id", "lease_id", "num_tokens", "block_ids", "priority", "expires_in_seconds", "label", "seq_id")
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    pin_id: str
    lease_id: str
    num_tokens: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    priority: int
    expires_in_seconds: float
    label: str
    seq_id: int
    def __init__(self, pin_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., priority: _Optional[int] = ..., expires_in_seconds: _Optional[float] = ..., label: _Optional[str] = ..., seq_id: _Optional[int] = ...) -> None: ...

class PinPrefixResponse(_message.Message):
    __slots__ = ("pin",)
    PIN_FIELD_NUMBER: _ClassVar[int]
    pin: PrefixPin
    def __init__(self, pin: _Optional[_Union[PrefixPin, _Mapping]] = ...) -> None: ...

class UnpinPrefixRequest(_message.Message):
    __slots__ = ("lease_id", "pin_id")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    pin_id: str
    def __init__(self, lease_id: _Optional[str] = ..., pin_id: _Optional[str] = ...) -> None: ...

class UnpinPrefixResponse(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...

class ListPinsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPinsResponse(_message.Message):
    __slots__ = ("pins",)
    PINS_FIELD_NUMBER: _ClassVar[int]
    pins: _containers.RepeatedCompositeFieldContainer[PrefixPin]
    def __init__(self, pins: _Optional[_Iterable[_Union[PrefixPin, _Mapping]]] = ...) -> None: ...

class PinStats(_message.Message):
    __slots__ = ("num_pins", "pinned_blocks", "pinned_tokens", "retained_blocks", "expired")
    NUM_PINS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PINNED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETAINED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    num_pins: int
    pinned_blocks: int
    pinned_tokens: int
    retained_blocks: int
    expired: int
    def __init__(self, num_pins: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., pinned_tokens: _Optional[int] = ..., retained_blocks: _Optional[int] = ..., expired: _Optional[int] = ...) -> None: ...
