from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    PHASE_PREFILL: _ClassVar[Phase]
    PHASE_DECODE: _ClassVar[Phase]
    PHASE_VERIFY: _ClassVar[Phase]
    PHASE_ROLLBACK: _ClassVar[Phase]
    PHASE_DONE: _ClassVar[Phase]
    PHASE_IDLE: _ClassVar[Phase]

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_UNSPECIFIED: _ClassVar[Priority]
    PRIORITY_COLD: _ClassVar[Priority]
    PRIORITY_WARM: _ClassVar[Priority]
    PRIORITY_HOT: _ClassVar[Priority]
    PRIORITY_DECODE_CRITICAL: _ClassVar[Priority]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_DEVICE: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]

class Decision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DECISION_UNSPECIFIED: _ClassVar[Decision]
    DECISION_ADMITTED: _ClassVar[Decision]
    DECISION_QUEUED: _ClassVar[Decision]
    DECISION_REJECTED: _ClassVar[Decision]
PHASE_UNSPECIFIED: Phase
PHASE_PREFILL: Phase
PHASE_DECODE: Phase
PHASE_VERIFY: Phase
PHASE_ROLLBACK: Phase
PHASE_DONE: Phase
PHASE_IDLE: Phase
PRIORITY_UNSPECIFIED: Priority
PRIORITY_COLD: Priority
PRIORITY_WARM: Priority
PRIORITY_HOT: Priority
PRIORITY_DECODE_CRITICAL: Priority
TIER_UNSPECIFIED: Tier
TIER_DEVICE: Tier
TIER_HOST: Tier
DECISION_UNSPECIFIED: Decision
DECISION_ADMITTED: Decision
DECISION_QUEUED: Decision
DECISION_REJECTED: Decision

class MemoryIntent(_message.Message):
    __slots__ = ("phase", "priority", "deadline_us", "slack_us", "recompute_cost_us", "spill_cost_us", "pin_requested", "request_priority", "recency_score", "target_decode_step", "expected_reuse_window_tokens", "is_draft", "is_committed", "compression_ok", "recompute_ok", "prefetch_ok")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_US_FIELD_NUMBER: _ClassVar[int]
    SLACK_US_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_COST_US_FIELD_NUMBER: _ClassVar[int]
    SPILL_COST_US_FIELD_NUMBER: _ClassVar[int]
    PIN_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RECENCY_SCORE_FIELD_NUMBER: _ClassVar[int]
    TARGET_DECODE_STEP_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_REUSE_WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IS_DRAFT_FIELD_NUMBER: _ClassVar[int]
    IS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_OK_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_OK_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_OK_FIELD_NUMBER: _ClassVar[int]
    phase: Phase
    priority: Priority
    deadline_us: int
    slack_us: int
    recompute_cost_us: int
    spill_cost_us: int
    pin_requested: bool
    request_priority: int
    recency_score: float
    target_decode_step: int
    expected_reuse_window_tokens: int
    is_draft: bool
    is_committed: bool
    compression_ok: bool
    recompute_ok: bool
    prefetch_ok: bool
    def __init__(self, phase: _Optional[_Union[Phase, str]] = ..., priority: _Optional[_Union[Priority, str]] = ..., deadline_us: _Optional[int] = ..., slack_us: _Optional[int] = ..., recompute_cost_us: _Optional[int] = ..., spill_cost_us: _Optional[int] = ..., pin_requested: _Optional[bool] = ..., request_priority: _Optional[int] = ..., recency_score: _Optional[float] = ..., target_decode_step: _Optional[int] = ..., expected_reuse_window_tokens: _Optional[int] = ..., is_draft: _Optional[bool] = ..., is_committed: _Optional[bool] = ..., compression_ok: _Optional[bool] = ..., recompute_ok: _Optional[bool] = ..., prefetch_ok: _Optional[bool] = ...) -> None: ...

class IntentUpdate(_message.Message):
    __slots__ = ("request_id", "block_index", "intent", "prefetch")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    INTENT_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_index: int
    intent: MemoryIntent
    prefetch: bool
    def __init__(self, request_id: _Optional[str] = ..., block_index: _Optional[int] = ..., intent: _Optional[_Union[MemoryIntent, _Mapping]] = ..., prefetch: _Optional[bool] = ...) -> None: ...

class PageHandle(_message.Message):
    __slots__ = ("request_id", "block_index", "pool", "tier", "page_index", "offset_bytes", "length_bytes", "recompute")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    LENGTH_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_index: int
    pool: str
    tier: Tier
    page_index: int
    offset_bytes: int
    length_bytes: int
    recompute: bool
    def __init__(self, request_id: _Optional[str] = ..., block_index: _Optional[int] = ..., pool: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ..., page_index: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., length_bytes: _Optional[int] = ..., recompute: _Optional[bool] = ...) -> None: ...

class AdmitRequest(_message.Message):
    __slots__ = ("request_id", "tenant", "pool", "prompt_tokens", "expected_output_tokens", "priority", "handoff_pool")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_POOL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    pool: str
    prompt_tokens: int
    expected_output_tokens: int
    priority: int
    handoff_pool: str
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., pool: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., expected_output_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., handoff_pool: _Optional[str] = ...) -> None: ...

class AdmitResponse(_message.Message):
    __slots__ = ("decision", "reason", "queue_position", "projected_pages")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    PROJECTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    decision: Decision
    reason: str
    queue_position: int
    projected_pages: int
    def __init__(self, decision: _Optional[_Union[Decision, str]] = ..., reason: _Optional[str] = ..., queue_position: _Optional[int] = ..., projected_pages: _Optional[int] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("request_id", "num_blocks", "intent")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INTENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_blocks: int
    intent: MemoryIntent
    def __init__(self, request_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., intent: _Optional[_Union[MemoryIntent, _Mapping]] = ...) -> None: ...

class AllocateResponse(_message.Message):
    __slots__ = ("handles", "stall_us")
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    STALL_US_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedCompositeFieldContainer[PageHandle]
    stall_us: int
    def __init__(self, handles: _Optional[_Iterable[_Union[PageHandle, _Mapping]]] = ..., stall_us: _Optional[int] = ...) -> None: ...

class AccessRequest(_message.Message):
    __slots__ = ("request_id", "block_indices", "all_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDICES_FIELD_NUMBER: _ClassVar[int]
    ALL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_indices: _containers.RepeatedScalarFieldContainer[int]
    all_blocks: bool
    def __init__(self, request_id: _Optional[str] = ..., block_indices: _Optional[_Iterable[int]] = ..., all_blocks: _Optional[bool] = ...) -> None: ...

class AccessResponse(_message.Message):
    __slots__ = ("handles", "stall_us", "num_promoted")
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    STALL_US_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMOTED_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedCompositeFieldContainer[PageHandle]
    stall_us: int
    num_promoted: int
    def __init__(self, handles: _Optional[_Iterable[_Union[PageHandle, _Mapping]]] = ..., stall_us: _Optional[int] = ..., num_promoted: _Optional[int] = ...) -> None: ...

class UpdateIntentsRequest(_message.Message):
    __slots__ = ("updates",)
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[IntentUpdate]
    def __init__(self, updates: _Optional[_Iterable[_Union[IntentUpdate, _Mapping]]] = ...) -> None: ...

class UpdateIntentsResponse(_message.Message):
    __slots__ = ("num_applied", "num_prefetched")
    NUM_APPLIED_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFETCHED_FIELD_NUMBER: _ClassVar[int]
    num_applied: int
    num_prefetched: int
    def __init__(self, num_applied: _Optional[int] = ..., num_prefetched: _Optional[int] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("request_id", "block_indices")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDICES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., block_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class FreeResponse(_message.Message):
    __slots__ = ("num_freed",)
    NUM_FREED_FIELD_NUMBER: _ClassVar[int]
    num_freed: int
    def __init__(self, num_freed: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("num_freed",)
    NUM_FREED_FIELD_NUMBER: _ClassVar[int]
    num_freed: int
    def __init__(self, num_freed: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("pool", "namespace", "keys")
    POOL_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, pool: _Optional[str] = ..., namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_hit", "tiers")
    NUM_HIT_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    num_hit: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, num_hit: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class StoreRequest(_message.Message):
    __slots__ = ("request_id", "namespace", "keys", "intent")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    INTENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    intent: MemoryIntent
    def __init__(self, request_id: _Optional[str] = ..., namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., intent: _Optional[_Union[MemoryIntent, _Mapping]] = ...) -> None: ...

class StoreResponse(_message.Message):
    __slots__ = ("handles", "fresh", "stall_us")
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    FRESH_FIELD_NUMBER: _ClassVar[int]
    STALL_US_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedCompositeFieldContainer[PageHandle]
    fresh: _containers.RepeatedScalarFieldContainer[bool]
    stall_us: int
    def __init__(self, handles: _Optional[_Iterable[_Union[PageHandle, _Mapping]]] = ..., fresh: _Optional[_Iterable[bool]] = ..., stall_us: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("request_id", "namespace", "keys")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, request_id: _Optional[str] = ..., namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("num_committed",)
    NUM_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    num_committed: int
    def __init__(self, num_committed: _Optional[int] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("request_id", "namespace", "keys", "intent")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    INTENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    intent: MemoryIntent
    def __init__(self, request_id: _Optional[str] = ..., namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., intent: _Optional[_Union[MemoryIntent, _Mapping]] = ...) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("handles",)
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedCompositeFieldContainer[PageHandle]
    def __init__(self, handles: _Optional[_Iterable[_Union[PageHandle, _Mapping]]] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("pool", "num_pages")
    POOL_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    pool: str
    num_pages: int
    def __init__(self, pool: _Optional[str] = ..., num_pages: _Optional[int] = ...) -> None: ...

class EvictedBlock(_message.Message):
    __slots__ = ("request_id", "block_index", "to_tier")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    TO_TIER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_index: int
    to_tier: Tier
    def __init__(self, request_id: _Optional[str] = ..., block_index: _Optional[int] = ..., to_tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("evicted",)
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    evicted: _containers.RepeatedCompositeFieldContainer[EvictedBlock]
    def __init__(self, evicted: _Optional[_Iterable[_Union[EvictedBlock, _Mapping]]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "intents", "frees", "releases", "allocations", "accesses", "read_all")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    INTENTS_FIELD_NUMBER: _ClassVar[int]
    FREES_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATIONS_FIELD_NUMBER: _ClassVar[int]
    ACCESSES_FIELD_NUMBER: _ClassVar[int]
    READ_ALL_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    intents: _containers.RepeatedCompositeFieldContainer[IntentUpdate]
    frees: _containers.RepeatedCompositeFieldContainer[FreeRequest]
    releases: _containers.RepeatedCompositeFieldContainer[ReleaseRequest]
    allocations: _containers.RepeatedCompositeFieldContainer[AllocateRequest]
    accesses: _containers.RepeatedCompositeFieldContainer[AccessRequest]
    read_all: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step_id: _Optional[int] = ..., intents: _Optional[_Iterable[_Union[IntentUpdate, _Mapping]]] = ..., frees: _Optional[_Iterable[_Union[FreeRequest, _Mapping]]] = ..., releases: _Optional[_Iterable[_Union[ReleaseRequest, _Mapping]]] = ..., allocations: _Optional[_Iterable[_Union[AllocateRequest, _Mapping]]] = ..., accesses: _Optional[_Iterable[_Union[AccessRequest, _Mapping]]] = ..., read_all: _Optional[_Iterable[str]] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("section", "item_index", "code", "message")
    SECTION_FIELD_NUMBER: _ClassVar[int]
    ITEM_INDEX_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    section: str
    item_index: int
    code: int
    message: str
    def __init__(self, section: _Optional[str] = ..., item_index: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("step_id", "allocated", "relocated", "stall_us", "errors")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    RELOCATED_FIELD_NUMBER: _ClassVar[int]
    STALL_US_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    allocated: _containers.RepeatedCompositeFieldContainer[PageHandle]
    relocated: _containers.RepeatedCompositeFieldContainer[PageHandle]
    stall_us: int
    errors: _containers.RepeatedCompositeFieldContainer[StepError]
    def __init__(self, step_id: _Optional[int] = ..., allocated: _Optional[_Iterable[_Union[PageHandle, _Mapping]]] = ..., relocated: _Optional[_Iterable[_Union[PageHandle, _Mapping]]] = ..., stall_us: _Optional[int] = ..., errors: _Optional[_Iterable[_Union[StepError, _Mapping]]] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("pools", "tenants", "kinds", "buffer")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedScalarFieldContainer[str]
    tenants: _containers.RepeatedScalarFieldContainer[str]
    kinds: _containers.RepeatedScalarFieldContainer[str]
    buffer: int
    def __init__(self, pools: _Optional[_Iterable[str]] = ..., tenants: _Optional[_Iterable[str]] = ..., kinds: _Optional[_Iterable[str]] = ..., buffer: _Optional[int] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("seq", "time_s", "kind", "pool", "tenant", "request_id", "count", "detail", "lost")
    class DetailEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    seq: int
    time_s: float
    kind: str
    pool: str
    tenant: str
    request_id: str
    count: int
    detail: _containers.ScalarMap[str, str]
    lost: int
    def __init__(self, seq: _Optional[int] = ..., time_s: _Optional[float] = ..., kind: _Optional[str] = ..., pool: _Optional[str] = ..., tenant: _Optional[str] = ..., request_id: _Optional[str] = ..., count: _Optional[int] = ..., detail: _Optional[_Mapping[str, str]] = ..., lost: _Optional[int] = ...) -> None: ...

class ExportPoolRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    def __init__(self, pool: _Optional[str] = ...) -> None: ...

class TierExport(_message.Message):
    __slots__ = ("tier", "backend", "num_pages", "shm_name", "cuda_ipc_handle", "cuda_device", "arena_bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    CUDA_DEVICE_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    backend: str
    num_pages: int
    shm_name: str
    cuda_ipc_handle: bytes
    cuda_device: int
    arena_bytes: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., backend: _Optional[str] = ..., num_pages: _Optional[int] = ..., shm_name: _Optional[str] = ..., cuda_ipc_handle: _Optional[bytes] = ..., cuda_device: _Optional[int] = ..., arena_bytes: _Optional[int] = ...) -> None: ...

class ExportPoolResponse(_message.Message):
    __slots__ = ("pool", "page_bytes", "tiers")
    POOL_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    page_bytes: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierExport]
    def __init__(self, pool: _Optional[str] = ..., page_bytes: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierExport, _Mapping]]] = ...) -> None: ...

class GetPoolStatsRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    def __init__(self, pool: _Optional[str] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "backend", "capacity_pages", "used_pages", "free_pages", "pinned_pages")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_PAGES_FIELD_NUMBER: _ClassVar[int]
    USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    PINNED_PAGES_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    backend: str
    capacity_pages: int
    used_pages: int
    free_pages: int
    pinned_pages: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., backend: _Optional[str] = ..., capacity_pages: _Optional[int] = ..., used_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., pinned_pages: _Optional[int] = ...) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("pool", "policy", "page_bytes", "block_tokens", "tiers", "num_requests", "num_queued", "reserved_pages", "num_evictions", "num_demotions", "num_promotions", "num_drops", "bytes_moved", "num_decode_critical_accesses", "num_decode_critical_misses", "num_deadline_misses", "stall_seconds_total", "peak_device_pages", "num_prefetches", "num_accesses", "num_misses", "links", "bytes_read", "handoff_reserved_pages", "num_admitted", "num_lost_blocks", "held_pages", "admission", "working_set_pages", "working_set_capacity_pages", "num_prefix_looked_up", "num_prefix_hits", "num_prefix_loaded", "num_prefix_stored")
    POOL_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_FIELD_NUMBER: _ClassVar[int]
    RESERVED_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_DROPS_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_CRITICAL_ACCESSES_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_CRITICAL_MISSES_FIELD_NUMBER: _ClassVar[int]
    NUM_DEADLINE_MISSES_FIELD_NUMBER: _ClassVar[int]
    STALL_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PEAK_DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFETCHES_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCESSES_FIELD_NUMBER: _ClassVar[int]
    NUM_MISSES_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_RESERVED_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    NUM_LOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HELD_PAGES_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    WORKING_SET_PAGES_FIELD_NUMBER: _ClassVar[int]
    WORKING_SET_CAPACITY_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_LOOKED_UP_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_LOADED_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_STORED_FIELD_NUMBER: _ClassVar[int]
    pool: str
    policy: str
    page_bytes: int
    block_tokens: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    num_requests: int
    num_queued: int
    reserved_pages: int
    num_evictions: int
    num_demotions: int
    num_promotions: int
    num_drops: int
    bytes_moved: int
    num_decode_critical_accesses: int
    num_decode_critical_misses: int
    num_deadline_misses: int
    stall_seconds_total: float
    peak_device_pages: int
    num_prefetches: int
    num_accesses: int
    num_misses: int
    links: _containers.RepeatedCompositeFieldContainer[LinkStats]
    bytes_read: int
    handoff_reserved_pages: int
    num_admitted: int
    num_lost_blocks: int
    held_pages: int
    admission: str
    working_set_pages: int
    working_set_capacity_pages: int
    num_prefix_looked_up: int
    num_prefix_hits: int
    num_prefix_loaded: int
    num_prefix_stored: int
    def __init__(self, pool: _Optional[str] = ..., policy: _Optional[str] = ..., page_bytes: _Optional[int] = ..., block_tokens: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., num_requests: _Optional[int] = ..., num_queued: _Optional[int] = ..., reserved_pages: _Optional[int] = ..., num_evictions: _Optional[int] = ..., num_demotions: _Optional[int] = ..., num_promotions: _Optional[int] = ..., num_drops: _Optional[int] = ..., bytes_moved: _Optional[int] = ..., num_decode_critical_accesses: _Optional[int] = ..., num_decode_critical_misses: _Optional[int] = ..., num_deadline_misses: _Optional[int] = ..., stall_seconds_total: _Optional[float] = ..., peak_device_pages: _Optional[int] = ..., num_prefetches: _Optional[int] = ..., num_accesses: _Optional[int] = ..., num_misses: _Optional[int] = ..., links: _Optional[_Iterable[_Union[LinkStats, _Mapping]]] = ..., bytes_read: _Optional[int] = ..., handoff_reserved_pages: _Optional[int] = ..., num_admitted: _Optional[int] = ..., num_lost_blocks: _Optional[int] = ..., held_pages: _Optional[int] = ..., admission: _Optional[str] = ..., working_set_pages: _Optional[int] = ..., working_set_capacity_pages: _Optional[int] = ..., num_prefix_looked_up: _Optional[int] = ..., num_prefix_hits: _Optional[int] = ..., num_prefix_loaded: _Optional[int] = ..., num_prefix_stored: _Optional[int] = ...) -> None: ...

class LinkStats(_message.Message):
    __slots__ = ("link", "capacity_bytes_per_s", "burst_bytes", "scheduling", "bytes_total", "transfers_total", "utilisation", "busy_seconds", "queues", "tenants")
    class Queue(_message.Message):
        __slots__ = ("transfer_class", "transfers", "bytes")
        TRANSFER_CLASS_FIELD_NUMBER: _ClassVar[int]
        TRANSFERS_FIELD_NUMBER: _ClassVar[int]
        BYTES_FIELD_NUMBER: _ClassVar[int]
        transfer_class: str
        transfers: int
        bytes: int
        def __init__(self, transfer_class: _Optional[str] = ..., transfers: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...
    class TenantBytes(_message.Message):
        __slots__ = ("tenant", "bytes", "weight", "cap_bytes_per_s")
        TENANT_FIELD_NUMBER: _ClassVar[int]
        BYTES_FIELD_NUMBER: _ClassVar[int]
        WEIGHT_FIELD_NUMBER: _ClassVar[int]
        CAP_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
        tenant: str
        bytes: int
        weight: float
        cap_bytes_per_s: float
        def __init__(self, tenant: _Optional[str] = ..., bytes: _Optional[int] = ..., weight: _Optional[float] = ..., cap_bytes_per_s: _Optional[float] = ...) -> None: ...
    LINK_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    BURST_BYTES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULING_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    UTILISATION_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    link: str
    capacity_bytes_per_s: float
    burst_bytes: float
    scheduling: str
    bytes_total: int
    transfers_total: int
    utilisation: float
    busy_seconds: float
    queues: _containers.RepeatedCompositeFieldContainer[LinkStats.Queue]
    tenants: _containers.RepeatedCompositeFieldContainer[LinkStats.TenantBytes]
    def __init__(self, link: _Optional[str] = ..., capacity_bytes_per_s: _Optional[float] = ..., burst_bytes: _Optional[float] = ..., scheduling: _Optional[str] = ..., bytes_total: _Optional[int] = ..., transfers_total: _Optional[int] = ..., utilisation: _Optional[float] = ..., busy_seconds: _Optional[float] = ..., queues: _Optional[_Iterable[_Union[LinkStats.Queue, _Mapping]]] = ..., tenants: _Optional[_Iterable[_Union[LinkStats.TenantBytes, _Mapping]]] = ...) -> None: ...

class GetPoolStatsResponse(_message.Message):
    __slots__ = ("pools", "uptime_s", "version")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStats]
    uptime_s: float
    version: str
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolStats, _Mapping]]] = ..., uptime_s: _Optional[float] = ..., version: _Optional[str] = ...) -> None: ...

class WaitAdmissionRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AdmissionUpdate(_message.Message):
    __slots__ = ("decision", "queue_position", "reason")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    decision: Decision
    queue_position: int
    reason: str
    def __init__(self, decision: _Optional[_Union[Decision, str]] = ..., queue_position: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class HandoffRequest(_message.Message):
    __slots__ = ("request_id", "target_pool")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_POOL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    target_pool: str
    def __init__(self, request_id: _Optional[str] = ..., target_pool: _Optional[str] = ...) -> None: ...

class HandoffProgress(_message.Message):
    __slots__ = ("request_id", "pool", "blocks_done", "blocks_total", "bytes_done", "bytes_total", "done", "handles")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_DONE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    pool: str
    blocks_done: int
    blocks_total: int
    bytes_done: int
    bytes_total: int
    done: bool
    handles: _containers.RepeatedCompositeFieldContainer[PageHandle]
    def __init__(self, request_id: _Optional[str] = ..., pool: _Optional[str] = ..., blocks_done: _Optional[int] = ..., blocks_total: _Optional[int] = ..., bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., done: _Optional[bool] = ..., handles: _Optional[_Iterable[_Union[PageHandle, _Mapping]]] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("lease_ttl_s", "leased")
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_s: float
    leased: bool
    def __init__(self, lease_ttl_s: _Optional[float] = ..., leased: _Optional[bool] = ...) -> None: ...

class ExplainRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class Cause(_message.Message):
    __slots__ = ("tenant", "request_id")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    request_id: str
    def __init__(self, tenant: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class StallShare(_message.Message):
    __slots__ = ("cause", "stall_seconds")
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    STALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    cause: Cause
    stall_seconds: float
    def __init__(self, cause: _Optional[_Union[Cause, _Mapping]] = ..., stall_seconds: _Optional[float] = ...) -> None: ...

class EvictionCount(_message.Message):
    __slots__ = ("other", "count")
    OTHER_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    other: Cause
    count: int
    def __init__(self, other: _Optional[_Union[Cause, _Mapping]] = ..., count: _Optional[int] = ...) -> None: ...

class ExplainResponse(_message.Message):
    __slots__ = ("request_id", "tenant", "pool", "active", "stall_seconds", "num_stalls", "stalls_by_cause", "evictions_suffered", "evictions_caused", "num_recomputes", "request_shares", "tenant_shares")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    STALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_STALLS_FIELD_NUMBER: _ClassVar[int]
    STALLS_BY_CAUSE_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_SUFFERED_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_CAUSED_FIELD_NUMBER: _ClassVar[int]
    NUM_RECOMPUTES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_SHARES_FIELD_NUMBER: _ClassVar[int]
    TENANT_SHARES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    pool: str
    active: bool
    stall_seconds: float
    num_stalls: int
    stalls_by_cause: _containers.RepeatedCompositeFieldContainer[StallShare]
    evictions_suffered: _containers.RepeatedCompositeFieldContainer[EvictionCount]
    evictions_caused: _containers.RepeatedCompositeFieldContainer[EvictionCount]
    num_recomputes: int
    request_shares: Shares
    tenant_shares: Shares
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., pool: _Optional[str] = ..., active: _Optional[bool] = ..., stall_seconds: _Optional[float] = ..., num_stalls: _Optional[int] = ..., stalls_by_cause: _Optional[_Iterable[_Union[StallShare, _Mapping]]] = ..., evictions_suffered: _Optional[_Iterable[_Union[EvictionCount, _Mapping]]] = ..., evictions_caused: _Optional[_Iterable[_Union[EvictionCount, _Mapping]]] = ..., num_recomputes: _Optional[int] = ..., request_shares: _Optional[_Union[Shares, _Mapping]] = ..., tenant_shares: _Optional[_Union[Shares, _Mapping]] = ...) -> None: ...

class Shares(_message.Message):
    __slots__ = ("num_blocks", "shared_pages", "charged_pages", "saved_pages")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHARED_PAGES_FIELD_NUMBER: _ClassVar[int]
    CHARGED_PAGES_FIELD_NUMBER: _ClassVar[int]
    SAVED_PAGES_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    shared_pages: int
    charged_pages: float
    saved_pages: float
    def __init__(self, num_blocks: _Optional[int] = ..., shared_pages: _Optional[int] = ..., charged_pages: _Optional[float] = ..., saved_pages: _Optional[float] = ...) -> None: ...

class SetPolicyRequest(_message.Message):
    __slots__ = ("pool", "policy")
    POOL_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    pool: str
    policy: str
    def __init__(self, pool: _Optional[str] = ..., policy: _Optional[str] = ...) -> None: ...

class SetPolicyResponse(_message.Message):
    __slots__ = ("previous_policy",)
    PREVIOUS_POLICY_FIELD_NUMBER: _ClassVar[int]
    previous_policy: str
    def __init__(self, previous_policy: _Optional[str] = ...) -> None: ...

class ListPoliciesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPoliciesResponse(_message.Message):
    __slots__ = ("policies",)
    POLICIES_FIELD_NUMBER: _ClassVar[int]
    policies: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, policies: _Optional[_Iterable[str]] = ...) -> None: ...

class SelfCheckRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SelfCheckResponse(_message.Message):
    __slots__ = ("ok", "problems")
    OK_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    problems: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ok: _Optional[bool] = ..., problems: _Optional[_Iterable[str]] = ...) -> None: ...

class ListTenantsRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    def __init__(self, pool: _Optional[str] = ...) -> None: ...

class TenantStallByCause(_message.Message):
    __slots__ = ("cause_tenant", "stall_seconds")
    CAUSE_TENANT_FIELD_NUMBER: _ClassVar[int]
    STALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    cause_tenant: str
    stall_seconds: float
    def __init__(self, cause_tenant: _Optional[str] = ..., stall_seconds: _Optional[float] = ...) -> None: ...

class TenantInfo(_message.Message):
    __slots__ = ("tenant", "pool", "weight", "guaranteed_pages", "limit_pages", "max_request_pages", "max_request_fraction", "device_pages", "reserved_pages", "queued_pages", "fair_share_pages", "evictions_suffered", "evictions_caused", "stalls_by_cause", "pinned_pages", "bytes_moved", "bytes_read", "bandwidth_cap_bytes_per_s", "read_budget_bytes_per_s", "charged_pages", "shared_pages", "shared_saved_pages", "engine_gpu_blocks", "private_prefixes")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    GUARANTEED_PAGES_FIELD_NUMBER: _ClassVar[int]
    LIMIT_PAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_PAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_FRACTION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_PAGES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PAGES_FIELD_NUMBER: _ClassVar[int]
    FAIR_SHARE_PAGES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_SUFFERED_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_CAUSED_FIELD_NUMBER: _ClassVar[int]
    STALLS_BY_CAUSE_FIELD_NUMBER: _ClassVar[int]
    PINNED_PAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_CAP_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    READ_BUDGET_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    CHARGED_PAGES_FIELD_NUMBER: _ClassVar[int]
    SHARED_PAGES_FIELD_NUMBER: _ClassVar[int]
    SHARED_SAVED_PAGES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PRIVATE_PREFIXES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    pool: str
    weight: float
    guaranteed_pages: int
    limit_pages: int
    max_request_pages: int
    max_request_fraction: float
    device_pages: int
    reserved_pages: int
    queued_pages: int
    fair_share_pages: float
    evictions_suffered: int
    evictions_caused: int
    stalls_by_cause: _containers.RepeatedCompositeFieldContainer[TenantStallByCause]
    pinned_pages: int
    bytes_moved: int
    bytes_read: int
    bandwidth_cap_bytes_per_s: float
    read_budget_bytes_per_s: float
    charged_pages: float
    shared_pages: int
    shared_saved_pages: float
    engine_gpu_blocks: float
    private_prefixes: bool
    def __init__(self, tenant: _Optional[str] = ..., pool: _Optional[str] = ..., weight: _Optional[float] = ..., guaranteed_pages: _Optional[int] = ..., limit_pages: _Optional[int] = ..., max_request_pages: _Optional[int] = ..., max_request_fraction: _Optional[float] = ..., device_pages: _Optional[int] = ..., reserved_pages: _Optional[int] = ..., queued_pages: _Optional[int] = ..., fair_share_pages: _Optional[float] = ..., evictions_suffered: _Optional[int] = ..., evictions_caused: _Optional[int] = ..., stalls_by_cause: _Optional[_Iterable[_Union[TenantStallByCause, _Mapping]]] = ..., pinned_pages: _Optional[int] = ..., bytes_moved: _Optional[int] = ..., bytes_read: _Optional[int] = ..., bandwidth_cap_bytes_per_s: _Optional[float] = ..., read_budget_bytes_per_s: _Optional[float] = ..., charged_pages: _Optional[float] = ..., shared_pages: _Optional[int] = ..., shared_saved_pages: _Optional[float] = ..., engine_gpu_blocks: _Optional[float] = ..., private_prefixes: _Optional[bool] = ...) -> None: ...

class ListTenantsResponse(_message.Message):
    __slots__ = ("tenants",)
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantInfo]
    def __init__(self, tenants: _Optional[_Iterable[_Union[TenantInfo, _Mapping]]] = ...) -> None: ...

class SetQuotaRequest(_message.Message):
    __slots__ = ("tenant", "pool", "weight", "guaranteed_pages", "limit_pages", "max_request_pages", "max_request_fraction", "bandwidth_cap_bytes_per_s", "request_bandwidth_cap_bytes_per_s", "read_budget_bytes_per_s", "guaranteed_bytes", "limit_bytes", "create", "reset")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    GUARANTEED_PAGES_FIELD_NUMBER: _ClassVar[int]
    LIMIT_PAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_PAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_FRACTION_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_CAP_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    REQUEST_BANDWIDTH_CAP_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    READ_BUDGET_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    GUARANTEED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATE_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    pool: str
    weight: float
    guaranteed_pages: int
    limit_pages: int
    max_request_pages: int
    max_request_fraction: float
    bandwidth_cap_bytes_per_s: float
    request_bandwidth_cap_bytes_per_s: float
    read_budget_bytes_per_s: float
    guaranteed_bytes: int
    limit_bytes: int
    create: bool
    reset: bool
    def __init__(self, tenant: _Optional[str] = ..., pool: _Optional[str] = ..., weight: _Optional[float] = ..., guaranteed_pages: _Optional[int] = ..., limit_pages: _Optional[int] = ..., max_request_pages: _Optional[int] = ..., max_request_fraction: _Optional[float] = ..., bandwidth_cap_bytes_per_s: _Optional[float] = ..., request_bandwidth_cap_bytes_per_s: _Optional[float] = ..., read_budget_bytes_per_s: _Optional[float] = ..., guaranteed_bytes: _Optional[int] = ..., limit_bytes: _Optional[int] = ..., create: _Optional[bool] = ..., reset: _Optional[bool] = ...) -> None: ...

class SetQuotaResponse(_message.Message):
    __slots__ = ("tenants",)
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantInfo]
    def __init__(self, tenants: _Optional[_Iterable[_Union[TenantInfo, _Mapping]]] = ...) -> None: ...

class ListRequestsRequest(_message.Message):
    __slots__ = ("pool", "limit")
    POOL_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    pool: str
    limit: int
    def __init__(self, pool: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class RequestInfo(_message.Message):
    __slots__ = ("request_id", "tenant", "pool", "state", "num_blocks", "device_blocks", "reserved_pages", "stall_seconds", "evictions_suffered", "bytes_moved", "bytes_read", "handoff_pool")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_PAGES_FIELD_NUMBER: _ClassVar[int]
    STALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_SUFFERED_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_POOL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    pool: str
    state: str
    num_blocks: int
    device_blocks: int
    reserved_pages: int
    stall_seconds: float
    evictions_suffered: int
    bytes_moved: int
    bytes_read: int
    handoff_pool: str
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., pool: _Optional[str] = ..., state: _Optional[str] = ..., num_blocks: _Optional[int] = ..., device_blocks: _Optional[int] = ..., reserved_pages: _Optional[int] = ..., stall_seconds: _Optional[float] = ..., evictions_suffered: _Optional[int] = ..., bytes_moved: _Optional[int] = ..., bytes_read: _Optional[int] = ..., handoff_pool: _Optional[str] = ...) -> None: ...

class ListRequestsResponse(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RequestInfo]
    def __init__(self, requests: _Optional[_Iterable[_Union[RequestInfo, _Mapping]]] = ...) -> None: ...

class ListLinksRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLinksResponse(_message.Message):
    __slots__ = ("links",)
    LINKS_FIELD_NUMBER: _ClassVar[int]
    links: _containers.RepeatedCompositeFieldContainer[LinkStats]
    def __init__(self, links: _Optional[_Iterable[_Union[LinkStats, _Mapping]]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetClusterRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    def __init__(self, pool: _Optional[str] = ...) -> None: ...

class ClusterNode(_message.Message):
    __slots__ = ("node", "pool", "device_pages", "reserved_pages", "queued_pages")
    NODE_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_PAGES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PAGES_FIELD_NUMBER: _ClassVar[int]
    node: str
    pool: str
    device_pages: int
    reserved_pages: int
    queued_pages: int
    def __init__(self, node: _Optional[str] = ..., pool: _Optional[str] = ..., device_pages: _Optional[int] = ..., reserved_pages: _Optional[int] = ..., queued_pages: _Optional[int] = ...) -> None: ...

class NodeEntitlement(_message.Message):
    __slots__ = ("node", "reserved_pages", "demand_pages", "entitlement_pages", "may_reserve_pages")
    NODE_FIELD_NUMBER: _ClassVar[int]
    RESERVED_PAGES_FIELD_NUMBER: _ClassVar[int]
    DEMAND_PAGES_FIELD_NUMBER: _ClassVar[int]
    ENTITLEMENT_PAGES_FIELD_NUMBER: _ClassVar[int]
    MAY_RESERVE_PAGES_FIELD_NUMBER: _ClassVar[int]
    node: str
    reserved_pages: int
    demand_pages: int
    entitlement_pages: int
    may_reserve_pages: int
    def __init__(self, node: _Optional[str] = ..., reserved_pages: _Optional[int] = ..., demand_pages: _Optional[int] = ..., entitlement_pages: _Optional[int] = ..., may_reserve_pages: _Optional[int] = ...) -> None: ...

class ClusterTenant(_message.Message):
    __slots__ = ("pool", "tenant", "weight", "guaranteed_pages", "limit_pages", "reserved_pages", "demand_pages", "share_pages", "nodes")
    POOL_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    GUARANTEED_PAGES_FIELD_NUMBER: _ClassVar[int]
    LIMIT_PAGES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_PAGES_FIELD_NUMBER: _ClassVar[int]
    DEMAND_PAGES_FIELD_NUMBER: _ClassVar[int]
    SHARE_PAGES_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    pool: str
    tenant: str
    weight: float
    guaranteed_pages: int
    limit_pages: int
    reserved_pages: int
    demand_pages: int
    share_pages: float
    nodes: _containers.RepeatedCompositeFieldContainer[NodeEntitlement]
    def __init__(self, pool: _Optional[str] = ..., tenant: _Optional[str] = ..., weight: _Optional[float] = ..., guaranteed_pages: _Optional[int] = ..., limit_pages: _Optional[int] = ..., reserved_pages: _Optional[int] = ..., demand_pages: _Optional[int] = ..., share_pages: _Optional[float] = ..., nodes: _Optional[_Iterable[_Union[NodeEntitlement, _Mapping]]] = ...) -> None: ...

class GetClusterResponse(_message.Message):
    __slots__ = ("enabled", "node", "etcd", "etcd_up", "picture_age_s", "detail", "nodes", "tenants")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    ETCD_FIELD_NUMBER: _ClassVar[int]
    ETCD_UP_FIELD_NUMBER: _ClassVar[int]
    PICTURE_AGE_S_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    node: str
    etcd: str
    etcd_up: bool
    picture_age_s: float
    detail: str
    nodes: _containers.RepeatedCompositeFieldContainer[ClusterNode]
    tenants: _containers.RepeatedCompositeFieldContainer[ClusterTenant]
    def __init__(self, enabled: _Optional[bool] = ..., node: _Optional[str] = ..., etcd: _Optional[str] = ..., etcd_up: _Optional[bool] = ..., picture_age_s: _Optional[float] = ..., detail: _Optional[str] = ..., nodes: _Optional[_Iterable[_Union[ClusterNode, _Mapping]]] = ..., tenants: _Optional[_Iterable[_Union[ClusterTenant, _Mapping]]] = ...) -> None: ...

class PeerReserveRequest(_message.Message):
    __slots__ = ("request_id", "tenant", "pool", "prompt_tokens", "output_tokens", "priority", "page_bytes", "block_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    pool: str
    prompt_tokens: int
    output_tokens: int
    priority: int
    page_bytes: int
    block_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., pool: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., page_bytes: _Optional[int] = ..., block_tokens: _Optional[int] = ...) -> None: ...

class PeerReserveResponse(_message.Message):
    __slots__ = ("decision", "reason", "capped")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CAPPED_FIELD_NUMBER: _ClassVar[int]
    decision: Decision
    reason: str
    capped: bool
    def __init__(self, decision: _Optional[_Union[Decision, str]] = ..., reason: _Optional[str] = ..., capped: _Optional[bool] = ...) -> None: ...

class PeerUnreserveRequest(_message.Message):
    __slots__ = ("request_id", "pool")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    pool: str
    def __init__(self, request_id: _Optional[str] = ..., pool: _Optional[str] = ...) -> None: ...

class PeerUnreserveResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class PeerBlocks(_message.Message):
    __slots__ = ("request_id", "pool", "block_indices", "page_bytes", "tenant", "prompt_tokens", "output_tokens", "priority", "first", "data", "commit", "shared", "indices_used")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDICES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    INDICES_USED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    pool: str
    block_indices: _containers.RepeatedScalarFieldContainer[int]
    page_bytes: int
    tenant: str
    prompt_tokens: int
    output_tokens: int
    priority: int
    first: int
    data: bytes
    commit: bool
    shared: _containers.RepeatedCompositeFieldContainer[PeerSharedBlock]
    indices_used: int
    def __init__(self, request_id: _Optional[str] = ..., pool: _Optional[str] = ..., block_indices: _Optional[_Iterable[int]] = ..., page_bytes: _Optional[int] = ..., tenant: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., first: _Optional[int] = ..., data: _Optional[bytes] = ..., commit: _Optional[bool] = ..., shared: _Optional[_Iterable[_Union[PeerSharedBlock, _Mapping]]] = ..., indices_used: _Optional[int] = ...) -> None: ...

class PeerSharedBlock(_message.Message):
    __slots__ = ("namespace", "key", "sent")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SENT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    key: bytes
    sent: bool
    def __init__(self, namespace: _Optional[str] = ..., key: _Optional[bytes] = ..., sent: _Optional[bool] = ...) -> None: ...

class PeerReceiveResponse(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    def __init__(self, blocks: _Optional[int] = ...) -> None: ...
