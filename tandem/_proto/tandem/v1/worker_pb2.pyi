from tandem._proto.tandem.v1 import tandem_pb2 as _tandem_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
    WORKER_ROLE_BOTH: _ClassVar[WorkerRole]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
WORKER_ROLE_BOTH: WorkerRole

class KvTarget(_message.Message):
    __slots__ = ("worker_id", "kv_address", "reservation_id", "num_cached_blocks", "dst_block_ids", "voucher")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    VOUCHER_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    kv_address: str
    reservation_id: int
    num_cached_blocks: int
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    voucher: str
    def __init__(self, worker_id: _Optional[str] = ..., kv_address: _Optional[str] = ..., reservation_id: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., voucher: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "params", "tier", "target", "timeout_ms", "num_output_tokens", "target_follows")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FOLLOWS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _tandem_pb2.SamplingParams
    tier: _tandem_pb2.Tier
    target: KvTarget
    timeout_ms: int
    num_output_tokens: int
    target_follows: bool
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_tandem_pb2.SamplingParams, _Mapping]] = ..., tier: _Optional[_Union[_tandem_pb2.Tier, str]] = ..., target: _Optional[_Union[KvTarget, _Mapping]] = ..., timeout_ms: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., target_follows: _Optional[bool] = ...) -> None: ...

class PrefillTargetRequest(_message.Message):
    __slots__ = ("request_id", "target")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    target: KvTarget
    def __init__(self, request_id: _Optional[str] = ..., target: _Optional[_Union[KvTarget, _Mapping]] = ...) -> None: ...

class PrefillTargetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_logprob", "prompt_tokens", "cached_tokens", "finish_reason", "stop_reason")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprob: _tandem_pb2.TokenLogprob
    prompt_tokens: int
    cached_tokens: int
    finish_reason: _tandem_pb2.FinishReason
    stop_reason: str
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[_tandem_pb2.TokenLogprob, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[_tandem_pb2.FinishReason, str]] = ..., stop_reason: _Optional[str] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "max_tokens", "tier", "timeout_ms", "num_output_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    tier: _tandem_pb2.Tier
    timeout_ms: int
    num_output_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., tier: _Optional[_Union[_tandem_pb2.Tier, str]] = ..., timeout_ms: _Optional[int] = ..., num_output_tokens: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("ok", "reason", "reservation_id", "kv_address", "num_cached_blocks", "dst_block_ids", "free_blocks")
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reason: str
    reservation_id: int
    kv_address: str
    num_cached_blocks: int
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    free_blocks: int
    def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[str] = ..., reservation_id: _Optional[int] = ..., kv_address: _Optional[str] = ..., num_cached_blocks: _Optional[int] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., free_blocks: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "reservation_id", "first_token_id", "params", "timeout_ms", "stream_interval")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reservation_id: int
    first_token_id: int
    params: _tandem_pb2.SamplingParams
    timeout_ms: int
    stream_interval: int
    def __init__(self, request_id: _Optional[str] = ..., reservation_id: _Optional[int] = ..., first_token_id: _Optional[int] = ..., params: _Optional[_Union[_tandem_pb2.SamplingParams, _Mapping]] = ..., timeout_ms: _Optional[int] = ..., stream_interval: _Optional[int] = ...) -> None: ...

class DecodeChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "stop_reason", "cached_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_tandem_pb2.TokenLogprob]
    finish_reason: _tandem_pb2.FinishReason
    stop_reason: str
    cached_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_tandem_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_tandem_pb2.FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateOnWorkerRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "params", "tier", "timeout_ms", "num_output_tokens", "stream_interval")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _tandem_pb2.SamplingParams
    tier: _tandem_pb2.Tier
    timeout_ms: int
    num_output_tokens: int
    stream_interval: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_tandem_pb2.SamplingParams, _Mapping]] = ..., tier: _Optional[_Union[_tandem_pb2.Tier, str]] = ..., timeout_ms: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., stream_interval: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "reservation_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reservation_id: int
    def __init__(self, request_id: _Optional[str] = ..., reservation_id: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "role", "free_kv_blocks", "total_kv_blocks", "running", "waiting", "queued_prefill_tokens", "prefix_query_tokens", "prefix_hit_tokens", "preemptions", "kv_bytes_sent", "kv_bytes_received", "draining", "metrics_port", "max_running", "max_model_len")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: WorkerRole
    free_kv_blocks: int
    total_kv_blocks: int
    running: int
    waiting: int
    queued_prefill_tokens: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    preemptions: int
    kv_bytes_sent: int
    kv_bytes_received: int
    draining: bool
    metrics_port: int
    max_running: int
    max_model_len: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., free_kv_blocks: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., prefix_query_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., preemptions: _Optional[int] = ..., kv_bytes_sent: _Optional[int] = ..., kv_bytes_received: _Optional[int] = ..., draining: _Optional[bool] = ..., metrics_port: _Optional[int] = ..., max_running: _Optional[int] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class KvEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("worker_id", "seq", "reset", "stored", "removed")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    seq: int
    reset: bool
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., seq: _Optional[int] = ..., reset: _Optional[bool] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ...) -> None: ...
