from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "kv_destination", "compatibility", "cache_salt", "decode_cached_tokens", "kv_rank_destinations", "kv_pull_min_blocks", "kv_pulled")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    KV_DESTINATION_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    DECODE_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_RANK_DESTINATIONS_FIELD_NUMBER: _ClassVar[int]
    KV_PULL_MIN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_PULLED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    kv_destination: bytes
    compatibility: str
    cache_salt: str
    decode_cached_tokens: int
    kv_rank_destinations: _containers.RepeatedScalarFieldContainer[bytes]
    kv_pull_min_blocks: int
    kv_pulled: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., kv_destination: _Optional[bytes] = ..., compatibility: _Optional[str] = ..., cache_salt: _Optional[str] = ..., decode_cached_tokens: _Optional[int] = ..., kv_rank_destinations: _Optional[_Iterable[bytes]] = ..., kv_pull_min_blocks: _Optional[int] = ..., kv_pulled: _Optional[bool] = ...) -> None: ...

class PullOffer(_message.Message):
    __slots__ = ("kv_destination", "first_block")
    KV_DESTINATION_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    kv_destination: bytes
    first_block: int
    def __init__(self, kv_destination: _Optional[bytes] = ..., first_block: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_logprob", "num_cached_tokens", "prefill_seconds", "transfer_seconds")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprob: _common_pb2.TokenLogprob
    num_cached_tokens: int
    prefill_seconds: float
    transfer_seconds: float
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., prefill_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ...) -> None: ...
