from google.rpc import status_pb2 as _status_pb2
from pagedkv.grant.v1 import grant_pb2 as _grant_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "num_logprobs", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p", "logit_bias", "min_tokens", "min_tokens_stop_ids")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    num_logprobs: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    min_p: float
    logit_bias: _containers.RepeatedCompositeFieldContainer[LogitBias]
    min_tokens: int
    min_tokens_stop_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., num_logprobs: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Iterable[_Union[LogitBias, _Mapping]]] = ..., min_tokens: _Optional[int] = ..., min_tokens_stop_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LogitBias(_message.Message):
    __slots__ = ("token_id", "bias")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    bias: float
    def __init__(self, token_id: _Optional[int] = ..., bias: _Optional[float] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class StepSequence(_message.Message):
    __slots__ = ("seq_id", "token_ids", "positions", "block_ids", "sampling", "output_index", "skip_sampling", "grant", "prompt_token_ids", "output_token_ids", "token_bitmask")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_INDEX_FIELD_NUMBER: _ClassVar[int]
    SKIP_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BITMASK_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    output_index: int
    skip_sampling: bool
    grant: _grant_pb2.StepGrant
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_bitmask: bytes
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., positions: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., output_index: _Optional[int] = ..., skip_sampling: bool = ..., grant: _Optional[_Union[_grant_pb2.StepGrant, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., token_bitmask: _Optional[bytes] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("pool_generation", "sequences", "copies", "transfer_sources")
    POOL_GENERATION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SOURCES_FIELD_NUMBER: _ClassVar[int]
    pool_generation: int
    sequences: _containers.RepeatedCompositeFieldContainer[StepSequence]
    copies: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    transfer_sources: _containers.RepeatedCompositeFieldContainer[_grant_pb2.TransferSource]
    def __init__(self, pool_generation: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[StepSequence, _Mapping]]] = ..., copies: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., transfer_sources: _Optional[_Iterable[_Union[_grant_pb2.TransferSource, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("seq_id", "token_id", "logprob", "top_logprobs", "receipt", "error")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    receipt: _grant_pb2.StepReceipt
    error: _status_pb2.Status
    def __init__(self, seq_id: _Optional[int] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., receipt: _Optional[_Union[_grant_pb2.StepReceipt, _Mapping]] = ..., error: _Optional[_Union[_status_pb2.Status, _Mapping]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("results", "model_seconds", "attention_seconds", "step_seconds", "num_tokens")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[StepResult]
    model_seconds: float
    attention_seconds: float
    step_seconds: float
    num_tokens: int
    def __init__(self, results: _Optional[_Iterable[_Union[StepResult, _Mapping]]] = ..., model_seconds: _Optional[float] = ..., attention_seconds: _Optional[float] = ..., step_seconds: _Optional[float] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model_name", "model_source", "weights_path", "vocab_size", "eos_token_ids", "bos_token_id", "max_context", "num_layers", "num_kv_heads", "head_dim", "dtype", "device", "pool_generation", "block_size", "num_blocks", "revision", "architecture", "sliding_window", "generation_defaults", "ignored_generation_keys", "instance_id", "cpu_path", "host_tier_page_locked")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_SOURCE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_PATH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    POOL_GENERATION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    GENERATION_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    IGNORED_GENERATION_KEYS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    CPU_PATH_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_PAGE_LOCKED_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_source: str
    weights_path: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token_id: int
    max_context: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    device: str
    pool_generation: int
    block_size: int
    num_blocks: int
    revision: str
    architecture: str
    sliding_window: int
    generation_defaults: GenerationDefaults
    ignored_generation_keys: _containers.RepeatedScalarFieldContainer[str]
    instance_id: str
    cpu_path: str
    host_tier_page_locked: bool
    def __init__(self, model_name: _Optional[str] = ..., model_source: _Optional[str] = ..., weights_path: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token_id: _Optional[int] = ..., max_context: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., pool_generation: _Optional[int] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., revision: _Optional[str] = ..., architecture: _Optional[str] = ..., sliding_window: _Optional[int] = ..., generation_defaults: _Optional[_Union[GenerationDefaults, _Mapping]] = ..., ignored_generation_keys: _Optional[_Iterable[str]] = ..., instance_id: _Optional[str] = ..., cpu_path: _Optional[str] = ..., host_tier_page_locked: bool = ...) -> None: ...

class GenerationDefaults(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "repetition_penalty")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., repetition_penalty: _Optional[float] = ...) -> None: ...

class CopyDiskBlocksRequest(_message.Message):
    __slots__ = ("pool_generation", "copies")
    POOL_GENERATION_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    pool_generation: int
    copies: _containers.RepeatedCompositeFieldContainer[_grant_pb2.DiskCopy]
    def __init__(self, pool_generation: _Optional[int] = ..., copies: _Optional[_Iterable[_Union[_grant_pb2.DiskCopy, _Mapping]]] = ...) -> None: ...

class CopyDiskBlocksResponse(_message.Message):
    __slots__ = ("receipts",)
    RECEIPTS_FIELD_NUMBER: _ClassVar[int]
    receipts: _containers.RepeatedCompositeFieldContainer[_grant_pb2.DiskReceipt]
    def __init__(self, receipts: _Optional[_Iterable[_Union[_grant_pb2.DiskReceipt, _Mapping]]] = ...) -> None: ...
