from tinsmith._proto import service_pb2 as _service_pb2
from tinsmith._proto import tinker_public_pb2 as _tinker_public_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CheckpointKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKPOINT_KIND_UNSPECIFIED: _ClassVar[CheckpointKind]
    CHECKPOINT_KIND_TRAINING: _ClassVar[CheckpointKind]
    CHECKPOINT_KIND_SAMPLER: _ClassVar[CheckpointKind]
    CHECKPOINT_KIND_EXTERNAL: _ClassVar[CheckpointKind]
CHECKPOINT_KIND_UNSPECIFIED: CheckpointKind
CHECKPOINT_KIND_TRAINING: CheckpointKind
CHECKPOINT_KIND_SAMPLER: CheckpointKind
CHECKPOINT_KIND_EXTERNAL: CheckpointKind

class LoraConfig(_message.Message):
    __slots__ = ("rank", "seed", "train_mlp", "train_attn", "train_unembed")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TRAIN_MLP_FIELD_NUMBER: _ClassVar[int]
    TRAIN_ATTN_FIELD_NUMBER: _ClassVar[int]
    TRAIN_UNEMBED_FIELD_NUMBER: _ClassVar[int]
    rank: int
    seed: int
    train_mlp: bool
    train_attn: bool
    train_unembed: bool
    def __init__(self, rank: _Optional[int] = ..., seed: _Optional[int] = ..., train_mlp: _Optional[bool] = ..., train_attn: _Optional[bool] = ..., train_unembed: _Optional[bool] = ...) -> None: ...

class CreateModel(_message.Message):
    __slots__ = ("session_id", "base_model", "lora", "optimizer", "user_metadata", "load_key", "load_optimizer", "load_path")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    LOAD_KEY_FIELD_NUMBER: _ClassVar[int]
    LOAD_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LOAD_PATH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    base_model: str
    lora: LoraConfig
    optimizer: str
    user_metadata: _containers.ScalarMap[str, str]
    load_key: str
    load_optimizer: bool
    load_path: str
    def __init__(self, session_id: _Optional[str] = ..., base_model: _Optional[str] = ..., lora: _Optional[_Union[LoraConfig, _Mapping]] = ..., optimizer: _Optional[str] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., load_key: _Optional[str] = ..., load_optimizer: _Optional[bool] = ..., load_path: _Optional[str] = ...) -> None: ...

class LoadWeights(_message.Message):
    __slots__ = ("path", "blob_key", "optimizer")
    PATH_FIELD_NUMBER: _ClassVar[int]
    BLOB_KEY_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    path: str
    blob_key: str
    optimizer: bool
    def __init__(self, path: _Optional[str] = ..., blob_key: _Optional[str] = ..., optimizer: _Optional[bool] = ...) -> None: ...

class AdamParams(_message.Message):
    __slots__ = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float
    def __init__(self, learning_rate: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., grad_clip_norm: _Optional[float] = ...) -> None: ...

class OptimStep(_message.Message):
    __slots__ = ("adam",)
    ADAM_FIELD_NUMBER: _ClassVar[int]
    adam: AdamParams
    def __init__(self, adam: _Optional[_Union[AdamParams, _Mapping]] = ...) -> None: ...

class SaveWeights(_message.Message):
    __slots__ = ("kind", "name", "sampler_id", "ttl_seconds", "user_metadata", "blob_key")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    BLOB_KEY_FIELD_NUMBER: _ClassVar[int]
    kind: CheckpointKind
    name: str
    sampler_id: str
    ttl_seconds: int
    user_metadata: _containers.ScalarMap[str, str]
    blob_key: str
    def __init__(self, kind: _Optional[_Union[CheckpointKind, str]] = ..., name: _Optional[str] = ..., sampler_id: _Optional[str] = ..., ttl_seconds: _Optional[int] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., blob_key: _Optional[str] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("base_model", "adapter_key", "prompt", "params", "num_samples", "prompt_logprobs", "prompt_logprobs_last_n", "topk_prompt_logprobs", "topk_sample_logprobs", "target_prompt_logprobs", "prompt_alt_tokens_k", "stream_to")
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_KEY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_LAST_N_FIELD_NUMBER: _ClassVar[int]
    TOPK_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_SAMPLE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TARGET_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ALT_TOKENS_K_FIELD_NUMBER: _ClassVar[int]
    STREAM_TO_FIELD_NUMBER: _ClassVar[int]
    base_model: str
    adapter_key: str
    prompt: _containers.RepeatedScalarFieldContainer[int]
    params: _tinker_public_pb2.SamplingParams
    num_samples: int
    prompt_logprobs: bool
    prompt_logprobs_last_n: int
    topk_prompt_logprobs: int
    topk_sample_logprobs: int
    target_prompt_logprobs: _tinker_public_pb2.Tensor
    prompt_alt_tokens_k: int
    stream_to: str
    def __init__(self, base_model: _Optional[str] = ..., adapter_key: _Optional[str] = ..., prompt: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_tinker_public_pb2.SamplingParams, _Mapping]] = ..., num_samples: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., prompt_logprobs_last_n: _Optional[int] = ..., topk_prompt_logprobs: _Optional[int] = ..., topk_sample_logprobs: _Optional[int] = ..., target_prompt_logprobs: _Optional[_Union[_tinker_public_pb2.Tensor, _Mapping]] = ..., prompt_alt_tokens_k: _Optional[int] = ..., stream_to: _Optional[str] = ...) -> None: ...

class SampleProgress(_message.Message):
    __slots__ = ("request_id", "deltas")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    deltas: _containers.RepeatedCompositeFieldContainer[_service_pb2.SampleDelta]
    def __init__(self, request_id: _Optional[str] = ..., deltas: _Optional[_Iterable[_Union[_service_pb2.SampleDelta, _Mapping]]] = ...) -> None: ...

class SessionCreated(_message.Message):
    __slots__ = ("session_id", "tags", "user_metadata", "project_id", "display_name", "sdk_version", "owner")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    PROJECT_ID_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    SDK_VERSION_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tags: _containers.RepeatedScalarFieldContainer[str]
    user_metadata: _containers.ScalarMap[str, str]
    project_id: str
    display_name: str
    sdk_version: str
    owner: str
    def __init__(self, session_id: _Optional[str] = ..., tags: _Optional[_Iterable[str]] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., project_id: _Optional[str] = ..., display_name: _Optional[str] = ..., sdk_version: _Optional[str] = ..., owner: _Optional[str] = ...) -> None: ...

class SessionFinished(_message.Message):
    __slots__ = ("session_id", "reason", "detail")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    reason: str
    detail: str
    def __init__(self, session_id: _Optional[str] = ..., reason: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class RequestAccepted(_message.Message):
    __slots__ = ("request_id", "aggregate_id", "seq_id", "create_model", "forward_backward", "optim_step", "save_weights", "sample", "load_weights")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    AGGREGATE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CREATE_MODEL_FIELD_NUMBER: _ClassVar[int]
    FORWARD_BACKWARD_FIELD_NUMBER: _ClassVar[int]
    OPTIM_STEP_FIELD_NUMBER: _ClassVar[int]
    SAVE_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    LOAD_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    aggregate_id: str
    seq_id: int
    create_model: CreateModel
    forward_backward: _tinker_public_pb2.ForwardBackwardRequest
    optim_step: OptimStep
    save_weights: SaveWeights
    sample: Sample
    load_weights: LoadWeights
    def __init__(self, request_id: _Optional[str] = ..., aggregate_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., create_model: _Optional[_Union[CreateModel, _Mapping]] = ..., forward_backward: _Optional[_Union[_tinker_public_pb2.ForwardBackwardRequest, _Mapping]] = ..., optim_step: _Optional[_Union[OptimStep, _Mapping]] = ..., save_weights: _Optional[_Union[SaveWeights, _Mapping]] = ..., sample: _Optional[_Union[Sample, _Mapping]] = ..., load_weights: _Optional[_Union[LoadWeights, _Mapping]] = ...) -> None: ...

class RequestRejected(_message.Message):
    __slots__ = ("aggregate_id", "seq_id", "kind", "detail")
    AGGREGATE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    aggregate_id: str
    seq_id: int
    kind: str
    detail: str
    def __init__(self, aggregate_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., kind: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class RequestCancelled(_message.Message):
    __slots__ = ("request_id", "aggregate_id", "detail")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    AGGREGATE_ID_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    aggregate_id: str
    detail: str
    def __init__(self, request_id: _Optional[str] = ..., aggregate_id: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class RequestCompleted(_message.Message):
    __slots__ = ("request_id", "aggregate_id", "result_seq", "media_type", "compute_seconds", "replica", "epoch", "metrics", "started")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    AGGREGATE_ID_FIELD_NUMBER: _ClassVar[int]
    RESULT_SEQ_FIELD_NUMBER: _ClassVar[int]
    MEDIA_TYPE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    aggregate_id: str
    result_seq: int
    media_type: str
    compute_seconds: float
    replica: str
    epoch: int
    metrics: _containers.ScalarMap[str, float]
    started: float
    def __init__(self, request_id: _Optional[str] = ..., aggregate_id: _Optional[str] = ..., result_seq: _Optional[int] = ..., media_type: _Optional[str] = ..., compute_seconds: _Optional[float] = ..., replica: _Optional[str] = ..., epoch: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., started: _Optional[float] = ...) -> None: ...

class RequestFailed(_message.Message):
    __slots__ = ("request_id", "aggregate_id", "kind", "detail", "epoch", "started")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    AGGREGATE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    aggregate_id: str
    kind: str
    detail: str
    epoch: int
    started: float
    def __init__(self, request_id: _Optional[str] = ..., aggregate_id: _Optional[str] = ..., kind: _Optional[str] = ..., detail: _Optional[str] = ..., epoch: _Optional[int] = ..., started: _Optional[float] = ...) -> None: ...

class RunCreated(_message.Message):
    __slots__ = ("model_id", "session_id", "base_model", "lora", "user_metadata", "tokenizer_id", "epoch")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    session_id: str
    base_model: str
    lora: LoraConfig
    user_metadata: _containers.ScalarMap[str, str]
    tokenizer_id: str
    epoch: int
    def __init__(self, model_id: _Optional[str] = ..., session_id: _Optional[str] = ..., base_model: _Optional[str] = ..., lora: _Optional[_Union[LoraConfig, _Mapping]] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., tokenizer_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class WeightsSaved(_message.Message):
    __slots__ = ("model_id", "tinker_path", "blob_key", "kind", "base_model", "lora_rank", "size_bytes", "ttl_seconds", "user_metadata", "lora", "epoch")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TINKER_PATH_FIELD_NUMBER: _ClassVar[int]
    BLOB_KEY_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    tinker_path: str
    blob_key: str
    kind: CheckpointKind
    base_model: str
    lora_rank: int
    size_bytes: int
    ttl_seconds: int
    user_metadata: _containers.ScalarMap[str, str]
    lora: LoraConfig
    epoch: int
    def __init__(self, model_id: _Optional[str] = ..., tinker_path: _Optional[str] = ..., blob_key: _Optional[str] = ..., kind: _Optional[_Union[CheckpointKind, str]] = ..., base_model: _Optional[str] = ..., lora_rank: _Optional[int] = ..., size_bytes: _Optional[int] = ..., ttl_seconds: _Optional[int] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., lora: _Optional[_Union[LoraConfig, _Mapping]] = ..., epoch: _Optional[int] = ...) -> None: ...

class RunUnloaded(_message.Message):
    __slots__ = ("model_id", "snapshot_key", "next_seq_id", "create", "epoch")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_KEY_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CREATE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    snapshot_key: str
    next_seq_id: int
    create: CreateModel
    epoch: int
    def __init__(self, model_id: _Optional[str] = ..., snapshot_key: _Optional[str] = ..., next_seq_id: _Optional[int] = ..., create: _Optional[_Union[CreateModel, _Mapping]] = ..., epoch: _Optional[int] = ...) -> None: ...

class RunSnapshotted(_message.Message):
    __slots__ = ("model_id", "snapshot_key", "next_seq_id", "create", "epoch")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_KEY_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CREATE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    snapshot_key: str
    next_seq_id: int
    create: CreateModel
    epoch: int
    def __init__(self, model_id: _Optional[str] = ..., snapshot_key: _Optional[str] = ..., next_seq_id: _Optional[int] = ..., create: _Optional[_Union[CreateModel, _Mapping]] = ..., epoch: _Optional[int] = ...) -> None: ...

class RunRestored(_message.Message):
    __slots__ = ("model_id", "snapshot_key", "epoch")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_KEY_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    snapshot_key: str
    epoch: int
    def __init__(self, model_id: _Optional[str] = ..., snapshot_key: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class RunPlaced(_message.Message):
    __slots__ = ("model_id", "replica", "epoch", "takeover")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TAKEOVER_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    replica: str
    epoch: int
    takeover: bool
    def __init__(self, model_id: _Optional[str] = ..., replica: _Optional[str] = ..., epoch: _Optional[int] = ..., takeover: _Optional[bool] = ...) -> None: ...

class MetricsReported(_message.Message):
    __slots__ = ("model_id", "step", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    step: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, model_id: _Optional[str] = ..., step: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class SamplerCreated(_message.Message):
    __slots__ = ("sampler_id", "session_id", "base_model", "model_path", "adapter_key")
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_KEY_FIELD_NUMBER: _ClassVar[int]
    sampler_id: str
    session_id: str
    base_model: str
    model_path: str
    adapter_key: str
    def __init__(self, sampler_id: _Optional[str] = ..., session_id: _Optional[str] = ..., base_model: _Optional[str] = ..., model_path: _Optional[str] = ..., adapter_key: _Optional[str] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("time", "session_created", "session_finished", "request_accepted", "request_rejected", "request_completed", "request_failed", "run_created", "weights_saved", "sampler_created", "run_unloaded", "run_restored", "checkpoint_deleted", "checkpoint_published", "checkpoint_ttl_set", "request_cancelled", "key_issued", "key_revoked", "run_snapshotted", "run_placed", "metrics_reported", "weights_copied", "session_project_assigned")
    TIME_FIELD_NUMBER: _ClassVar[int]
    SESSION_CREATED_FIELD_NUMBER: _ClassVar[int]
    SESSION_FINISHED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_REJECTED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FAILED_FIELD_NUMBER: _ClassVar[int]
    RUN_CREATED_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_SAVED_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_CREATED_FIELD_NUMBER: _ClassVar[int]
    RUN_UNLOADED_FIELD_NUMBER: _ClassVar[int]
    RUN_RESTORED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DELETED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_TTL_SET_FIELD_NUMBER: _ClassVar[int]
    REQUEST_CANCELLED_FIELD_NUMBER: _ClassVar[int]
    KEY_ISSUED_FIELD_NUMBER: _ClassVar[int]
    KEY_REVOKED_FIELD_NUMBER: _ClassVar[int]
    RUN_SNAPSHOTTED_FIELD_NUMBER: _ClassVar[int]
    RUN_PLACED_FIELD_NUMBER: _ClassVar[int]
    METRICS_REPORTED_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_COPIED_FIELD_NUMBER: _ClassVar[int]
    SESSION_PROJECT_ASSIGNED_FIELD_NUMBER: _ClassVar[int]
    time: float
    session_created: SessionCreated
    session_finished: SessionFinished
    request_accepted: RequestAccepted
    request_rejected: RequestRejected
    request_completed: RequestCompleted
    request_failed: RequestFailed
    run_created: RunCreated
    weights_saved: WeightsSaved
    sampler_created: SamplerCreated
    run_unloaded: RunUnloaded
    run_restored: RunRestored
    checkpoint_deleted: CheckpointDeleted
    checkpoint_published: CheckpointPublished
    checkpoint_ttl_set: CheckpointTtlSet
    request_cancelled: RequestCancelled
    key_issued: KeyIssued
    key_revoked: KeyRevoked
    run_snapshotted: RunSnapshotted
    run_placed: RunPlaced
    metrics_reported: MetricsReported
    weights_copied: WeightsCopied
    session_project_assigned: SessionProjectAssigned
    def __init__(self, time: _Optional[float] = ..., session_created: _Optional[_Union[SessionCreated, _Mapping]] = ..., session_finished: _Optional[_Union[SessionFinished, _Mapping]] = ..., request_accepted: _Optional[_Union[RequestAccepted, _Mapping]] = ..., request_rejected: _Optional[_Union[RequestRejected, _Mapping]] = ..., request_completed: _Optional[_Union[RequestCompleted, _Mapping]] = ..., request_failed: _Optional[_Union[RequestFailed, _Mapping]] = ..., run_created: _Optional[_Union[RunCreated, _Mapping]] = ..., weights_saved: _Optional[_Union[WeightsSaved, _Mapping]] = ..., sampler_created: _Optional[_Union[SamplerCreated, _Mapping]] = ..., run_unloaded: _Optional[_Union[RunUnloaded, _Mapping]] = ..., run_restored: _Optional[_Union[RunRestored, _Mapping]] = ..., checkpoint_deleted: _Optional[_Union[CheckpointDeleted, _Mapping]] = ..., checkpoint_published: _Optional[_Union[CheckpointPublished, _Mapping]] = ..., checkpoint_ttl_set: _Optional[_Union[CheckpointTtlSet, _Mapping]] = ..., request_cancelled: _Optional[_Union[RequestCancelled, _Mapping]] = ..., key_issued: _Optional[_Union[KeyIssued, _Mapping]] = ..., key_revoked: _Optional[_Union[KeyRevoked, _Mapping]] = ..., run_snapshotted: _Optional[_Union[RunSnapshotted, _Mapping]] = ..., run_placed: _Optional[_Union[RunPlaced, _Mapping]] = ..., metrics_reported: _Optional[_Union[MetricsReported, _Mapping]] = ..., weights_copied: _Optional[_Union[WeightsCopied, _Mapping]] = ..., session_project_assigned: _Optional[_Union[SessionProjectAssigned, _Mapping]] = ...) -> None: ...

class CatalogQuery(_message.Message):
    __slots__ = ("training_run_id", "owner", "access_scope", "limit", "offset", "project_id", "tinker_path", "session_id", "ttl_seconds", "public", "base_url", "grace_s", "admin", "step", "metrics", "tag", "sweep", "metric", "goal", "idempotency_key", "model_seq_id", "search", "event_type", "day", "starting_on", "ending_before")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    ACCESS_SCOPE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PROJECT_ID_FIELD_NUMBER: _ClassVar[int]
    TINKER_PATH_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_FIELD_NUMBER: _ClassVar[int]
    BASE_URL_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    SWEEP_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    GOAL_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SEARCH_FIELD_NUMBER: _ClassVar[int]
    EVENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    DAY_FIELD_NUMBER: _ClassVar[int]
    STARTING_ON_FIELD_NUMBER: _ClassVar[int]
    ENDING_BEFORE_FIELD_NUMBER: _ClassVar[int]
    training_run_id: str
    owner: str
    access_scope: str
    limit: int
    offset: int
    project_id: str
    tinker_path: str
    session_id: str
    ttl_seconds: int
    public: bool
    base_url: str
    grace_s: float
    admin: bool
    step: int
    metrics: _containers.ScalarMap[str, float]
    tag: str
    sweep: str
    metric: str
    goal: str
    idempotency_key: str
    model_seq_id: int
    search: str
    event_type: str
    day: str
    starting_on: float
    ending_before: float
    def __init__(self, training_run_id: _Optional[str] = ..., owner: _Optional[str] = ..., access_scope: _Optional[str] = ..., limit: _Optional[int] = ..., offset: _Optional[int] = ..., project_id: _Optional[str] = ..., tinker_path: _Optional[str] = ..., session_id: _Optional[str] = ..., ttl_seconds: _Optional[int] = ..., public: _Optional[bool] = ..., base_url: _Optional[str] = ..., grace_s: _Optional[float] = ..., admin: _Optional[bool] = ..., step: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., tag: _Optional[str] = ..., sweep: _Optional[str] = ..., metric: _Optional[str] = ..., goal: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., model_seq_id: _Optional[int] = ..., search: _Optional[str] = ..., event_type: _Optional[str] = ..., day: _Optional[str] = ..., starting_on: _Optional[float] = ..., ending_before: _Optional[float] = ...) -> None: ...

class CatalogReply(_message.Message):
    __slots__ = ("error_kind", "error_detail", "json")
    ERROR_KIND_FIELD_NUMBER: _ClassVar[int]
    ERROR_DETAIL_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    error_kind: str
    error_detail: str
    json: bytes
    def __init__(self, error_kind: _Optional[str] = ..., error_detail: _Optional[str] = ..., json: _Optional[bytes] = ...) -> None: ...

class CheckpointDeleted(_message.Message):
    __slots__ = ("model_id", "tinker_path", "blob_key", "reason")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TINKER_PATH_FIELD_NUMBER: _ClassVar[int]
    BLOB_KEY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    tinker_path: str
    blob_key: str
    reason: str
    def __init__(self, model_id: _Optional[str] = ..., tinker_path: _Optional[str] = ..., blob_key: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CheckpointPublished(_message.Message):
    __slots__ = ("model_id", "tinker_path", "public")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TINKER_PATH_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    tinker_path: str
    public: bool
    def __init__(self, model_id: _Optional[str] = ..., tinker_path: _Optional[str] = ..., public: _Optional[bool] = ...) -> None: ...

class WeightsCopied(_message.Message):
    __slots__ = ("model_id", "session_id", "owner", "project_id", "source_path", "idempotency_key", "saved")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    PROJECT_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_PATH_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    SAVED_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    session_id: str
    owner: str
    project_id: str
    source_path: str
    idempotency_key: str
    saved: WeightsSaved
    def __init__(self, model_id: _Optional[str] = ..., session_id: _Optional[str] = ..., owner: _Optional[str] = ..., project_id: _Optional[str] = ..., source_path: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., saved: _Optional[_Union[WeightsSaved, _Mapping]] = ...) -> None: ...

class SessionProjectAssigned(_message.Message):
    __slots__ = ("session_id", "project_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROJECT_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    project_id: str
    def __init__(self, session_id: _Optional[str] = ..., project_id: _Optional[str] = ...) -> None: ...

class CheckpointTtlSet(_message.Message):
    __slots__ = ("model_id", "tinker_path", "ttl_seconds", "expires_at")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TINKER_PATH_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    tinker_path: str
    ttl_seconds: int
    expires_at: float
    def __init__(self, model_id: _Optional[str] = ..., tinker_path: _Optional[str] = ..., ttl_seconds: _Optional[int] = ..., expires_at: _Optional[float] = ...) -> None: ...

class Quotas(_message.Message):
    __slots__ = ("max_runs", "max_sessions", "max_checkpoint_bytes", "max_inflight", "max_queued_samples")
    MAX_RUNS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHECKPOINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    max_runs: int
    max_sessions: int
    max_checkpoint_bytes: int
    max_inflight: int
    max_queued_samples: int
    def __init__(self, max_runs: _Optional[int] = ..., max_sessions: _Optional[int] = ..., max_checkpoint_bytes: _Optional[int] = ..., max_inflight: _Optional[int] = ..., max_queued_samples: _Optional[int] = ...) -> None: ...

class KeyIssued(_message.Message):
    __slots__ = ("key_id", "tenant", "admin", "salt", "digest", "quotas", "label")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    SALT_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    QUOTAS_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    tenant: str
    admin: bool
    salt: bytes
    digest: bytes
    quotas: Quotas
    label: str
    def __init__(self, key_id: _Optional[str] = ..., tenant: _Optional[str] = ..., admin: _Optional[bool] = ..., salt: _Optional[bytes] = ..., digest: _Optional[bytes] = ..., quotas: _Optional[_Union[Quotas, _Mapping]] = ..., label: _Optional[str] = ...) -> None: ...

class KeyRevoked(_message.Message):
    __slots__ = ("key_id", "reason")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    reason: str
    def __init__(self, key_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...
