"""The revisions of one model (``RemoteModel.revisions``, ``watch``, ``hold``,
``iter_updates``, ``update``), all over the client's control transport: publishing and
watching in client/_publish.py, delta updates in client/_update.py. ``RemoteModel.publish``
is ``Client.publish`` of the model's id.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping, Sequence
from typing import Any, Protocol

import numpy as np

from weightserve.client._publish import Revision, hold, watch
from weightserve.client._retry import OnWait, call_with_retry
from weightserve.client._update import (
    TensorUpdate,
    UpdateTarget,
    apply_updates,
    iter_updates,
    remove_absent,
)
from weightserve.client.transports.base import ControlTransport
from weightserve.client.wire.routes import split_revision


class Fetchable(Protocol):
    def fetch(self, names: Sequence[str] | None = None) -> dict[str, np.ndarray]: ...


class RevisionsClient(Protocol):
    """What the revision verbs need of the model's client (``Client`` is one)."""

    retry_seconds: float
    on_wait: OnWait | None

    @property
    def transport(self) -> ControlTransport: ...
    def revisions(self, model_id: str) -> list[Revision]: ...
    def model(self, model_id: str, *, revision: str | None = None) -> Fetchable: ...


class ModelRevisions:
    """The revision verbs of the model ``model_id`` names (any ``@R`` in it left out: they
    are about the model, not about the revision a load pins)."""

    def __init__(self, client: RevisionsClient, model_id: str) -> None:
        self.client = client
        self.id = model_id
        self.plain = split_revision(model_id)[0]

    def revisions(self) -> list[Revision]:
        return self.client.revisions(self.id)

    def watch(self, since: str | None, timeout: float | None) -> Iterator[Revision]:
        return watch(self.client.transport, self.plain, since, timeout)

    def iter_updates(self, since: str, revision: str | None) -> Iterator[TensorUpdate]:
        return iter_updates(self.client.transport, self.plain, since, revision)[1]

    def update(
        self, state: MutableMapping[str, Any], since: str, revision: str | None
    ) -> tuple[Revision, dict[str, int], list[str]]:
        """The revision ``state`` now holds, what was done (by outcome, ``removed`` included)
        and the names removed from ``state`` (tensors that revision does not have)."""
        target, staged = self._staged_updates(since, revision)

        def fetch_whole(names: list[str]) -> dict[str, np.ndarray]:
            fetched = self.client.model(self.plain, revision=target.commit).fetch(names)
            return {name: np.asarray(array) for name, array in fetched.items()}

        counts = apply_updates(state, iter(staged), fetch_whole)
        removed = remove_absent(state, {update.name for update in staged})
        counts["removed"] = len(removed)
        found = [r for r in self.client.revisions(self.plain) if r.commit == target.commit]
        return (found[0] if found else Revision(target.commit, None, 0.0, 0)), counts, removed

    def _staged_updates(
        self, since: str, revision: str | None
    ) -> tuple[UpdateTarget, list[TensorUpdate]]:
        """The whole delta stream, read and checked before any of the caller's state changes
        (all or nothing); a stream cut or refused is asked for again within the client's
        retry budget, pinned to the commit its first answer named."""
        pinned = revision

        def read_whole() -> tuple[UpdateTarget, list[TensorUpdate]]:
            nonlocal pinned
            target, updates = iter_updates(self.client.transport, self.plain, since, pinned)
            pinned = target.commit or pinned
            return target, list(updates)

        what = f"update of {self.plain!r}"
        client = self.client
        return call_with_retry(read_whole, client.retry_seconds, what, client.on_wait, stream=True)

    def hold(self, commit: str, seconds: float) -> float | None:
        return hold(self.client.transport, self.plain, commit, seconds)
