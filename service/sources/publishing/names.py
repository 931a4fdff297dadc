"""The names a publish may use: its model id (one hub cache folder, ``models--ORG--NAME``) and
its files' names. Each is checked before anything is created on disk, by the rules the
catalog serves names by (service/sources/layout.py), so a publish never writes what would
not be served, and a name the file system cannot hold is a 400 naming it, never a 500."""

from __future__ import annotations

import os
from collections.abc import Iterable

from weightserve.client.errors import InvalidRequest
from weightserve.client.wire.routes import REVISION_SEPARATOR, VARIANT_SEPARATOR
from weightserve.service.sources.layout import (
    has_reserved_character,
    is_served_name,
    validate_model_id,
)

# The longest name one directory entry may have on Linux and macOS file systems (bytes).
NAME_MAX = 255
# The longest file name (all its folders) a revision may hold: far below the system's path
# limit with the root in front of it, and as deep as any repository's files go.
FILE_NAME_MAX = 1024


def repo_folder(model_id: str) -> str:
    """``models--ORG--NAME`` for ``ORG/NAME`` (any depth), as huggingface_hub names it; an id
    the catalog would not serve from that folder (a part holding ``--``, starting with
    ``.``, holding ``@``, ``:`` or a control character) or one too long for a folder name is
    refused."""
    parts = validate_model_id(model_id).split("/")
    if any("--" in p or p.startswith(".") or has_reserved_character(p) for p in parts):
        raise InvalidRequest(
            f"model id {model_id!r} cannot be published: its parts may not start with '.', "
            f"hold '--', {REVISION_SEPARATOR!r}, {VARIANT_SEPARATOR!r} (reserved: "
            f"ID{REVISION_SEPARATOR}REVISION, ID{VARIANT_SEPARATOR}VARIANT) or a control "
            "character such as a newline"
        )
    folder = "models--" + "--".join(parts)
    if len(os.fsencode(folder)) > NAME_MAX:
        raise InvalidRequest(
            f"model id {model_id[:64]!r}... is too long to publish: its folder "
            f"models--ORG--NAME would take {len(os.fsencode(folder))} bytes, over the file "
            f"system's {NAME_MAX}"
        )
    return folder


def upload_file_name(name: str, taken: Iterable[str]) -> str:
    """``name`` cleaned (no leading or trailing '/'), checked as a file of a revision: served
    (not hidden, no reserved folder), each part a name the file system holds, and neither a
    folder of a file in ``taken`` (the upload's other files, its base's) nor inside one."""
    clean = name.strip("/")
    parts = clean.split("/")
    if not clean or not is_served_name(clean) or any(p in ("", ".", "..") for p in parts):
        raise InvalidRequest(f"file name {name!r} cannot be published (hidden or reserved)")
    if any(ord(c) < 0x20 or c == "\x7f" for c in clean):
        raise InvalidRequest(
            f"file name {name!r} cannot be published: it holds a control character"
        )
    if len(os.fsencode(clean)) > FILE_NAME_MAX:
        raise InvalidRequest(
            f"file name {clean[:64]!r}... cannot be published: it is over {FILE_NAME_MAX} "
            "bytes with its folders"
        )
    if any(len(os.fsencode(p)) > NAME_MAX for p in parts):
        raise InvalidRequest(
            f"file name {clean[:64]!r}... cannot be published: a part of it is over the file "
            f"system's {NAME_MAX} bytes"
        )
    for other in taken:
        if other.startswith(clean + "/") or clean.startswith(other + "/"):
            file, inside = sorted((clean, other), key=len)
            raise InvalidRequest(
                f"file name {clean!r} cannot be published: {file!r} would be both a file and "
                f"the folder of {inside!r}"
            )
    return clean
