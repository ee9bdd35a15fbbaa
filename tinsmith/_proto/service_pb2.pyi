from tinsmith._proto import tinker_public_pb2 as _tinker_public_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CreateSessionRequest(_message.Message):
    __slots__ = ("tags", "user_metadata", "project_id", "display_name")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TAGS_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    PROJECT_ID_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    user_metadata: _containers.ScalarMap[str, str]
    project_id: str
    display_name: str
    def __init__(self, tags: _Optional[_Iterable[str]] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., project_id: _Optional[str] = ..., display_name: _Optional[str] = ...) -> None: ...

class CreateSessionResponse(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CreateModelRequest(_message.Message):
    __slots__ = ("session_id", "model_seq_id", "base_model", "lora_rank", "seed", "train_mlp", "train_attn", "train_unembed", "user_metadata")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TRAIN_MLP_FIELD_NUMBER: _ClassVar[int]
    TRAIN_ATTN_FIELD_NUMBER: _ClassVar[int]
    TRAIN_UNEMBED_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model_seq_id: int
    base_model: str
    lora_rank: int
    seed: int
    train_mlp: bool
    train_attn: bool
    train_unembed: bool
    user_metadata: _containers.ScalarMap[str, str]
    def __init__(self, session_id: _Optional[str] = ..., model_seq_id: _Optional[int] = ..., base_model: _Optional[str] = ..., lora_rank: _Optional[int] = ..., seed: _Optional[int] = ..., train_mlp: _Optional[bool] = ..., train_attn: _Optional[bool] = ..., train_unembed: _Optional[bool] = ..., user_metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CreateModelResponse(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class LoadStateRequest(_message.Message):
    __slots__ = ("session_id", "model_seq_id", "path", "with_optimizer")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    WITH_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model_seq_id: int
    path: str
    with_optimizer: bool
    def __init__(self, session_id: _Optional[str] = ..., model_seq_id: _Optional[int] = ..., path: _Optional[str] = ..., with_optimizer: _Optional[bool] = ...) -> None: ...

class OptimizerParams(_message.Message):
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

class OptimStepRequest(_message.Message):
    __slots__ = ("model_id", "seq_id", "adam_params")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    ADAM_PARAMS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    seq_id: int
    adam_params: OptimizerParams
    def __init__(self, model_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., adam_params: _Optional[_Union[OptimizerParams, _Mapping]] = ...) -> None: ...

class OptimStepResponse(_message.Message):
    __slots__ = ("metrics",)
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    METRICS_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class SaveRequest(_message.Message):
    __slots__ = ("model_id", "seq_id", "path", "overwrite", "ttl_seconds", "user_metadata", "sampling_session_seq_id")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_SESSION_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    seq_id: int
    path: str
    overwrite: bool
    ttl_seconds: int
    user_metadata: _containers.ScalarMap[str, str]
    sampling_session_seq_id: int
    def __init__(self, model_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., path: _Optional[str] = ..., overwrite: _Optional[bool] = ..., ttl_seconds: _Optional[int] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., sampling_session_seq_id: _Optional[int] = ...) -> None: ...

class SaveResponse(_message.Message):
    __slots__ = ("path", "sampling_session_id")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    path: str
    sampling_session_id: str
    def __init__(self, path: _Optional[str] = ..., sampling_session_id: _Optional[str] = ...) -> None: ...

class CreateSamplingSessionRequest(_message.Message):
    __slots__ = ("session_id", "sampling_session_seq_id", "base_model", "model_path")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_SESSION_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sampling_session_seq_id: int
    base_model: str
    model_path: str
    def __init__(self, session_id: _Optional[str] = ..., sampling_session_seq_id: _Optional[int] = ..., base_model: _Optional[str] = ..., model_path: _Optional[str] = ...) -> None: ...

class CreateSamplingSessionResponse(_message.Message):
    __slots__ = ("sampling_session_id",)
    SAMPLING_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    sampling_session_id: str
    def __init__(self, sampling_session_id: _Optional[str] = ...) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ("sampling_session_id", "seq_id", "prompt", "sampling_params", "num_samples", "prompt_logprobs", "topk_prompt_logprobs", "topk_sample_logprobs")
    SAMPLING_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_SAMPLE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    sampling_session_id: str
    seq_id: int
    prompt: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _tinker_public_pb2.SamplingParams
    num_samples: int
    prompt_logprobs: bool
    topk_prompt_logprobs: int
    topk_sample_logprobs: int
    def __init__(self, sampling_session_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., prompt: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_tinker_public_pb2.SamplingParams, _Mapping]] = ..., num_samples: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., topk_prompt_logprobs: _Optional[int] = ..., topk_sample_logprobs: _Optional[int] = ...) -> None: ...

class SampleChunk(_message.Message):
    __slots__ = ("deltas", "response")
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedCompositeFieldContainer[SampleDelta]
    response: _tinker_public_pb2.SampleResponse
    def __init__(self, deltas: _Optional[_Iterable[_Union[SampleDelta, _Mapping]]] = ..., response: _Optional[_Union[_tinker_public_pb2.SampleResponse, _Mapping]] = ...) -> None: ...

class SampleDelta(_message.Message):
    __slots__ = ("index", "offset", "tokens", "logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    tokens: bytes
    logprobs: bytes
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., tokens: _Optional[bytes] = ..., logprobs: _Optional[bytes] = ...) -> None: ...

class ListTrainingRunsRequest(_message.Message):
    __slots__ = ("limit", "offset")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    limit: int
    offset: int
    def __init__(self, limit: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ("training_run_id",)
    TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    training_run_id: str
    def __init__(self, training_run_id: _Optional[str] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CatalogDocument(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...
