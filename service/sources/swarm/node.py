"""A node cache's peer fills: the files of a fill taken from the revision's swarm (engine.py)
where the upstream runs one, each then checked against the listing's digest exactly as a file
fetched from the upstream is; the revision seeded once the node holds it whole.

Anything the swarm cannot give (an upstream without the route or without libtorrent, a
refusal, a stall, a file whose bytes do not hash to the listing's digest) is left to the
ordinary fill from the upstream: the swarm only ever saves upstream traffic, it never decides
what a node holds.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from weightserve.client.wire.digests import file_digest
from weightserve.service.sources.swarm.engine import Admission, PeerEngine, SwarmUnavailable

if TYPE_CHECKING:
    from weightserve.service.sources.origin.base import OriginFile
    from weightserve.service.sources.origin.upstream import UpstreamOrigin

log = logging.getLogger("weightserve.swarm")

# The staging directory below the cache's data directory (same file system: placed by rename).
STAGING = ".swarm"
# What a swarm fill of a revision costs the upstream, in copies of it (bench.fanout: 1.1-1.3
# for 2 to 8 nodes loading at once).
SWARM_COPIES = 1.5
# How long a node following a new revision waits for the others to join its swarm before it
# counts them (they are told of the revision within milliseconds of each other).
GATHER_SECONDS = 1.0


class PeerFills:
    """The swarm side of a node cache over ``origin`` (an upstream weightserve)."""

    def __init__(self, engine: PeerEngine, origin: UpstreamOrigin) -> None:
        self.engine = engine
        self.origin = origin
        self._lock = threading.Lock()
        self._admitted: dict[str, Admission] = {}  # node model id -> the revision last filled

    def fetch(
        self,
        model_id: str,
        files: list[OriginFile],
        data_dir: Path,
        partial: Callable[[OriginFile], Path],
        on_bytes: Callable[[int], None],
        on_sources: Callable[[int, int], None] | None = None,
    ) -> dict[str, tuple[Path, str]]:
        """What the swarm gave of ``files``: by origin name, the file (at ``partial(file)``,
        not yet in place) and its digest, which is the listing's. Never raises for the swarm's
        failures: what is missing is fetched from the upstream by the caller. ``on_sources(from
        peers, from the upstream)``: the payload bytes of the swarm's part, by source."""
        with self._lock:
            self._admitted.pop(model_id, None)  # seeded again only for the revision filled now
        if not files:
            return {}
        try:
            upstream_model, names = self._names(files)
            admission = self.engine.admit(upstream_model, self.origin.revision_of(upstream_model))
        except Exception as e:  # noqa: BLE001 - the upstream alone, as without a swarm
            self._note_refusal(model_id, e)
            return {}
        staging = data_dir / STAGING / f"{admission.commit}-{threading.get_ident()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        wanted = {names[f.name]: f.size for f in files}
        by_name = {names[f.name]: f for f in files}

        def read(name: str, offset: int, length: int) -> bytes:
            return self.origin.read_range(by_name[name], offset, length)

        try:
            got = self.engine.fill(admission, wanted, staging, read, on_bytes, on_sources)
        except SwarmUnavailable as e:
            log.info("peer fill of %s stopped (%s): the upstream fills the rest", model_id, e)
            got = {}
        except Exception as e:  # noqa: BLE001 - a swarm's fault never fails the fill
            log.warning("peer fill of %s failed (%s): the upstream fills the rest", model_id, e)
            got = {}
        placed: dict[str, tuple[Path, str]] = {}
        try:
            for file in files:
                path = got.get(names[file.name])
                if path is None:
                    continue
                digest = file_digest(path)
                if digest != file.version:  # another revision's bytes, or a broken swarm
                    log.warning(
                        "peer fill of %s: %s hashes to %s, the listing says %s; fetching it "
                        "from the upstream", model_id, file.name, digest, file.version,
                    )  # fmt: skip
                    continue
                target = partial(file)
                target.parent.mkdir(parents=True, exist_ok=True)
                path.replace(target)
                placed[file.name] = (target, digest)
        except OSError as e:  # what was placed stays the caller's; the rest comes whole
            log.warning("peer fill of %s: %s; the upstream fills the rest", model_id, e)
        shutil.rmtree(staging, ignore_errors=True)
        with self._lock:
            self._admitted[model_id] = admission
        return placed

    def patches_worth(self, model_id: str, files: list[OriginFile], delta: int, whole: int) -> bool:
        """Whether this node should build ``files`` from the upstream's delta stream
        (``delta`` bytes) rather than fill them (``whole`` bytes) through the swarm.

        Every node following the upstream asks at about the same time, and decides alike: n
        nodes patching cost the upstream n deltas, a swarm fill about one copy of the files
        (``SWARM_COPIES``, measured). The node joins the revision's swarm, gives the others a
        moment to join it too, and counts them."""
        try:
            upstream_model, _ = self._names(files)
            revision = self.origin.revision_of(upstream_model)
            self.engine.admit(upstream_model, revision)
            time.sleep(GATHER_SECONDS)
            nodes = len(self.engine.admit(upstream_model, revision).peers) + 1
        except Exception as e:  # noqa: BLE001 - no swarm to weigh: patch, as without peers
            log.info("weighing the update of %s against its peers failed (%s)", model_id, e)
            return True
        patch = nodes * delta <= SWARM_COPIES * whole
        log.info(
            "the update of %s: %d nodes x %d bytes of delta against %d bytes of files: %s",
            model_id, nodes, delta, whole, "patching" if patch else "filling from peers",
        )  # fmt: skip
        return patch

    def seed(self, model_id: str, held: dict[str, tuple[Path, str]]) -> None:
        """Seed the model's revision from its files held whole (origin name -> path and the
        digest it was verified with), when they are exactly the revision last admitted to."""
        with self._lock:
            admission = self._admitted.get(model_id)
        try:
            upstream_model, names = self._names_of(held)
            if admission is None:  # built from patches, or held since before a restart
                admission = self.engine.admit(
                    upstream_model, self.origin.revision_of(upstream_model)
                )
                with self._lock:
                    self._admitted[model_id] = admission
            digests = {names[name]: digest for name, (_, digest) in held.items()}
            if set(digests) != set(admission.files()) or digests != admission.etags:
                return  # the node holds other bytes than the revision's torrent describes
            self.engine.seed(admission, {names[name]: path for name, (path, _) in held.items()})
        except Exception as e:  # noqa: BLE001 - the node serves on; peers ask the upstream
            log.warning("cannot seed %s to peers: %s", model_id, e)

    def stop(self, model_id: str) -> None:
        """Stop seeding the model (its files are about to be replaced or removed)."""
        with self._lock:
            admission = self._admitted.get(model_id)
        if admission is not None:
            self.engine.stop(admission.model)

    def _names(self, files: list[OriginFile]) -> tuple[str, dict[str, str]]:
        return self._names_of({f.name: None for f in files})

    def _names_of(self, names: Mapping[str, object]) -> tuple[str, dict[str, str]]:
        """(the model on the upstream, origin name -> name below it) of one model's files."""
        models, below = set(), {}
        for name in names:
            model, upstream_name = self.origin.split_name(name)
            models.add(model)
            below[name] = upstream_name
        if len(models) != 1:
            raise ValueError(f"the files belong to {len(models)} models of the upstream")
        return models.pop(), below

    def _note_refusal(self, model_id: str, error: Exception) -> None:
        log.info("peer fill of %s not started (%s): filling from the upstream", model_id, error)
