from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Medium(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEDIUM_DEVICE: _ClassVar[Medium]
    MEDIUM_HOST: _ClassVar[Medium]
    MEDIUM_REMOTE: _ClassVar[Medium]
    MEDIUM_DISK: _ClassVar[Medium]
MEDIUM_DEVICE: Medium
MEDIUM_HOST: Medium
MEDIUM_REMOTE: Medium
MEDIUM_DISK: Medium

class TransferSource(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "base_address", "num_blocks", "block_bytes", "mem_type", "device_id")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    base_address: int
    num_blocks: int
    block_bytes: int
    mem_type: str
    device_id: int
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., base_address: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ..., mem_type: _Optional[str] = ..., device_id: _Optional[int] = ...) -> None: ...

class GrantedCopy(_message.Message):
    __slots__ = ("src", "src_epoch", "dst", "dst_epoch", "src_medium", "dst_medium", "src_source")
    SRC_FIELD_NUMBER: _ClassVar[int]
    SRC_EPOCH_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    DST_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SRC_MEDIUM_FIELD_NUMBER: _ClassVar[int]
    DST_MEDIUM_FIELD_NUMBER: _ClassVar[int]
    SRC_SOURCE_FIELD_NUMBER: _ClassVar[int]
    src: int
    src_epoch: int
    dst: int
    dst_epoch: int
    src_medium: Medium
    dst_medium: Medium
    src_source: bytes
    def __init__(self, src: _Optional[int] = ..., src_epoch: _Optional[int] = ..., dst: _Optional[int] = ..., dst_epoch: _Optional[int] = ..., src_medium: _Optional[_Union[Medium, str]] = ..., dst_medium: _Optional[_Union[Medium, str]] = ..., src_source: _Optional[bytes] = ...) -> None: ...

class StepGrant(_message.Message):
    __slots__ = ("pool_generation", "seq_id", "block_ids", "block_epochs", "readable_tokens", "write_end", "token_digest", "copies", "expires_at", "signature")
    POOL_GENERATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    READABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WRITE_END_FIELD_NUMBER: _ClassVar[int]
    TOKEN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    pool_generation: int
    seq_id: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_epochs: _containers.RepeatedScalarFieldContainer[int]
    readable_tokens: int
    write_end: int
    token_digest: bytes
    copies: _containers.RepeatedCompositeFieldContainer[GrantedCopy]
    expires_at: float
    signature: bytes
    def __init__(self, pool_generation: _Optional[int] = ..., seq_id: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., block_epochs: _Optional[_Iterable[int]] = ..., readable_tokens: _Optional[int] = ..., write_end: _Optional[int] = ..., token_digest: _Optional[bytes] = ..., copies: _Optional[_Iterable[_Union[GrantedCopy, _Mapping]]] = ..., expires_at: _Optional[float] = ..., signature: _Optional[bytes] = ...) -> None: ...

class StepReceipt(_message.Message):
    __slots__ = ("pool_generation", "seq_id", "start", "end", "token_digest", "block_ids", "block_epochs", "signature", "copies")
    POOL_GENERATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    TOKEN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    pool_generation: int
    seq_id: int
    start: int
    end: int
    token_digest: bytes
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_epochs: _containers.RepeatedScalarFieldContainer[int]
    signature: bytes
    copies: _containers.RepeatedCompositeFieldContainer[GrantedCopy]
    def __init__(self, pool_generation: _Optional[int] = ..., seq_id: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., token_digest: _Optional[bytes] = ..., block_ids: _Optional[_Iterable[int]] = ..., block_epochs: _Optional[_Iterable[int]] = ..., signature: _Optional[bytes] = ..., copies: _Optional[_Iterable[_Union[GrantedCopy, _Mapping]]] = ...) -> None: ...

class DiskCopy(_message.Message):
    __slots__ = ("pool_generation", "work_id", "write", "host_block", "host_epoch", "slot", "slot_epoch", "block_hash", "parent_hash", "token_ids", "sequence", "expires_at", "signature")
    POOL_GENERATION_FIELD_NUMBER: _ClassVar[int]
    WORK_ID_FIELD_NUMBER: _ClassVar[int]
    WRITE_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    HOST_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    SLOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    pool_generation: int
    work_id: int
    write: bool
    host_block: int
    host_epoch: int
    slot: int
    slot_epoch: int
    block_hash: bytes
    parent_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sequence: int
    expires_at: float
    signature: bytes
    def __init__(self, pool_generation: _Optional[int] = ..., work_id: _Optional[int] = ..., write: bool = ..., host_block: _Optional[int] = ..., host_epoch: _Optional[int] = ..., slot: _Optional[int] = ..., slot_epoch: _Optional[int] = ..., block_hash: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., sequence: _Optional[int] = ..., expires_at: _Optional[float] = ..., signature: _Optional[bytes] = ...) -> None: ...

class DiskReceipt(_message.Message):
    __slots__ = ("pool_generation", "work_id", "ok", "failure", "checksum", "signature")
    POOL_GENERATION_FIELD_NUMBER: _ClassVar[int]
    WORK_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    pool_generation: int
    work_id: int
    ok: bool
    failure: str
    checksum: bytes
    signature: bytes
    def __init__(self, pool_generation: _Optional[int] = ..., work_id: _Optional[int] = ..., ok: bool = ..., failure: _Optional[str] = ..., checksum: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...
