from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("model", "prompt", "messages", "token_ids", "subset", "session_id", "cache_salt", "lora")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SUBSET_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    messages: ChatMessages
    token_ids: TokenIds
    subset: _containers.RepeatedScalarFieldContainer[str]
    session_id: str
    cache_salt: str
    lora: str
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., subset: _Optional[_Iterable[str]] = ..., session_id: _Optional[str] = ..., cache_salt: _Optional[str] = ..., lora: _Optional[str] = ...) -> None: ...

class ScoredEndpoint(_message.Message):
    __slots__ = ("endpoint", "rank", "reason", "has_cost", "cost", "matched_tokens", "matched_blocks", "weighted_overlap", "inflight", "filtered", "note")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HAS_COST_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTED_OVERLAP_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    FILTERED_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    rank: int
    reason: str
    has_cost: bool
    cost: float
    matched_tokens: int
    matched_blocks: int
    weighted_overlap: float
    inflight: int
    filtered: str
    note: str
    def __init__(self, endpoint: _Optional[str] = ..., rank: _Optional[int] = ..., reason: _Optional[str] = ..., has_cost: _Optional[bool] = ..., cost: _Optional[float] = ..., matched_tokens: _Optional[int] = ..., matched_blocks: _Optional[int] = ..., weighted_overlap: _Optional[float] = ..., inflight: _Optional[int] = ..., filtered: _Optional[str] = ..., note: _Optional[str] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("request_id", "policy", "reason", "endpoints", "ranked", "status", "message", "matched_tokens", "request_tokens", "notes", "decision_json")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    RANKED_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    DECISION_JSON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    policy: str
    reason: str
    endpoints: _containers.RepeatedScalarFieldContainer[str]
    ranked: _containers.RepeatedCompositeFieldContainer[ScoredEndpoint]
    status: int
    message: str
    matched_tokens: int
    request_tokens: int
    notes: _containers.RepeatedScalarFieldContainer[str]
    decision_json: str
    def __init__(self, request_id: _Optional[str] = ..., policy: _Optional[str] = ..., reason: _Optional[str] = ..., endpoints: _Optional[_Iterable[str]] = ..., ranked: _Optional[_Iterable[_Union[ScoredEndpoint, _Mapping]]] = ..., status: _Optional[int] = ..., message: _Optional[str] = ..., matched_tokens: _Optional[int] = ..., request_tokens: _Optional[int] = ..., notes: _Optional[_Iterable[str]] = ..., decision_json: _Optional[str] = ...) -> None: ...
