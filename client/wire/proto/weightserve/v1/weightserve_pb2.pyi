from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Revision(_message.Message):
    __slots__ = ("commit", "parent", "created", "bytes", "message", "metadata_json")
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    commit: str
    parent: str
    created: float
    bytes: int
    message: str
    metadata_json: str
    def __init__(self, commit: _Optional[str] = ..., parent: _Optional[str] = ..., created: _Optional[float] = ..., bytes: _Optional[int] = ..., message: _Optional[str] = ..., metadata_json: _Optional[str] = ...) -> None: ...

class RevisionList(_message.Message):
    __slots__ = ("model", "revisions")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISIONS_FIELD_NUMBER: _ClassVar[int]
    model: str
    revisions: _containers.RepeatedCompositeFieldContainer[Revision]
    def __init__(self, model: _Optional[str] = ..., revisions: _Optional[_Iterable[_Union[Revision, _Mapping]]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("model", "since", "after")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    model: str
    since: str
    after: int
    def __init__(self, model: _Optional[str] = ..., since: _Optional[str] = ..., after: _Optional[int] = ...) -> None: ...

class RevisionEvent(_message.Message):
    __slots__ = ("event", "main", "revision", "sequence", "history_cut")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    MAIN_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    HISTORY_CUT_FIELD_NUMBER: _ClassVar[int]
    event: str
    main: str
    revision: Revision
    sequence: int
    history_cut: bool
    def __init__(self, event: _Optional[str] = ..., main: _Optional[str] = ..., revision: _Optional[_Union[Revision, _Mapping]] = ..., sequence: _Optional[int] = ..., history_cut: bool = ...) -> None: ...

class FileList(_message.Message):
    __slots__ = ("id", "revision", "commit", "files")
    ID_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    id: str
    revision: str
    commit: str
    files: _containers.RepeatedCompositeFieldContainer[FileInfo]
    def __init__(self, id: _Optional[str] = ..., revision: _Optional[str] = ..., commit: _Optional[str] = ..., files: _Optional[_Iterable[_Union[FileInfo, _Mapping]]] = ...) -> None: ...

class FileInfo(_message.Message):
    __slots__ = ("name", "size", "etag")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    ETAG_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    etag: str
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., etag: _Optional[str] = ...) -> None: ...

class FileRequest(_message.Message):
    __slots__ = ("model", "name", "offset", "length", "revision")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    model: str
    name: str
    offset: int
    length: int
    revision: str
    def __init__(self, model: _Optional[str] = ..., name: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., revision: _Optional[str] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("version", "flight_port", "instance", "http_port", "uds")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FLIGHT_PORT_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    HTTP_PORT_FIELD_NUMBER: _ClassVar[int]
    UDS_FIELD_NUMBER: _ClassVar[int]
    version: str
    flight_port: int
    instance: str
    http_port: int
    uds: str
    def __init__(self, version: _Optional[str] = ..., flight_port: _Optional[int] = ..., instance: _Optional[str] = ..., http_port: _Optional[int] = ..., uds: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "problems")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelSummary]
    problems: _containers.RepeatedCompositeFieldContainer[ModelProblem]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelSummary, _Mapping]]] = ..., problems: _Optional[_Iterable[_Union[ModelProblem, _Mapping]]] = ...) -> None: ...

class ModelSummary(_message.Message):
    __slots__ = ("id", "format", "revision", "tensor_count", "total_bytes", "state", "commit", "cached_revision")
    ID_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    CACHED_REVISION_FIELD_NUMBER: _ClassVar[int]
    id: str
    format: str
    revision: str
    tensor_count: int
    total_bytes: int
    state: str
    commit: str
    cached_revision: str
    def __init__(self, id: _Optional[str] = ..., format: _Optional[str] = ..., revision: _Optional[str] = ..., tensor_count: _Optional[int] = ..., total_bytes: _Optional[int] = ..., state: _Optional[str] = ..., commit: _Optional[str] = ..., cached_revision: _Optional[str] = ...) -> None: ...

class ModelProblem(_message.Message):
    __slots__ = ("model", "file", "reason")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    model: str
    file: str
    reason: str
    def __init__(self, model: _Optional[str] = ..., file: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class GetModelRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("id", "format", "revision", "alignment", "metadata_json", "tensors", "commit")
    ID_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    ALIGNMENT_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    id: str
    format: str
    revision: str
    alignment: int
    metadata_json: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    commit: str
    def __init__(self, id: _Optional[str] = ..., format: _Optional[str] = ..., revision: _Optional[str] = ..., alignment: _Optional[int] = ..., metadata_json: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ..., commit: _Optional[str] = ...) -> None: ...

class TensorInfo(_message.Message):
    __slots__ = ("name", "dtype", "shape", "logical_shape", "encoding", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    logical_shape: _containers.RepeatedScalarFieldContainer[int]
    encoding: str
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., logical_shape: _Optional[_Iterable[int]] = ..., encoding: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class TensorRequest(_message.Message):
    __slots__ = ("model", "names", "prefix", "use_prefix", "shard_index", "shard_count", "shard_axis", "resume_tensor", "resume_offset", "chunk_bytes", "revision")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    USE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    SHARD_AXIS_FIELD_NUMBER: _ClassVar[int]
    RESUME_TENSOR_FIELD_NUMBER: _ClassVar[int]
    RESUME_OFFSET_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    model: str
    names: _containers.RepeatedScalarFieldContainer[str]
    prefix: str
    use_prefix: bool
    shard_index: int
    shard_count: int
    shard_axis: int
    resume_tensor: str
    resume_offset: int
    chunk_bytes: int
    revision: str
    def __init__(self, model: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ..., prefix: _Optional[str] = ..., use_prefix: bool = ..., shard_index: _Optional[int] = ..., shard_count: _Optional[int] = ..., shard_axis: _Optional[int] = ..., resume_tensor: _Optional[str] = ..., resume_offset: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., revision: _Optional[str] = ...) -> None: ...

class GetTensorRequest(_message.Message):
    __slots__ = ("request", "max_bytes")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    request: TensorRequest
    max_bytes: int
    def __init__(self, request: _Optional[_Union[TensorRequest, _Mapping]] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class TensorData(_message.Message):
    __slots__ = ("name", "dtype", "shape", "logical_shape", "encoding", "total_bytes", "digest", "data", "too_large")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOO_LARGE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    logical_shape: _containers.RepeatedScalarFieldContainer[int]
    encoding: str
    total_bytes: int
    digest: int
    data: bytes
    too_large: bool
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., logical_shape: _Optional[_Iterable[int]] = ..., encoding: _Optional[str] = ..., total_bytes: _Optional[int] = ..., digest: _Optional[int] = ..., data: _Optional[bytes] = ..., too_large: bool = ...) -> None: ...

class ArrowData(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...
