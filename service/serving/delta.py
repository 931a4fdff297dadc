"""Delta updates: what a worker holding revision A needs to hold revision B, per tensor the
cheapest of nothing (same bytes), an element patch (positions and new values) or the whole
tensor; computed once per (A, B) pair and kept for every worker that asks.

An element is the dtype's item (2 bytes for bfloat16, 1 for int8 and for quantized GGUF
blocks, which are patched as bytes). Positions are gaps between changed elements (the
narrowest unsigned integer that holds them), compressed with zstd; values are the changed elements'
new bytes, compressed where that pays. Each entry carries the target tensor's xxh3-128, which
the client checks after applying it. The wire format is docs/protocol.md, "Delta updates".
Patches are kept in memory (least recently used dropped first) and, between revisions
published under a local root, on disk beside them (``KeptDeltas``): a restart diffs nothing
again.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from weightserve.client.errors import InvalidRequest, RevisionNotFound
from weightserve.client.wire.delta import WHOLE
from weightserve.client.wire.delta_plan import DeltaEntry, element_bytes, header_line, plan_delta
from weightserve.client.wire.routes import with_revision
from weightserve.service.readers.base import TensorEntry
from weightserve.service.serving.metrics import Metrics
from weightserve.service.serving.streams import gathered_bytes
from weightserve.service.sources.model import Model
from weightserve.service.sources.revisions.pinning import MIN_PREFIX_CHARS, is_content_name
from weightserve.service.sources.revisions.stores import KeptDeltas, KeptDeltaWriter

log = logging.getLogger("weightserve.delta")

CACHE_BYTES = 1 << 30  # patches kept in memory, least recently used dropped first
# Threads every delta stream diffs on (one per core), and how many tensors of one stream are
# diffed ahead of the one being sent.
DIFF_THREADS = max(2, os.cpu_count() or 1)
DIFF_AHEAD = DIFF_THREADS
LOADED_PAIRS = 8  # kept pair files held mapped and checked, least recently used dropped first
# Where a served entry came from (weightserve_delta_served_total's ``source``).
FROM_MEMORY, FROM_DISK, COMPUTED = "memory", "disk", "computed"


_DIFFS: ThreadPoolExecutor | None = None
_DIFFS_LOCK = threading.Lock()


def _diff_pool() -> ThreadPoolExecutor:
    """The threads every delta stream diffs on: one per core, shared, started on first use."""
    global _DIFFS
    with _DIFFS_LOCK:
        if _DIFFS is None:
            _DIFFS = ThreadPoolExecutor(DIFF_THREADS, thread_name_prefix="weightserve-diff")
        return _DIFFS


def delta_base(resolve: Callable[[str], Model], model_id: str, since: str) -> Model | None:
    """The revision a worker holds (``since``, resolved by ``resolve(ID@since)``), or None for
    content this server does not hold (every tensor then travels whole). ``since`` must name a
    revision: a ref the server holds, or a commit's or revision's hex digits; anything else
    is InvalidRequest, never a silent full download."""
    try:
        return resolve(with_revision(model_id, since))
    except RevisionNotFound:
        if is_content_name(since):
            return None
        raise InvalidRequest(
            f"since={since!r} names no revision of {model_id!r}: give the commit the worker "
            f"holds (40 hex digits, or at least {MIN_PREFIX_CHARS} of them)"
        ) from None
    except InvalidRequest as e:
        raise InvalidRequest(f"since={since!r}: {e}") from None


def tensor_bytes(model: Model, entry: TensorEntry) -> memoryview:
    """The tensor's bytes as served (C-contiguous): a view of its file's mapping, checked to
    be the version the stream holds before it is read, or a strided tensor gathered as the
    tensor streams gather it."""
    if entry.strides is not None:
        return gathered_bytes(model, entry)
    model.mapped(entry.file).ensure_unchanged(entry.offset + entry.nbytes)
    return model.raw_view(entry)


def plan_entry(name: str, target: Model, base: Model | None) -> DeltaEntry:
    """The cheapest way from ``base``'s tensor ``name`` to ``target``'s."""
    entry = target.tensors[name]
    old_entry = base.tensors.get(name) if base is not None else None
    old = None
    if (
        base is not None
        and old_entry is not None
        and (old_entry.dtype, old_entry.shape, old_entry.nbytes, old_entry.encoding)
        == (entry.dtype, entry.shape, entry.nbytes, entry.encoding)
    ):
        old = tensor_bytes(base, old_entry)
    # Quantized blocks are patched as bytes.
    size = 1 if entry.encoding is not None else element_bytes(entry.dtype)
    planned = plan_delta(name, entry.dtype, entry.shape, tensor_bytes(target, entry), old, size)
    # The digest and the patch are of one version of the files: checked after reading them.
    target.mapped(entry.file).ensure_unchanged(entry.offset + entry.nbytes)
    if old_entry is not None and old is not None and base is not None:
        base.mapped(old_entry.file).ensure_unchanged(old_entry.offset + old_entry.nbytes)
    return planned


class DeltaCache:
    """Patches by (base commit, target commit, tensor), computed once for every worker;
    whole tensors are not kept (they are read from the mapping again). With ``kept`` (a local
    root's ``KeptDeltas``), a pair of published revisions streamed to its end is written beside
    them, and read from there once it is no longer in memory."""

    def __init__(
        self,
        limit_bytes: int = CACHE_BYTES,
        kept: KeptDeltas | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.limit_bytes = limit_bytes
        self.kept = kept
        self.metrics = metrics
        self._entries: OrderedDict[tuple[str, str, str], DeltaEntry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._computing: dict[tuple[str, str, str], threading.Lock] = {}
        # Kept pair files read and checked, by path: (the file's identity, its entries).
        self._loaded: OrderedDict[Path, tuple[tuple[int, int], dict[str, DeltaEntry]]] = (
            OrderedDict()
        )
        self._writing: set[Path] = set()  # pairs one stream is writing to disk now
        self.computed = 0  # entries computed (not found kept): one per (base, target, tensor)

    def entry(
        self,
        name: str,
        target: Model,
        base: Model | None,
        kept: dict[str, DeltaEntry] | None = None,
    ) -> DeltaEntry:
        """Tensor ``name``'s entry: from memory, else from the pair's kept file (``kept``),
        else computed (once, however many workers ask at the same time)."""
        key = (base.commit if base is not None else "", target.commit, name)
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self._count(FROM_MEMORY)
                return found
        on_disk = kept.get(name) if kept is not None else None
        if on_disk is not None and on_disk.header.nbytes == target.tensors[name].nbytes:
            self._count(FROM_DISK)
            return on_disk
        with self._lock:
            computing = self._computing.setdefault(key, threading.Lock())
        source = FROM_MEMORY
        with computing:  # concurrent workers asking for one patch compute it once
            with self._lock:
                found = self._entries.get(key)
            if found is None:
                found = plan_entry(name, target, base)
                self._keep(key, found)
                source = COMPUTED
                with self._lock:
                    self.computed += 1
        with self._lock:
            self._computing.pop(key, None)
        self._count(source)
        return found

    def _count(self, source: str) -> None:
        if self.metrics is not None:
            self.metrics.delta_served.labels(source).inc()
            if source == COMPUTED:
                self.metrics.delta_computed.inc()

    def _keep(self, key: tuple[str, str, str], entry: DeltaEntry) -> None:
        if entry.header.kind == WHOLE:
            # The whole tensor is the mapping's view: cheap to give again, costly to keep.
            entry = DeltaEntry(entry.header, ())
        size = sum(len(p) for p in entry.payload) + 256
        with self._lock:
            self._entries[key] = entry
            self._bytes += size
            while self._bytes > self.limit_bytes and self._entries:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= sum(len(p) for p in dropped.payload) + 256

    def size(self, target: Model, base: Model | None) -> tuple[int, int]:
        """(bytes of the delta stream's body, bytes of the tensors it sends whole): every
        tensor's entry computed (spread over the diff pool) and kept as ``stream`` keeps them,
        so the stream that follows sends what is computed here."""
        path = self.kept.pair(base, target) if self.kept is not None and base is not None else None
        kept = self._load(path) if path is not None else None
        pending = [
            (name, _diff_pool().submit(self.entry, name, target, base, kept))
            for name in target.tensors
        ]
        total = whole = 0
        for name, future in pending:
            found = future.result()
            total += len(header_line(found.header))
            if found.header.kind == WHOLE:
                whole += target.tensors[name].nbytes
            else:
                total += sum(len(piece) for piece in found.payload)
        return total + whole, whole

    def stream(self, target: Model, base: Model | None) -> Iterator[bytes | memoryview]:
        """The delta stream: per tensor of ``target``, one header line and its payload."""
        path = self.kept.pair(base, target) if self.kept is not None and base is not None else None
        kept = self._load(path) if path is not None else None
        writer = self._claim(path) if path is not None and kept is None else None
        claimed = writer is not None
        names = iter(target.tensors)
        ahead: deque[tuple[str, Future[DeltaEntry]]] = deque()
        try:
            while True:
                # The next tensors are diffed on other cores while this one is sent (NumPy
                # compares without the GIL): a first worker waits for the pair's diff spread
                # over the server's cores, not one.
                for name in itertools.islice(names, DIFF_AHEAD - len(ahead)):
                    ahead.append((name, _diff_pool().submit(self.entry, name, target, base, kept)))
                if not ahead:
                    break
                name, pending = ahead.popleft()
                entry = target.tensors[name]
                found = pending.result()
                if writer is not None:
                    writer = self._write(writer, found)
                yield header_line(found.header)
                if found.header.kind == WHOLE:
                    yield tensor_bytes(target, entry)
                else:
                    yield from found.payload
            if writer is not None:
                self._finish(writer, target)
                writer = None
        finally:
            for _, pending in ahead:  # the stream was cut: diffs not started are not needed
                if not pending.cancel():
                    # One running reads the revisions' mappings: done before the stream's
                    # lease lets them go.
                    futures.wait([pending])
            if writer is not None:  # the stream was cut: nothing half written is kept
                writer.discard()
            if claimed:
                with self._lock:
                    self._writing.discard(path)

    def _load(self, path: Path) -> dict[str, DeltaEntry] | None:
        """The pair's kept entries, read and checked once while the file stays the same."""
        assert self.kept is not None
        with self._lock:
            loaded = self._loaded.get(path)
        if loaded is not None:
            try:
                stat = path.stat()
            except OSError:
                stat = None
            if stat is not None and (stat.st_ino, stat.st_size) == loaded[0]:
                with self._lock:
                    self._loaded.move_to_end(path)
                return loaded[1]
        found = self.kept.load(path)
        with self._lock:
            self._loaded.pop(path, None)
            if found is not None:
                self._loaded[path] = found
                while len(self._loaded) > LOADED_PAIRS:
                    self._loaded.popitem(last=False)
        return found[1] if found is not None else None

    def _claim(self, path: Path) -> KeptDeltaWriter | None:
        """A writer of the pair's file, for the one stream that writes it."""
        assert self.kept is not None
        with self._lock:
            if path in self._writing:
                return None
            self._writing.add(path)
        try:
            return self.kept.writer(path)
        except OSError as e:
            log.warning("the delta %s cannot be kept on disk: %s", path.name, e)
            with self._lock:
                self._writing.discard(path)
            return None

    @staticmethod
    def _write(writer: KeptDeltaWriter, entry: DeltaEntry) -> KeptDeltaWriter | None:
        try:
            writer.add(entry)
            return writer
        except OSError as e:  # a full disk costs the copy on disk, never the stream
            log.warning("the delta %s is not kept on disk: %s", writer.path.name, e)
            writer.discard()
            return None

    def _finish(self, writer: KeptDeltaWriter, target: Model) -> None:
        assert self.kept is not None
        try:
            self.kept.keep(writer, sum(f.size for f in target.repo_files.values()))
        except OSError as e:
            log.warning("the delta %s is not kept on disk: %s", writer.path.name, e)
            writer.discard()
