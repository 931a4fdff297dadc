"""An in-process server: a table of models held in memory, served through the ``Transport``
protocol as a server would (the same Arrow stream, chunks, digests and resumes), with no
socket. For tests of what sits above the seam, as httpx's ``MockTransport`` is: a stream can
be cut where the test says, and every stream asked for is recorded.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import pyarrow as pa
import xxhash

from weightserve.client.errors import (
    FileNotFound,
    InvalidRequest,
    ModelNotFound,
    RevisionNotFound,
    TensorNotFound,
    TransportError,
    WrongTransport,
)
from weightserve.client.receive.arrow_reader import ArrowChunkReader
from weightserve.client.transports.base import (
    ByteSource,
    ChunkReader,
    DataTransport,
    FileSource,
    FileSpan,
    RefusesControl,
    StreamParams,
)
from weightserve.client.wire.dtypes import from_numpy_dtype
from weightserve.client.wire.routes import ServerAddress, split_revision
from weightserve.client.wire.schema import DEFAULT_CHUNK_BYTES, TENSOR_SCHEMA

MEMORY_ADDRESS = ServerAddress("http", False, "memory", 0)


class MemoryTransport(RefusesControl, DataTransport):
    """``models`` (id -> name -> array) served in MAX's order (by name), each model at one
    revision named from its bytes. ``cuts``: the n-th stream opened breaks after ``cuts[n]``
    bytes (None: whole); ``opened`` records every stream's parameters. Control verbs are
    refused: there is no server to publish to."""

    def __init__(
        self,
        models: Mapping[str, Mapping[str, np.ndarray]],
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        cuts: Sequence[int | None] = (),
    ) -> None:
        self.address = MEMORY_ADDRESS
        self.chunk_bytes = chunk_bytes
        self.models = {
            model: {name: np.ascontiguousarray(tensors[name]) for name in sorted(tensors)}
            for model, tensors in models.items()
        }
        self.commits = {model: _commit(tensors) for model, tensors in self.models.items()}
        self.cuts = list(cuts)
        self.opened: list[StreamParams] = []

    def _refuse(self, what: str) -> WrongTransport:
        return WrongTransport(f"{what} needs a server: this transport is an in-memory table")

    def _model(self, model: str) -> tuple[dict[str, np.ndarray], str]:
        plain, revision = split_revision(model)
        if plain not in self.models:
            raise ModelNotFound(f"model {plain!r} is not in this in-memory table")
        commit = self.commits[plain]
        if revision and revision != "main" and not commit.startswith(revision):
            raise RevisionNotFound(f"{plain!r} is held at {commit[:16]} only, not {revision!r}")
        return self.models[plain], commit

    def list_models(self) -> dict[str, Any]:
        return {
            "models": [
                {
                    "id": model,
                    "format": "safetensors",
                    "revision": self.commits[model][:16],
                    "tensor_count": len(tensors),
                    "total_bytes": sum(a.nbytes for a in tensors.values()),
                    "commit": self.commits[model],
                }
                for model, tensors in self.models.items()
            ],
            "problems": [],
        }

    def model_info(self, model: str) -> dict[str, Any]:
        tensors, commit = self._model(model)
        return {
            "id": model,
            "format": "safetensors",
            "revision": commit[:16],
            "commit": commit,
            "alignment": 1,
            "metadata": {},
            "tensors": [
                {
                    "name": name,
                    "dtype": from_numpy_dtype(a.dtype),
                    "shape": list(a.shape),
                    "logical_shape": list(a.shape),
                    "encoding": None,
                    "nbytes": a.nbytes,
                }
                for name, a in tensors.items()
            ],
        }

    def server_info(self) -> dict[str, Any]:
        return {}

    def open_stream(self, model: str, params: StreamParams) -> ByteSource:
        self.opened.append(params)
        tensors, commit = self._model(model)
        if params.revision and not commit.startswith(params.revision):
            raise RevisionNotFound(f"{model!r} is at {commit[:16]}, not {params.revision}")
        if params.shard is not None:
            raise InvalidRequest("an in-memory table serves whole tensors only, not shards")
        if params.names is not None:
            missing = [n for n in params.names if n not in tensors]
            if missing:
                raise TensorNotFound(f"No weight named {missing[0]!r} in model {model!r}.")
            names = list(params.names)
        else:
            names = [n for n in tensors if n.startswith(params.prefix or "")]
        if params.resume_tensor is not None:
            names = names[names.index(params.resume_tensor) :]
        stream = _arrow_stream(
            tensors, names, params.chunk_bytes or self.chunk_bytes, params.resume_offset
        )
        cut = self.cuts.pop(0) if self.cuts else None
        return _MemorySource(stream, cut)

    def open_chunks(self, model: str, params: StreamParams) -> ChunkReader:
        return ArrowChunkReader(self.open_stream(model, params))

    def list_files(self, model: str) -> dict[str, Any]:
        _, commit = self._model(model)
        return {"id": model, "revision": commit[:16], "commit": commit, "files": []}

    def open_span(self, model: str, name: str, span: FileSpan) -> FileSource:
        # No file, whatever part of it is asked for.
        raise FileNotFound(f"an in-memory table holds tensors, no file {name!r}")

    def receiving(self, nbytes: int) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def close(self) -> None:
        pass


def _commit(tensors: Mapping[str, np.ndarray]) -> str:
    digest = hashlib.sha256()
    for name, array in tensors.items():
        digest.update(f"{name}\0{array.dtype.str}\0{array.shape}\0".encode())
        digest.update(array.reshape(-1).view(np.uint8).tobytes())
    return digest.hexdigest()[:40]


def _arrow_stream(
    tensors: Mapping[str, np.ndarray], names: list[str], chunk_bytes: int, resume_offset: int
) -> bytes:
    """The Arrow IPC stream a server sends for ``names`` (the first from ``resume_offset``)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, TENSOR_SCHEMA) as writer:
        for i, name in enumerate(names):
            array = tensors[name]
            data = array.reshape(-1).view(np.uint8)
            offset = resume_offset if i == 0 else 0
            while True:
                piece = data[offset : offset + chunk_bytes].tobytes()
                row = {
                    "name": name,
                    "dtype": from_numpy_dtype(array.dtype),
                    "shape": list(array.shape),
                    "logical_shape": list(array.shape),
                    "encoding": None,
                    "offset": offset,
                    "total_bytes": array.nbytes,
                    "digest": xxhash.xxh3_64_intdigest(piece),
                    "data": piece,
                }
                writer.write_batch(
                    pa.record_batch([[row[f]] for f in TENSOR_SCHEMA.names], TENSOR_SCHEMA)
                )
                offset += len(piece)
                if offset >= array.nbytes:
                    break
    return sink.getvalue().to_pybytes()


class _MemorySource:
    """A stream's bytes; cut after ``cut`` bytes as a dropped connection would be."""

    def __init__(self, stream: bytes, cut: int | None) -> None:
        self._view = memoryview(stream)[: len(stream) if cut is None else cut]
        self._cut = cut is not None and cut < len(stream)
        self._at = 0

    def readinto(self, view: memoryview) -> int:
        n = min(len(view), len(self._view) - self._at)
        if n == 0 and self._cut and len(view):
            raise TransportError(f"stream from memory broke after {self._at} bytes (a cut)")
        view[:n] = self._view[self._at : self._at + n]
        self._at += n
        return n

    def close(self) -> None:
        self._view.release()
