"""Discovery: the models of a root directory found by the layout rules
(service/sources/layout.py) from names and directories alone; the catalog (catalog.py)
indexes what is found.

How a root is laid out: the model id is the path relative to the root, so ``org/name`` works.
These are the rules; README.md ("Model layouts") states them for users.

- A directory below the root holding weights is one model. Its weights form sets by format
  and variant (``model.fp16.safetensors``: variant ``fp16``; ``layout.weight_sets``); ``DIR``
  serves the default set (plain safetensors, else plain PyTorch, else the only set), every
  other set is ``DIR:VARIANT`` (``:fp16``, ``:pytorch``, ``:pytorch.fp16``), indexed on first
  request.
- A shard index (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``, a
  variant's ``model.safetensors.index.fp16.json``) decides which files form its set: files it
  does not name (Mistral's ``consolidated.safetensors``) are side files, not weights; a named
  file that is missing refuses the model.
- Every ``*.gguf`` file is a model; the parts of a split GGUF (``NAME-00001-of-00003.gguf``)
  are one model ``NAME.gguf``, served only whole. A checkpoint file directly in the root is a
  model of its own, its id the file name.
- The Hugging Face hub cache: ``models--ORG--NAME`` is ``ORG/NAME``, the snapshot ``refs/main``
  names (without refs, the only one); every snapshot is ``ORG/NAME@COMMIT`` and every other
  ref ``ORG/NAME@REF``. The snapshot's links into the cache's ``blobs/`` stay inside the root.
- A symlinked directory inside the root is an alias (its own ids, the same files); ids naming
  the same files share one Model index and one mapping per file.

Paths never leave the root: symlinks that resolve outside it are skipped and reported, and a
model directory with a shard (or shard index) that leaves the root is refused as a whole rather
than served in part. ``-`` as a path part, and ``@`` and ``:`` in names that form ids, are
reserved (routes, revisions, variants): such names are reported, never served, so no plain
directory's id can be read as a revision or a variant.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from weightserve.client.wire.routes import RESERVED_PART
from weightserve.service.sources.base import Problem
from weightserve.service.sources.layout import (
    CHECKPOINT_SUFFIXES,
    GGUF_SUFFIXES,
    INDEX_NAME,
    REF_NAME,
    RESERVED_CHARACTER,
    RESERVED_DIRECTORY,
    REVISION_SEPARATOR,
    WEIGHT_SUFFIXES,
    gguf_models,
    has_reserved_character,
    hub_repo_id,
    weight_format,
    weight_sets,
)

log = logging.getLogger("weightserve.catalog")

MAX_INDEX_BYTES = 64 << 20
OUTSIDE_ROOT = "symlink points outside the model root"
# Side files larger than this are not served (weights and their leftovers are exempt): they
# are configs, tokenizers and templates, not bulk data.
SIDE_FILE_MAX_BYTES = 256 << 20


@dataclass(frozen=True)
class _Walk:
    """Where one discovery stands: the models found so far (shared by the whole walk) and the
    directories walked down to the current one (a symlink back to one of them is a loop)."""

    found: dict[str, tuple[str, Path, list[Path]]]
    visiting: tuple[Path, ...]

    def into(self, directory: Path) -> _Walk:
        return _Walk(self.found, (*self.visiting, directory))


class Discovery:
    """The models under ``root`` from its directory layout alone (the rules in the module
    docstring), without reading a checkpoint: ``discover`` answers the models served at once,
    and leaves the directories' other weight sets in ``variants`` and the refusals found on
    the way in ``problems``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.variants: dict[str, tuple[str, Path, list[Path]]] = {}
        self.problems: dict[str, Problem] = {}
        self._found_variants: dict[str, tuple[str, Path, list[Path]]] = {}

    def _inside_root(self, path: Path) -> bool:
        try:
            path.resolve().relative_to(self.root)
            return True
        except ValueError:
            return False

    def discover(self) -> dict[str, tuple[str, Path, list[Path]]]:
        """model id -> (format, path, files), from the directory layout alone: the models
        served at once. A directory's other weight sets go to ``self.variants`` (served on
        request); refusals found on the way go to ``self.problems``."""
        found: dict[str, tuple[str, Path, list[Path]]] = {}
        self.problems = {}
        self._found_variants = {}
        hub_repo = hub_repo_id(self.root.name)
        if hub_repo is not None and (self.root / "snapshots").is_dir():
            self._discover_hub_repo(self.root, hub_repo, _Walk(found, (self.root,)))
        else:
            self._discover_tree(self.root, "", _Walk(found, (self.root,)))
        self.variants = self._found_variants
        return found

    def _refuse(self, key: str, file: str, reason: str) -> None:
        self.problems.setdefault(key, Problem(key, file, reason))

    def _add(
        self,
        found: dict[str, tuple[str, Path, list[Path]]],
        model_id: str,
        entry: tuple[str, Path, list[Path]],
    ) -> None:
        """One id, one model: a second layout giving a taken id is refused, named by its path."""
        taken = found.get(model_id, self._found_variants.get(model_id))
        if taken is None:
            found[model_id] = entry
        elif taken != entry:
            where = self.relative(str(entry[1]))
            self._refuse(
                where,
                where,
                f"its model id {model_id!r} is taken by {self.relative(str(taken[1]))}; "
                "rename one of them",
            )

    def _discover_tree(self, directory: Path, id_prefix: str, walk: _Walk) -> None:
        """The models in ``directory`` (a real directory inside the root) and below it;
        ``id_prefix`` is its id ('' for the root)."""
        found = walk.found
        at_root = id_prefix == ""
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError as e:
            log.info("%s not searched: %s", directory, e)
            return
        files: list[Path] = []
        escaped_shard = None
        for entry in entries:
            name = entry.name
            if name.startswith("."):
                continue
            p = directory / name
            rel = f"{id_prefix}/{name}" if id_prefix else name
            is_link = entry.is_symlink()
            if is_link and not self._inside_root(p):
                if p.is_dir() or at_root or p.suffix in GGUF_SUFFIXES:  # a model of its own
                    self._refuse(rel, rel, OUTSIDE_ROOT)
                elif p.suffix in WEIGHT_SUFFIXES or INDEX_NAME.fullmatch(name):
                    escaped_shard = escaped_shard or rel  # never serve a model in part
                continue
            try:
                is_dir = p.is_dir()
            except OSError:
                continue
            if not is_dir:
                if p.is_file():
                    files.append(p)
                continue
            if name == RESERVED_PART:  # no model id may have this part (validate_model_id)
                self._refuse(rel, rel, RESERVED_DIRECTORY)
                continue
            if has_reserved_character(name):
                self._refuse(rel, rel, RESERVED_CHARACTER)
                continue
            real = p.resolve() if is_link else p
            if real in walk.visiting:
                self._refuse(rel, rel, "symlink loop: it points to a directory above it")
                continue
            hub_repo = hub_repo_id(name)
            if hub_repo is not None and (real / "snapshots").is_dir():
                if name.startswith("models--"):  # datasets and spaces hold no models
                    repo_id = rel if is_link else f"{id_prefix}/{hub_repo}".lstrip("/")
                    self._discover_hub_repo(real, repo_id, walk.into(real))
                continue
            # A symlinked directory inside the root is an alias: its own ids, same content.
            self._discover_tree(real, rel, walk.into(real))

        self._discover_gguf(files, id_prefix, found)
        if at_root:
            for f in files:
                fmt = weight_format(f.name)
                if fmt is None:
                    continue
                if has_reserved_character(f.name):
                    self._refuse(f.name, f.name, RESERVED_CHARACTER)
                else:
                    self._add(found, f.name, (fmt, f, [f]))
            return
        if escaped_shard is not None:
            self._refuse(id_prefix, escaped_shard, OUTSIDE_ROOT)
            return
        by_name = {f.name: f for f in files}
        sets = weight_sets(list(by_name), lambda index: self._index_shard_names(by_name[index]))
        for key, (index, reason) in sets.refused.items():
            self._refuse(id_prefix + sets.suffix(key), self.relative(str(by_name[index])), reason)
        for key, names in sets.chosen.items():
            weights = (key[0], directory, [by_name[n] for n in names])
            if key == sets.default:
                self._add(found, id_prefix, weights)
            else:
                self._add(self._found_variants, id_prefix + sets.suffix(key), weights)

    def _discover_gguf(
        self, files: list[Path], id_prefix: str, found: dict[str, tuple[str, Path, list[Path]]]
    ) -> None:
        """Every ``.gguf`` file is a model; the parts of a split GGUF (``NAME-00001-of-00003.gguf``
        ...) are one model, ``NAME.gguf``, served only when every part is there."""
        plain, splits = gguf_models((f.name, f) for f in files)
        for name, f in plain:
            self._add_file_model(found, id_prefix, name, ("gguf", f, [f]))
        for split in splits:
            if not split.whole:
                self._refuse(
                    f"{id_prefix}/{split.model}".lstrip("/"),
                    self.relative(str(next(iter(split.parts.values())))),
                    split.refusal(),
                )
                continue
            ordered = split.ordered()
            self._add_file_model(found, id_prefix, split.model, ("gguf", ordered[0], ordered))

    def _add_file_model(
        self,
        found: dict[str, tuple[str, Path, list[Path]]],
        id_prefix: str,
        name: str,
        entry: tuple[str, Path, list[Path]],
    ) -> None:
        model_id = f"{id_prefix}/{name}".lstrip("/")
        if has_reserved_character(name):
            self._refuse(model_id, self.relative(str(entry[1])), RESERVED_CHARACTER)
        else:
            self._add(found, model_id, entry)

    def _index_shard_names(self, index: Path) -> set[str] | None:
        """The file names an index's ``weight_map`` names, or None when it is not a readable
        index (then the reader refuses it with the rule it breaks)."""
        try:
            if index.stat().st_size > MAX_INDEX_BYTES:
                return None
            weight_map = json.loads(index.read_bytes()).get("weight_map")
        except (OSError, ValueError, AttributeError, RecursionError):
            return None
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) and v == Path(v).name and v not in ("", ".", "..")
            for v in weight_map.values()
        ):
            return None
        return set(weight_map.values())

    def _discover_hub_repo(self, repo_dir: Path, repo_id: str, walk: _Walk) -> None:
        """A repository of the Hugging Face hub cache (``models--ORG--NAME``): ``ORG/NAME`` is
        the snapshot ``refs/main`` names (without refs, the only snapshot), ``ORG/NAME@REV``
        every snapshot by its commit and every other ref by its name."""
        refs_dir = repo_dir / "refs"
        refs: dict[str, str] = {}
        try:
            snapshots = {
                d.name: d.resolve()
                for d in sorted((repo_dir / "snapshots").iterdir())
                if not d.name.startswith(".") and d.is_dir() and self._inside_root(d)
            }
            for ref in sorted(refs_dir.rglob("*")) if refs_dir.is_dir() else []:
                name = ref.relative_to(refs_dir).as_posix()
                if ref.is_file() and REF_NAME.fullmatch(name) and ref.stat().st_size <= 256:
                    refs[name] = ref.read_text(errors="replace").strip()
        except OSError as e:
            self._refuse(repo_id, self.relative(str(repo_dir)), self.relative(str(e)))
            return
        main = refs.get("main")
        if main is not None and main not in snapshots:
            self._refuse(
                repo_id,
                self.relative(str(refs_dir / "main")),
                f"refs/main names commit {main[:40]!r}, which has no snapshot (an interrupted "
                "download?); download it again",
            )
            main = None
        elif main is None and "main" not in refs and len(snapshots) == 1:
            main = next(iter(snapshots))
        ids = {} if main is None else {repo_id: main}
        ids.update({f"{repo_id}{REVISION_SEPARATOR}{c}": c for c in snapshots})
        ids.update(
            {
                f"{repo_id}{REVISION_SEPARATOR}{ref}": commit
                for ref, commit in refs.items()
                if ref != "main" and commit in snapshots
            }
        )
        for model_id, commit in ids.items():
            snapshot = snapshots[commit]
            if snapshot not in walk.visiting:
                self._discover_tree(snapshot, model_id, walk.into(snapshot))

    def side_files(self, path: Path, files: list[Path], model_dirs: set[Path]) -> list[Path]:
        """The other files of a directory model's repository: every regular file below it
        that stays inside the root, not hidden, not below another model's directory, and
        (unless a checkpoint) at most ``SIDE_FILE_MAX_BYTES``. A file model has none."""
        if not path.is_dir():
            return []
        weights = set(files)
        found: list[Path] = []
        # The walk enters no symlinked directory, so below a directory inside the root only a
        # symlinked file can lead out: that one is resolved, the others cost one stat each.
        inside = self._inside_root(path)
        for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
            directory = Path(dirpath)
            dirnames[:] = sorted(
                d
                for d in dirnames
                if not d.startswith(".") and (directory / d) not in model_dirs
                and not (directory / d).is_symlink()
            )  # fmt: skip
            for name in sorted(filenames):
                f = directory / name
                if name.startswith(".") or f in weights:
                    continue
                try:
                    if (os.path.islink(f) or not inside) and not self._inside_root(f):
                        continue
                    size = f.stat()
                    if not stat.S_ISREG(size.st_mode):
                        continue
                    checkpoint = f.suffix in CHECKPOINT_SUFFIXES
                    if not checkpoint and size.st_size > SIDE_FILE_MAX_BYTES:
                        log.info("%s not served: larger than %d bytes", f, SIDE_FILE_MAX_BYTES)
                        continue
                except OSError:
                    continue
                found.append(f)
        return found

    def relative(self, text: str) -> str:
        """Problems go to clients: name files relative to the root, never by server paths."""
        return text.replace(f"{self.root}{os.sep}", "").replace(str(self.root), ".")
