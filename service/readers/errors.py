"""One named error per rule of each checkpoint format.

Each is a ``CheckpointError`` (HTTP 422 / gRPC FAILED_PRECONDITION) whose message names the
file, the tensor if any, the rule and the offending values. Raising one never stops the
catalog: the model is reported and skipped, the others are served.
"""

from __future__ import annotations

from weightserve.client.errors import CheckpointError


class BadMagic(CheckpointError):
    rule = "not a file of this format (bad magic)"


class UnsupportedVersion(CheckpointError):
    rule = "unsupported format version"


class HeaderTooLarge(CheckpointError):
    rule = "header larger than the limit"


class MalformedHeader(CheckpointError):
    rule = "malformed header"


class TruncatedFile(CheckpointError):
    rule = "file ends inside its header"


class UnknownDType(CheckpointError):
    rule = "unknown dtype or tensor type"


class CountOverflow(CheckpointError):
    rule = "count or size overflows"


class SizeMismatch(CheckpointError):
    rule = "byte size differs from shape x itemsize"


class OffsetOutOfFile(CheckpointError):
    rule = "tensor data lies outside the file"


class OverlappingTensors(CheckpointError):
    rule = "tensors overlap"


class GapBetweenTensors(CheckpointError):
    rule = "hole between tensors"


class MisalignedTensor(CheckpointError):
    rule = "tensor offset not aligned"


class DuplicateTensor(CheckpointError):
    rule = "tensor name appears twice"


class IndexMismatch(CheckpointError):
    rule = "shard index disagrees with the shards"


class SplitMismatch(CheckpointError):
    rule = "split GGUF parts disagree"


class ForbiddenPickleGlobal(CheckpointError):
    rule = "pickle asks for a forbidden global"


class MalformedPickle(CheckpointError):
    rule = "malformed or unsupported pickle"


class CompressedStorage(CheckpointError):
    rule = "tensor storage is compressed in the archive"
