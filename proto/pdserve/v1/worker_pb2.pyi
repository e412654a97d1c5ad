from pdserve.v1 import generate_pb2 as _generate_pb2
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
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole

class GetWorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "epoch", "fingerprint_digest", "fingerprint_json", "kv_address", "kv_transport", "model", "max_model_len", "vocab_size", "kv_load_failure_policy", "host", "capacity", "dtype", "lora_adapters", "kv_addresses", "tp")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_JSON_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_LOAD_FAILURE_POLICY_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: WorkerRole
    epoch: int
    fingerprint_digest: str
    fingerprint_json: str
    kv_address: str
    kv_transport: str
    model: str
    max_model_len: int
    vocab_size: int
    kv_load_failure_policy: str
    host: str
    capacity: int
    dtype: str
    lora_adapters: _containers.RepeatedCompositeFieldContainer[_generate_pb2.LoraAdapter]
    kv_addresses: _containers.RepeatedScalarFieldContainer[str]
    tp: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., epoch: _Optional[int] = ..., fingerprint_digest: _Optional[str] = ..., fingerprint_json: _Optional[str] = ..., kv_address: _Optional[str] = ..., kv_transport: _Optional[str] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., kv_load_failure_policy: _Optional[str] = ..., host: _Optional[str] = ..., capacity: _Optional[int] = ..., dtype: _Optional[str] = ..., lora_adapters: _Optional[_Iterable[_Union[_generate_pb2.LoraAdapter, _Mapping]]] = ..., kv_addresses: _Optional[_Iterable[str]] = ..., tp: _Optional[int] = ...) -> None: ...

class KVTarget(_message.Message):
    __slots__ = ("worker_id", "epoch", "kv_address", "kv_transport", "fingerprint_digest", "same_host", "kv_addresses")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SAME_HOST_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    kv_address: str
    kv_transport: str
    fingerprint_digest: str
    same_host: bool
    kv_addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., kv_address: _Optional[str] = ..., kv_transport: _Optional[str] = ..., fingerprint_digest: _Optional[str] = ..., same_host: _Optional[bool] = ..., kv_addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class TransferHandle(_message.Message):
    __slots__ = ("transfer_id", "prefill_worker_id", "prefill_epoch", "num_tokens", "decode_epoch", "prefill_done_wall", "prefill_start_wall", "lora_name", "first_block", "prefill_tp")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DONE_WALL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_START_WALL_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TP_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    prefill_worker_id: str
    prefill_epoch: int
    num_tokens: int
    decode_epoch: int
    prefill_done_wall: float
    prefill_start_wall: float
    lora_name: str
    first_block: int
    prefill_tp: int
    def __init__(self, transfer_id: _Optional[str] = ..., prefill_worker_id: _Optional[str] = ..., prefill_epoch: _Optional[int] = ..., num_tokens: _Optional[int] = ..., decode_epoch: _Optional[int] = ..., prefill_done_wall: _Optional[float] = ..., prefill_start_wall: _Optional[float] = ..., lora_name: _Optional[str] = ..., first_block: _Optional[int] = ..., prefill_tp: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "target", "transfer_id", "fault", "generated_tokens", "lora_name", "reuse_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    FAULT_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    REUSE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generate_pb2.SamplingParams
    target: KVTarget
    transfer_id: str
    fault: str
    generated_tokens: int
    lora_name: str
    reuse_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., target: _Optional[_Union[KVTarget, _Mapping]] = ..., transfer_id: _Optional[str] = ..., fault: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., lora_name: _Optional[str] = ..., reuse_tokens: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_token_text", "logprobs", "finished", "finish_reason", "stop_reason", "handle", "queue_s", "prefill_s", "cached_tokens")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_token_text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprob]
    finished: bool
    finish_reason: _generate_pb2.FinishReason
    stop_reason: str
    handle: TransferHandle
    queue_s: float
    prefill_s: float
    cached_tokens: int
    def __init__(self, first_token_id: _Optional[int] = ..., first_token_text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprob, _Mapping]]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[_generate_pb2.FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., handle: _Optional[_Union[TransferHandle, _Mapping]] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "first_token_id", "sampling", "handle", "fault", "generated_tokens", "lora_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    FAULT_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_id: int
    sampling: _generate_pb2.SamplingParams
    handle: TransferHandle
    fault: str
    generated_tokens: int
    lora_name: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token_id: _Optional[int] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., handle: _Optional[_Union[TransferHandle, _Mapping]] = ..., fault: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., lora_name: _Optional[str] = ...) -> None: ...

class WatchKVEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchKVEventsResponse(_message.Message):
    __slots__ = ("seq", "batch")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    seq: int
    batch: bytes
    def __init__(self, seq: _Optional[int] = ..., batch: _Optional[bytes] = ...) -> None: ...
