"""One publish in progress (``Upload``) and what the publish routes ask of whoever takes
uploads (``Publishing``; service/sources/publishing/publisher.py implements it)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from weightserve.client.errors import InvalidRequest
from weightserve.service.sources.base import RevisionLog
from weightserve.service.sources.files.stamps import FileStamp
from weightserve.service.sources.model import Model

MODEL_PART = "model"  # the incoming model's directory: indexed as a directory model
TENSORS_PART = "tensors"  # the parts of an upload besides its files (files/NAME)
PATCH_PART = "patch"


def file_part(name: str) -> str:
    return f"files/{name}"


def part_label(part: str) -> str:
    """How a message names a part: its file's name, or "the tensors"/"the patch"."""
    return part.removeprefix("files/") if part.startswith("files/") else f"the {part}"


# A revision's record travels whole in every watch event, list and node announcement: its
# metadata is bounded (its JSON), and so is its message.
MAX_METADATA_BYTES = 1 << 20
MAX_MESSAGE_CHARS = 64 << 10


def check_record_size(message: str, metadata: dict[str, Any]) -> None:
    """Refuse a publish whose message or metadata is over its bound, or whose metadata is not
    plain JSON (``NaN`` and ``Infinity`` are not)."""
    if len(message) > MAX_MESSAGE_CHARS:
        raise InvalidRequest(
            f"the message has {len(message)} characters, over the limit of {MAX_MESSAGE_CHARS}"
        )
    try:
        size = len(json.dumps(metadata, allow_nan=False, separators=(",", ":")).encode())
    except (ValueError, RecursionError) as e:
        raise InvalidRequest(f"the metadata is not plain JSON: {e}") from None
    if size > MAX_METADATA_BYTES:
        raise InvalidRequest(
            f"the metadata is {size} bytes as JSON, over the limit of {MAX_METADATA_BYTES} "
            "(1 MiB): keep large data in a file of the revision"
        )


@dataclass
class Upload:
    """One publish in progress: its files land in ``directory`` until it is committed."""

    id: str
    model_id: str
    folder: str  # the repository's folder: models--ORG--NAME
    directory: Path  # the staging directory
    base: Model | None
    message: str
    metadata: dict[str, Any]
    started_main: str | None = None  # main when it began: its commit is refused if main moved
    files: dict[str, int] = field(default_factory=dict)  # name -> bytes received
    tensors: Path | None = None  # the uploaded tensors (a safetensors file), if any
    tensor_bytes: int = 0  # their size (a patch's: the tensors it led to)
    touched: float = field(default_factory=time.monotonic)
    # The parts whose bodies are arriving now (files/NAME, tensors, patch) -> the bytes they
    # take: what their Content-Length reserved, or what arrived, whichever is more.
    receiving: dict[str, int] = field(default_factory=dict)
    sealed: bool = False  # a commit began: no part may start

    @property
    def model_dir(self) -> Path:
        return self.directory / MODEL_PART

    def held_bytes(self) -> int:
        """Every byte the upload holds or has reserved: its files, its tensors and the parts
        arriving now."""
        return sum(self.files.values()) + self.tensor_bytes + sum(self.receiving.values())

    def taken_names(self) -> list[str]:
        """The file names the upload and its base hold or are receiving."""
        arriving = [p.removeprefix("files/") for p in self.receiving if p.startswith("files/")]
        based = list(self.base.repo_files) if self.base is not None else []
        return [*self.files, *arriving, *based]


class Publishing(RevisionLog, Protocol):
    """Uploads received and committed as revisions (the publish routes;
    service/sources/publishing/publisher.py), held against retention on request."""

    max_upload_bytes: int
    body_timeout: float  # seconds a part's body may send nothing before the upload is dropped

    def begin(
        self, model_id: str, base: str | None, message: str, metadata: dict[str, Any]
    ) -> Upload:
        """A new upload of ``model_id``; ``base`` (a revision of it) supplies what it lacks."""
        ...

    def upload(self, model_id: str, upload_id: str) -> Upload:
        """The upload in progress by its id (NotFound when there is none)."""
        ...

    def target(self, upload: Upload, name: str | None) -> Path:
        """Where a file of the upload is written as it arrives."""
        ...

    def start_part(self, upload: Upload, part: str, declared: int | None) -> None:
        """A part's body begins: its ``declared`` bytes reserved, or refused (past
        ``max_upload_bytes``, the upload being committed, the part arriving already)."""
        ...

    def grow_part(self, upload: Upload, part: str, arrived: int) -> None:
        """``arrived`` bytes of the part are in: refused once past ``max_upload_bytes``."""
        ...

    def end_part(self, upload: Upload, part: str) -> None:
        """The part's body ended (whole, cut off or refused)."""
        ...

    def tracked(self, upload: Upload) -> bool:
        """Whether the upload is still in progress (not aborted, expired or committed)."""
        ...

    def seal(self, upload: Upload) -> None:
        """A commit begins: no part may start from now on."""
        ...

    def unseal(self, upload: Upload) -> None:
        """The commit did not happen: parts may start again."""
        ...

    def received(
        self,
        upload: Upload,
        name: str | None,
        path: Path,
        size: int,
        written: tuple[FileStamp, str] | None = None,
    ) -> None:
        """A file of the upload arrived whole at ``path``; ``written``: its identity after
        the last write and the digest of the bytes written (kept for the commit)."""
        ...

    def patch_target(self, upload: Upload) -> Path:
        """Where the upload's patch onto its base is written as it arrives."""
        ...

    def apply_patch(self, upload: Upload, patch: Path) -> None:
        """Apply a received patch onto the upload's base."""
        ...

    def abort(self, upload_id: str, reason: str = "aborted") -> None:
        """Drop the upload and what it wrote."""
        ...

    def commit(self, upload: Upload) -> dict[str, Any]:
        """Check the upload and make it the model's new revision; its record."""
        ...

    def hold(self, model_id: str, commit: str, seconds: float, holder: str) -> dict[str, Any]:
        """``holder``'s hold of a revision against retention, for ``seconds``."""
        ...
