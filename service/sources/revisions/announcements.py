"""Changes of ``main``: what the watch routes announce, one event per change.

Every move of a model's ``main`` is one announcement, a rollback to a revision seen before
included, numbered by a sequence that only grows (per model: above the last one given, and
above the microseconds since the epoch, so a restarted process that kept no history still
numbers above what it gave before). A watcher that reconnects names where it was, by
sequence (``after``) or by commit (``since``: the last time ``main`` was that commit), and
gets the changes it missed; when the history kept does not reach back that far (retention
removed the revision, or more than ``HISTORY_LIMIT`` changes came since), it gets the
current ``main`` alone, flagged ``history_cut``, never an older revision replayed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

HISTORY_LIMIT = 64  # changes of main kept per model
HISTORY_NAME = "main-history"  # under .revisions/ (not *.json: those name revision records)
HISTORY_CUT = "history_cut"  # the flag on an answer that skips changes no longer known


@dataclass(frozen=True)
class MainChange:
    sequence: int
    commit: str
    at: float  # seconds since the epoch


class MainHistory:
    """The last ``HISTORY_LIMIT`` changes of one model's ``main``, oldest first."""

    def __init__(self, changes: Iterable[MainChange] = ()) -> None:
        self.changes = list(changes)[-HISTORY_LIMIT:]

    @property
    def last(self) -> MainChange | None:
        return self.changes[-1] if self.changes else None

    def moved(self, commit: str) -> MainChange | None:
        """``main`` is ``commit`` now: the change, or None when it already was."""
        last = self.last
        if last is not None and last.commit == commit:
            return None
        sequence = max((last.sequence if last else 0) + 1, time.time_ns() // 1000)
        change = MainChange(sequence, commit, time.time())
        self.changes = [*self.changes, change][-HISTORY_LIMIT:]
        return change

    def missed(self, since: str | None, after: int | None) -> list[MainChange] | None:
        """The changes after sequence ``after``, or after the last time ``main`` was
        ``since`` (a commit or a prefix of one), oldest first; None when the history kept does
        not reach back to that point."""
        if after is not None and since:  # both: the sequence counts if it names that commit
            wanted = since.lower()
            if not any(c.sequence == after and c.commit.startswith(wanted) for c in self.changes):
                after = None  # another server's numbering (a replica): by commit
        if after is not None:
            first = self.changes[0].sequence if self.changes else None
            if first is None or after < first:
                return None
            return [c for c in self.changes if c.sequence > after]
        wanted = (since or "").lower()
        for i in range(len(self.changes) - 1, -1, -1):
            if wanted and self.changes[i].commit.startswith(wanted):
                return self.changes[i + 1 :]
        return None

    def to_text(self) -> str:
        return "".join(
            json.dumps({"sequence": c.sequence, "commit": c.commit, "at": c.at}) + "\n"
            for c in self.changes
        )

    @classmethod
    def from_text(cls, text: str | None) -> MainHistory:
        """The history as written; lines that do not read (a torn write) are left out."""
        changes = []
        for line in (text or "").splitlines():
            try:
                found = json.loads(line)
                changes.append(MainChange(int(found["sequence"]), str(found["commit"]),
                                          float(found["at"])))  # fmt: skip
            except (ValueError, KeyError, TypeError):
                continue
        return cls(changes)


def missed_records(
    history: MainHistory,
    main: dict[str, Any],
    since: str | None,
    after: int | None,
    record: Callable[[str], dict[str, Any] | None],
) -> list[dict[str, Any]]:
    """What a watcher that was at ``since`` / ``after`` missed, as revision records with their
    ``sequence``, oldest first, ending at ``main`` (the current main's record): the changes it
    missed whose revision is still held (``record`` answers None for one removed), or
    ``main`` alone flagged ``HISTORY_CUT`` when the history does not reach back to it."""
    last = history.last
    current_sequence = last.sequence if last is not None and last.commit == main["commit"] else 0
    if since and main["commit"].startswith(since.lower()) and after in (None, current_sequence):
        return []
    if after is not None and not since and after >= current_sequence > 0:
        return []
    changes = history.missed(since, after)
    if changes is None:
        return [{**main, "sequence": current_sequence, HISTORY_CUT: True}]
    found = []
    for change in changes:
        held = main if change.commit == main["commit"] else record(change.commit)
        if held is not None:
            found.append({**held, "sequence": change.sequence})
    if not found or found[-1]["commit"] != main["commit"]:  # main moved outside the history
        found.append({**main, "sequence": current_sequence, HISTORY_CUT: True})
    return found


class Notes(Protocol):
    """Where a repository's small state files live (``RevisionStore``: ``.revisions/NAME``)."""

    def read_note(self, folder: str, name: str) -> str | None: ...

    def write_note(self, folder: str, name: str, text: str) -> None: ...


class StoredHistories:
    """The changes of main of each published repository, kept in its store beside the
    revision records (so they outlive a restart and are shared through a bucket)."""

    def __init__(self, store: Notes) -> None:
        self.store = store

    def read(self, folder: str) -> MainHistory:
        return MainHistory.from_text(self.store.read_note(folder, HISTORY_NAME))

    def moved(self, folder: str, commit: str) -> int | None:
        """``main`` of the repository is ``commit`` now: the change's sequence, or None when
        it already was (nothing to announce)."""
        history = self.read(folder)
        change = history.moved(commit)
        if change is None:
            return None
        self.store.write_note(folder, HISTORY_NAME, history.to_text())
        return change.sequence
