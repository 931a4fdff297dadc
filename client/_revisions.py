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
from weightserve.client._update import TensorUpdate, apply_updates, iter_updates
from weightserve.client.transports.base import ControlTransport
from weightserve.client.wire.routes import split_revision


class Fetchable(Protocol):
    def fetch(self, names: Sequence[str] | None = None) -> dict[str, np.ndarray]: ...


class RevisionsClient(Protocol):
    """What the revision verbs need of the model's client (``Client`` is one)."""

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
    ) -> tuple[Revision, dict[str, int]]:
        """The revision ``state`` now holds, and what was done (by outcome)."""
        target, updates = iter_updates(self.client.transport, self.plain, since, revision)

        def fetch_whole(names: list[str]) -> dict[str, np.ndarray]:
            fetched = self.client.model(self.plain, revision=target.commit).fetch(names)
            return {name: np.asarray(array) for name, array in fetched.items()}

        counts = apply_updates(state, updates, fetch_whole)
        found = [r for r in self.client.revisions(self.plain) if r.commit == target.commit]
        return (found[0] if found else Revision(target.commit, None, 0.0, 0)), counts

    def hold(self, commit: str, seconds: float) -> float | None:
        return hold(self.client.transport, self.plain, commit, seconds)
