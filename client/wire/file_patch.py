"""A safetensors file patched in place of a fetch, the one patcher both the client's
``pull --since`` and a node cache's fill use: a file's tensor layout from its header, the new
file started from the held one (its data copied in the kernel), and the delta stream's updates
(client/wire/delta.py) written into its tensors' bytes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from weightserve.client.wire.delta import PATCH, WHOLE, DeltaHeader, TensorUpdate, apply_patch
from weightserve.client.wire.delta_plan import header_line

SAFETENSORS_SUFFIX = ".safetensors"
# A header larger than this is no header a writer makes: the file is fetched whole instead.
MAX_HEADER_BYTES = 100 << 20
_COPY_BLOCK = 64 << 20

# name -> (dtype code, shape, begin, end), the offsets relative to the data's start
TensorLayout = dict[str, tuple[str, tuple[int, ...], int, int]]


@dataclass(frozen=True)
class SafetensorsLayout:
    """A safetensors file's header bytes (length prefix included) and its tensors' places."""

    header: bytes
    tensors: TensorLayout

    @property
    def data_start(self) -> int:
        return len(self.header)


def parse_safetensors_header(raw: bytes) -> SafetensorsLayout | None:
    """The layout a safetensors header (length prefix included) describes, or None when it is
    not one."""
    if len(raw) < 8 or len(raw) != 8 + int.from_bytes(raw[:8], "little"):
        return None
    try:
        found = json.loads(raw[8:])
    except ValueError:
        return None
    if not isinstance(found, dict):
        return None
    tensors: TensorLayout = {}
    for name, info in found.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            tensors[name] = (str(info["dtype"]), tuple(int(x) for x in info["shape"]), begin, end)
        except (KeyError, TypeError, ValueError):
            return None
    return SafetensorsLayout(raw, tensors)


def local_layout(path: Path) -> SafetensorsLayout | None:
    """The layout of the safetensors file at ``path``, or None when it is not one."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if not 0 <= length <= min(MAX_HEADER_BYTES, path.stat().st_size - 8):
                return None
            return parse_safetensors_header(prefix + f.read(length))
    except OSError:
        return None


def header_length(prefix: bytes, file_size: int) -> int | None:
    """The header's length from a file's first 8 bytes, None where no writer makes it."""
    if len(prefix) != 8:
        return None
    length = int.from_bytes(prefix, "little")
    return length if length <= min(MAX_HEADER_BYTES, file_size - 8) else None


def patchable(
    local: SafetensorsLayout, local_size: int, remote: SafetensorsLayout, remote_size: int
) -> bool:
    """Whether the new file has the local one's tensors at the same places (only the header
    and tensor bytes may differ), so it can be built from it."""
    return (
        remote.tensors == local.tensors
        and remote_size - remote.data_start == local_size - local.data_start
    )


def apply_update(view: np.ndarray, update: TensorUpdate) -> bool:
    """Write one tensor's update into ``view``, its bytes in the file (writable uint8); False
    when the update is not of this tensor's size (the file's digest then says so)."""
    header = update.header
    if header.nbytes != view.size:
        return False
    if update.kind == WHOLE:
        assert update.data is not None
        view[:] = np.frombuffer(update.data, dtype=np.uint8)
    elif update.kind == PATCH:
        assert update.positions is not None and update.values is not None
        apply_patch(view, header, update.positions, update.values)
    return True


def open_patched_copy(
    held: Path, partial: Path, local: SafetensorsLayout, remote: SafetensorsLayout, size: int
) -> tuple[mmap.mmap | None, dict[str, np.ndarray]]:
    """Start ``partial`` (``size`` bytes) from the ``held`` file: the new header, then the
    held data copied without reading it through this process. Its writable mapping (None for
    an empty file; ``close_mapping`` it) and each tensor's bytes in it, by name."""
    with open(held, "rb") as src, open(partial, "w+b") as dst:
        dst.truncate(size)
        dst.write(remote.header)
        dst.flush()
        count = size - remote.data_start
        copy_range(src.fileno(), dst.fileno(), local.data_start, remote.data_start, count)
        mapping = mmap.mmap(dst.fileno(), size) if size else None
    if mapping is None:
        return None, {}
    data = np.frombuffer(mapping, dtype=np.uint8)
    start = remote.data_start
    views = {
        name: data[start + begin : start + end]
        for name, (_, _, begin, end) in remote.tensors.items()
    }
    return mapping, views


# Where a tensor's update goes: per name, each file's set of tensors applied and its bytes.
Places = dict[str, list[tuple[set[str], np.ndarray]]]


def apply_to_files(
    updates: Iterable[TensorUpdate], places: Places, received: Callable[[int], None]
) -> None:
    """Write each update into every place of its tensor, noting it applied there (an update
    of another size is not this tensor's: the file's digest then says so); ``received`` is
    told what each tensor's update took on the wire."""
    for update in updates:
        received(update_line_bytes(update.header) + update.wire_bytes)
        for applied, view in places.get(update.name, ()):
            if apply_update(view, update):
                applied.add(update.name)


@dataclass
class PatchedCopy:
    """One new file being built from the ``held`` one at ``partial`` (``size`` bytes): both
    layouts, its mapping while open, the tensors whose updates were applied to it."""

    held: Path
    partial: Path
    size: int
    local: SafetensorsLayout
    remote: SafetensorsLayout
    mapping: mmap.mmap | None = None
    applied: set[str] = field(default_factory=set)

    def open_into(self, places: Places) -> None:
        """Start the copy (``open_patched_copy``) and add its tensors' places to ``places``."""
        self.mapping, views = open_patched_copy(
            self.held, self.partial, self.local, self.remote, self.size
        )
        for name, view in views.items():
            places.setdefault(name, []).append((self.applied, view))

    @property
    def complete(self) -> bool:
        """Whether every tensor of the new file got its update."""
        return self.applied >= set(self.remote.tensors)

    def close(self) -> None:
        close_mapping(self.mapping)
        self.mapping = None

    def discard(self) -> None:
        self.close()
        self.partial.unlink(missing_ok=True)


def patched_copy(
    held: Path, partial: Path, size: int, read_range: Callable[[int, int], bytes]
) -> PatchedCopy | None:
    """The copy to build when the ``held`` file is a safetensors file with the new file's
    tensor layout (the new file: ``size`` bytes, read with ``read_range(offset, length)``,
    of which only its header is read here); None when it must be fetched whole."""
    if not held.name.endswith(SAFETENSORS_SUFFIX) or size < 8:
        return None
    local = local_layout(held)
    if local is None:
        return None
    prefix = read_range(0, 8)
    length = header_length(prefix, size)
    if length is None:
        return None
    remote = parse_safetensors_header(prefix + read_range(8, length))
    if remote is None or not patchable(local, held.stat().st_size, remote, size):
        return None
    return PatchedCopy(held, partial, size, local, remote)


def update_line_bytes(header: DeltaHeader) -> int:
    """What a tensor's header line took on the wire (its newline included)."""
    return len(header_line(header))


def close_mapping(mapping: mmap.mmap | None) -> None:
    """Flush and close a file's mapping written through views of it."""
    if mapping is not None:
        mapping.flush()
        with contextlib.suppress(BufferError):  # views may still be alive: closed when they go
            mapping.close()


class SourceEnded(OSError):
    """The source of a copy ended before the range it was to give."""


def copy_range(src: int, dst: int, src_offset: int, dst_offset: int, count: int) -> None:
    """``count`` bytes from ``src`` at ``src_offset`` to ``dst`` at ``dst_offset``: in the
    kernel (a reflink where the file system shares blocks), else through a buffer."""
    done = 0
    while done < count:
        try:
            n = os.copy_file_range(
                src, dst, min(_COPY_BLOCK, count - done), src_offset + done, dst_offset + done
            )
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            break
        if n == 0:
            break
        done += n
    while done < count:
        block = os.pread(src, min(_COPY_BLOCK, count - done), src_offset + done)
        if not block:
            raise SourceEnded(errno.EIO, f"the source file ended {count - done} bytes early")
        os.pwrite(dst, block, dst_offset + done)
        done += len(block)
