"""How a model root is laid out, as pure rules over file names: which names are weights, shard
indexes, variants, split GGUF parts, hub cache folders, and which model ids they form.

Every source applies these same rules: the local catalog to a directory it walks
(service/sources/local/catalog.py), the origin catalog to an origin's listing (service/sources/origin/catalog.py),
the node cache and the origins to the files of one model. README.md ("Model layouts") states
them for users.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Generic, TypeVar

from weightserve.client.errors import InvalidRequest
from weightserve.client.wire.routes import RESERVED_PART, REVISION_SEPARATOR, VARIANT_SEPARATOR

SAFETENSORS_SUFFIXES = (".safetensors",)
PYTORCH_SUFFIXES = (".bin", ".pt", ".pth")
GGUF_SUFFIXES = (".gguf",)
WEIGHT_SUFFIXES = SAFETENSORS_SUFFIXES + PYTORCH_SUFFIXES
CHECKPOINT_SUFFIXES = WEIGHT_SUFFIXES + GGUF_SUFFIXES
# A shard index, plain or of a variant: model.safetensors.index.json,
# diffusion_pytorch_model.safetensors.index.fp16.json, pytorch_model.bin.index.json.
INDEX_NAME = re.compile(
    r"[^.]+\.(?P<suffix>safetensors|bin|pt|pth)\.index(?:\.(?P<variant>[A-Za-z0-9_]+))?\.json"
)
# A weight file of a variant, as transformers and diffusers name them: model.fp16.safetensors,
# model.fp16-00001-of-00002.safetensors, pytorch_model.fp16.bin. One dot-free stem, so
# llama-3.1-8b.safetensors is no variant.
WEIGHT_NAME = re.compile(
    r"[^.]+\.(?P<variant>[A-Za-z0-9_]+)(?:-\d+-of-\d+)?\.(?:safetensors|bin|pt|pth)"
)
# llama.cpp's split GGUF parts (gguf.GGUFWriter with split_max_*, gguf-split).
SPLIT_GGUF_NAME = re.compile(r"(?P<name>.+)-(?P<number>\d{5})-of-(?P<count>\d{5})\.gguf")
SPLIT_GGUF_FORMAT = "{}-{:05d}-of-{:05d}.gguf"
# Trainer artifacts beside the weights, never a weight set of their own.
TRAINER_FILES = frozenset({"training_args.bin", "optimizer.pt", "scheduler.pt", "scaler.pt"})
# Hub cache ref names served as ORG/NAME@REF; refs with a '/' (pr/1) are reachable by commit.
REF_NAME = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]*")
HUB_REPO_DIR = re.compile(r"(?P<type>models|datasets|spaces)--(?P<id>.+)")
# ID@REVISION names a revision (a hub cache's snapshots and refs among them), ID:VARIANT
# another weight set of a directory (client/wire/routes.py). Both characters are refused in
# the names that form ids (and '-' as a whole path part, for the routes), so no directory can
# be mistaken for a revision or a variant.
ID_SEPARATORS = (REVISION_SEPARATOR, VARIANT_SEPARATOR)
RESERVED_DIRECTORY = (
    f"a directory named {RESERVED_PART!r} is not served: that name is reserved in URLs "
    f"(/v1/models/ID/{RESERVED_PART}/stream); rename it"
)
RESERVED_CHARACTER = (
    f"not served: {REVISION_SEPARATOR!r} and {VARIANT_SEPARATOR!r} are reserved in model ids "
    f"(ORG/NAME{REVISION_SEPARATOR}REVISION, ID{VARIANT_SEPARATOR}VARIANT) and control "
    "characters (a newline) are not allowed in them; rename it"
)

T = TypeVar("T")
WeightSetKey = tuple[str, str]  # (format, variant): ("safetensors", ""), ("pytorch", "fp16")


def _suffix(name: str) -> str:
    return PurePosixPath(name).suffix


def weight_format(name: str) -> str | None:
    """``safetensors`` or ``pytorch`` for a file of a weight set's formats, else None."""
    suffix = _suffix(name)
    if suffix in SAFETENSORS_SUFFIXES:
        return "safetensors"
    return "pytorch" if suffix in PYTORCH_SUFFIXES else None


def checkpoint_format(name: str) -> str | None:
    """The format a checkpoint file's name says (``gguf`` too), or None for any other file."""
    return "gguf" if _suffix(name) in GGUF_SUFFIXES else weight_format(name)


def is_weight_file(name: str) -> bool:
    """A safetensors or PyTorch file that holds weights, not a trainer's state beside them."""
    base = PurePosixPath(name).name
    return (
        weight_format(base) is not None
        and base not in TRAINER_FILES
        and not base.startswith("rng_state")
    )


def variant_name(fmt: str, variant: str) -> str:
    """How ``ID:VARIANT`` names a weight set: ``fp16`` (safetensors), ``pytorch`` or
    ``pytorch.fp16``."""
    return ".".join(p for p in ("pytorch" if fmt == "pytorch" else "", variant) if p)


def base_model_id(model_id: str) -> str:
    """The directory model of an id: ``org/name:fp16`` and ``org/name`` are both
    ``org/name``."""
    return model_id.split(VARIANT_SEPARATOR, 1)[0]


def has_reserved_character(name: str) -> bool:
    """Whether a name that forms (part of) a model id holds an id separator or a control
    character (a newline, NUL), which no route or log line carries faithfully: such a name
    is never served, and never taken for publishing."""
    return any(c in name for c in ID_SEPARATORS) or any(ord(c) < 0x20 or c == "\x7f" for c in name)


def hub_repo_id(directory_name: str) -> str | None:
    """``ORG/NAME`` of a hub cache folder (``models--ORG--NAME``, as huggingface_hub's
    ``repo_folder_name`` writes it), or None for any other name."""
    match = HUB_REPO_DIR.fullmatch(directory_name)
    if match is None:
        return None
    parts = match["id"].split("--")
    if any(p in ("", ".", "..", RESERVED_PART) or has_reserved_character(p) for p in parts):
        return None
    return "/".join(parts)


@dataclass(frozen=True)
class HubRepoFile:
    """Where a '/'-separated name lies in a hub cache repository (``[DIR/]models--ORG--NAME/
    REST``): the repository's folder, the model id it is served as (``[DIR/]ORG/NAME``, as
    the local catalog names it), and the name inside the repository."""

    folder: str
    model_id: str
    rest: str


def hub_repo_file(name: str) -> HubRepoFile | None:
    """The hub cache repository ``name`` lies in (the nearest ``models--`` folder), or None."""
    parts = name.split("/")
    for depth in range(len(parts) - 2, -1, -1):
        repo = hub_repo_id(parts[depth])
        if repo is not None and parts[depth].startswith("models--"):
            prefix = "/".join(parts[:depth])
            return HubRepoFile(
                "/".join(parts[: depth + 1]),
                f"{prefix}/{repo}" if prefix else repo,
                "/".join(parts[depth + 1 :]),
            )
    return None


def is_served_name(name: str) -> bool:
    """Whether a '/'-separated file name can be served: not hidden, and no folder on its way
    named the reserved path part or holding an id separator (a walked root skips or refuses
    those)."""
    parts = name.split("/")
    return not any(
        part.startswith(".") or part == RESERVED_PART or has_reserved_character(part)
        for part in parts[:-1]
    ) and not parts[-1].startswith(".")


def validate_model_id(model_id: str) -> str:
    """Refuse ids that could name something outside the root."""
    if not model_id or model_id.startswith("/") or "\\" in model_id or "\0" in model_id:
        raise InvalidRequest(f"invalid model id {model_id!r}")
    if any(part in ("", ".", "..") for part in model_id.split("/")):
        raise InvalidRequest(f"invalid model id {model_id!r}: empty, '.' or '..' path parts")
    if RESERVED_PART in model_id.split("/"):
        raise InvalidRequest(
            f"invalid model id {model_id!r}: the path part {RESERVED_PART!r} is reserved for "
            f"the routes below a model (/v1/models/ID/{RESERVED_PART}/stream, "
            f"/v1/models/ID/{RESERVED_PART}/tensors/NAME)"
        )
    return model_id


# ------------------------------------------------------------------------------ split GGUF


def split_gguf_model(name: str) -> str | None:
    """``NAME.gguf`` for a split GGUF part ``NAME-00001-of-00003.gguf`` (folders kept), or
    None for any other name."""
    directory, _, base = name.rpartition("/")
    part = SPLIT_GGUF_NAME.fullmatch(base)
    if part is None:
        return None
    return f"{directory}/{part['name']}.gguf" if directory else f"{part['name']}.gguf"


@dataclass
class SplitGGUF(Generic[T]):
    """The parts of one split GGUF found beside each other: a model, ``NAME.gguf``, served
    only whole."""

    model: str  # NAME.gguf, with the folders of the names it was found by
    count: int  # the parts its names say it has
    parts: dict[int, T] = field(default_factory=dict)  # by part number, from 1

    @property
    def missing(self) -> list[int]:
        return [n for n in range(1, self.count + 1) if n not in self.parts]

    @property
    def whole(self) -> bool:
        return self.count > 0 and not self.missing

    def ordered(self) -> list[T]:
        return [self.parts[n] for n in sorted(self.parts)]

    def refusal(self, where: str = "") -> str:
        """Why a split GGUF that is not whole is not served; ``where`` tells where its parts
        were looked for (`` at the origin``)."""
        missing = self.missing
        stem = PurePosixPath(self.model).name.removesuffix(".gguf")
        shown = ", ".join(SPLIT_GGUF_FORMAT.format(stem, n, self.count) for n in missing[:3])
        return (
            f"split GGUF {self.model} has {len(self.parts)} of its {self.count} parts{where}; "
            f"missing {shown}{' ...' if len(missing) > 3 else ''} (a split model is served "
            "only whole)"
        )


def gguf_models(files: Iterable[tuple[str, T]]) -> tuple[list[tuple[str, T]], list[SplitGGUF[T]]]:
    """The GGUF files among ``files`` ('/'-separated names, each with what the caller keeps
    for it): every plain ``*.gguf`` is a model of its own, and the parts of each split GGUF
    (``NAME-00001-of-00003.gguf`` ...) are grouped by the model they form."""
    plain: list[tuple[str, T]] = []
    splits: dict[tuple[str, int], SplitGGUF[T]] = {}
    for name, item in files:
        if _suffix(name) not in GGUF_SUFFIXES:
            continue
        model = split_gguf_model(name)
        if model is None:
            plain.append((name, item))
            continue
        part = SPLIT_GGUF_NAME.fullmatch(name.rpartition("/")[2])
        assert part is not None  # split_gguf_model matched it
        count = int(part["count"])
        split = splits.setdefault((model, count), SplitGGUF(model, count))
        split.parts[int(part["number"])] = item
    return plain, list(splits.values())


# ----------------------------------------------------------------------------- weight sets


@dataclass
class WeightSets:
    """A directory's weight sets: which files form each, which set is the default (``ID``),
    and the sets refused (``ID:VARIANT``, or ``ID`` for the default)."""

    chosen: dict[WeightSetKey, list[str]]
    default: WeightSetKey | None
    refused: dict[WeightSetKey, tuple[str, str]]  # key -> (index file name, reason)

    def suffix(self, key: WeightSetKey) -> str:
        """What a set adds to the directory's id: '' for the default, else ``:VARIANT``."""
        return "" if key == self.default else VARIANT_SEPARATOR + variant_name(*key)


def weight_sets(names: list[str], shard_names: Callable[[str], set[str] | None]) -> WeightSets:
    """A directory's weight sets from the names of its files (sorted), ``shard_names`` giving
    the file names a shard index names (None: not a readable index).

    A set is the format's files of one variant (``model.fp16.safetensors``,
    ``model.fp16-00001-of-00002.safetensors``: variant ``fp16``; '' for none) with its
    shard index (``model.safetensors.index.json``, ``model.safetensors.index.fp16.json``).
    With an index, the index decides: files it does not name are not weights (a leftover
    ``consolidated.safetensors``), and a file it names that is missing refuses the set.
    The default is the plain safetensors set, else the plain PyTorch set, else the only
    set there is.
    """
    sets: dict[WeightSetKey, list[str]] = {}
    indexes: dict[WeightSetKey, list[str]] = {}
    for name in names:
        index = INDEX_NAME.fullmatch(name)
        fmt = weight_format(name)
        if index is not None:
            key = ("safetensors" if index["suffix"] == "safetensors" else "pytorch",
                   index["variant"] or "")  # fmt: skip
            indexes.setdefault(key, []).append(name)
        elif fmt is not None and is_weight_file(name):
            weight = WEIGHT_NAME.fullmatch(name)
            sets.setdefault((fmt, (weight and weight["variant"]) or ""), []).append(name)
    chosen: dict[WeightSetKey, list[str]] = {}
    refused: dict[WeightSetKey, tuple[str, str]] = {}
    for key in sorted(sets.keys() | indexes.keys()):
        weights, key_indexes = sets.get(key, []), indexes.get(key, [])
        if len(key_indexes) == 1:
            named = shard_names(key_indexes[0])
            if named is not None:
                same_format = {n for n in names if weight_format(n) == key[0]}
                missing = sorted(named - same_format)
                if missing:
                    refused[key] = (
                        key_indexes[0],
                        f"{key_indexes[0]} names {', '.join(missing[:3])}"
                        f"{' ...' if len(missing) > 3 else ''}, not in the directory "
                        "(an incomplete copy? a model is served only whole)",
                    )
                    continue
                weights = sorted(named)
        if weights:
            chosen[key] = weights + key_indexes
    candidates = chosen.keys() | refused.keys()
    default = next(
        (k for k in (("safetensors", ""), ("pytorch", "")) if k in candidates),
        next(iter(candidates)) if len(candidates) == 1 else None,
    )
    return WeightSets(chosen, default, refused)
