from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_INTERACTIVE: _ClassVar[Priority]
    PRIORITY_BACKGROUND: _ClassVar[Priority]
PRIORITY_INTERACTIVE: Priority
PRIORITY_BACKGROUND: Priority

class ModelSpec(_message.Message):
    __slots__ = ("model", "dtype", "num_layers", "num_kv_heads", "head_dim", "block_size")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop_token_ids", "stop", "ignore_eos", "logprobs", "top_logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "grammar")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    logprobs: int
    top_logprobs: int
    prompt_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    grammar: str
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., grammar: _Optional[str] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("logprobs", "top_logprobs")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "model", "num_prompt_tokens", "max_tokens", "priority", "prompt_token_ids", "waiting")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: ModelSpec
    num_prompt_tokens: int
    max_tokens: int
    priority: Priority
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    waiting: bool
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[_Union[ModelSpec, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., priority: _Optional[_Union[Priority, str]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., waiting: _Optional[bool] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("accepted", "reason", "lease_ms", "free_blocks", "num_cached_tokens")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    lease_ms: int
    free_blocks: int
    num_cached_tokens: int
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., lease_ms: _Optional[int] = ..., free_blocks: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("request_id", "layer", "token_start", "token_count", "dtype", "key", "value", "last", "layer_count")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    LAYER_COUNT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    layer: int
    token_start: int
    token_count: int
    dtype: str
    key: bytes
    value: bytes
    last: bool
    layer_count: int
    def __init__(self, request_id: _Optional[str] = ..., layer: _Optional[int] = ..., token_start: _Optional[int] = ..., token_count: _Optional[int] = ..., dtype: _Optional[str] = ..., key: _Optional[bytes] = ..., value: _Optional[bytes] = ..., last: _Optional[bool] = ..., layer_count: _Optional[int] = ...) -> None: ...

class PushKVResponse(_message.Message):
    __slots__ = ("chunks", "bytes")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    chunks: int
    bytes: int
    def __init__(self, chunks: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "first_token", "sampling", "priority", "first_token_logprob")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token: int
    sampling: SamplingParams
    priority: Priority
    first_token_logprob: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[_Union[Priority, str]] = ..., first_token_logprob: _Optional[float] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finished", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "top_logprobs", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finished: bool
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    prompt_logprobs: PromptLogprobs
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobs, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "routine")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTINE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    routine: bool
    def __init__(self, request_id: _Optional[str] = ..., routine: _Optional[bool] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "decode_endpoint", "decode_model", "decode_cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DECODE_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DECODE_MODEL_FIELD_NUMBER: _ClassVar[int]
    DECODE_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    priority: Priority
    decode_endpoint: str
    decode_model: ModelSpec
    decode_cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[_Union[Priority, str]] = ..., decode_endpoint: _Optional[str] = ..., decode_model: _Optional[_Union[ModelSpec, _Mapping]] = ..., decode_cached_tokens: _Optional[int] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("first_token", "transfer_done")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_DONE_FIELD_NUMBER: _ClassVar[int]
    first_token: FirstToken
    transfer_done: TransferDone
    def __init__(self, first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., transfer_done: _Optional[_Union[TransferDone, _Mapping]] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "logprob", "queue_seconds", "compute_seconds", "num_cached_tokens", "top_logprobs", "prompt_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    queue_seconds: float
    compute_seconds: float
    num_cached_tokens: int
    top_logprobs: TopLogprobs
    prompt_logprobs: PromptLogprobs
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., queue_seconds: _Optional[float] = ..., compute_seconds: _Optional[float] = ..., num_cached_tokens: _Optional[int] = ..., top_logprobs: _Optional[_Union[TopLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobs, _Mapping]] = ...) -> None: ...

class TransferDone(_message.Message):
    __slots__ = ("transfer_seconds", "exposed_seconds", "bytes")
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPOSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    transfer_seconds: float
    exposed_seconds: float
    bytes: int
    def __init__(self, transfer_seconds: _Optional[float] = ..., exposed_seconds: _Optional[float] = ..., bytes: _Optional[int] = ...) -> None: ...

class CompleteRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    priority: Priority
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[_Union[Priority, str]] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("role", "model", "running", "waiting", "queued_tokens", "free_blocks", "total_blocks", "draining", "max_batch_size", "max_batch_tokens")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    role: str
    model: ModelSpec
    running: int
    waiting: int
    queued_tokens: int
    free_blocks: int
    total_blocks: int
    draining: bool
    max_batch_size: int
    max_batch_tokens: int
    def __init__(self, role: _Optional[str] = ..., model: _Optional[_Union[ModelSpec, _Mapping]] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., draining: _Optional[bool] = ..., max_batch_size: _Optional[int] = ..., max_batch_tokens: _Optional[int] = ...) -> None: ...
