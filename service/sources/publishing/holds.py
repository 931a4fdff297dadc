"""Holds: a revision kept from retention while a worker computes with it.

One hold per holder and revision (the holder is the token's identity, or without a token file
the client id the request names, else its address): a holder renews, shortens or releases
(0 seconds) only its own, so another reader's short hold never shortens a worker's long one;
a revision is kept while any holder's hold runs (the longest wins). A hold lasts at most
``MAX_HOLD_SECONDS`` and is a finite number of seconds; anything else is refused. Holds are
written beside the revision records (``.revisions/holds``, through the store: on a local disk,
or in the bucket where nodes publish into one), so they outlive a restart and every node's
retention sees every node's holds.
"""

from __future__ import annotations

import json
import math
import threading
import time
from typing import Any

from weightserve.client.errors import InvalidRequest
from weightserve.service.sources.revisions.announcements import Notes

MAX_HOLD_SECONDS = 7 * 24 * 3600  # a week: longer than any step of a training run
HOLDS_NAME = "holds"  # under .revisions/ (not *.json: those name revision records)
MAX_HOLDER_CHARS = 128
MAX_HOLDERS_PER_REVISION = 1024  # a revision's holders beyond this refuse a new one


def hold_seconds(value: Any) -> float:
    """The seconds of a hold as a request gives them: a finite number from 0 (release) to
    ``MAX_HOLD_SECONDS``; InvalidRequest for anything else (``true``, a string, ``NaN``,
    ``Infinity``, 1e308)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"a hold's seconds must be a number, not {type(value).__name__}")
    if not math.isfinite(value) or not 0 <= value <= MAX_HOLD_SECONDS:
        raise InvalidRequest(
            f"a hold's seconds must be from 0 (release) to {MAX_HOLD_SECONDS} (a week): "
            "renew a hold before it ends to keep a revision longer"
        )
    return float(value)


def holder_name(value: Any) -> str | None:
    """A client id a request names for itself (without a token file), checked."""
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_HOLDER_CHARS:
        raise InvalidRequest(f"a hold's holder must be a string of 1 to {MAX_HOLDER_CHARS} chars")
    return value


class Holds:
    """The holds of every repository of a store, read from and written to the store on each
    change (so nodes over one bucket share them); held until times are seconds since the
    epoch, so they mean the same after a restart and on another node."""

    def __init__(self, store: Notes) -> None:
        self.store = store
        self._lock = threading.Lock()

    def _read(self, folder: str) -> dict[str, dict[str, float]]:
        """commit -> holder -> held until, the expired ones left out."""
        try:
            found = json.loads(self.store.read_note(folder, HOLDS_NAME) or "{}")
        except ValueError:
            return {}  # a torn or foreign file: no holds, rather than no retention ever
        now = time.time()
        holds: dict[str, dict[str, float]] = {}
        if isinstance(found, dict):
            for commit, holders in found.items():
                if isinstance(holders, dict):
                    kept = {
                        str(h): float(u)
                        for h, u in holders.items()
                        if isinstance(u, int | float) and math.isfinite(u) and u > now
                    }
                    if kept:
                        holds[str(commit)] = kept
        return holds

    def hold(self, folder: str, commit: str, holder: str, seconds: float) -> float | None:
        """``holder``'s hold of ``commit`` runs ``seconds`` from now (0: released); the time
        the revision is held until by anyone, None when nobody holds it any more."""
        with self._lock:
            holds = self._read(folder)
            holders = holds.setdefault(commit, {})
            if seconds > 0:
                if holder not in holders and len(holders) >= MAX_HOLDERS_PER_REVISION:
                    raise InvalidRequest(
                        f"revision {commit[:16]} has {len(holders)} holders already: share one"
                    )
                holders[holder] = time.time() + seconds
            else:
                holders.pop(holder, None)
            if not holders:
                del holds[commit]
            self.store.write_note(folder, HOLDS_NAME, json.dumps(holds))
        return max(holders.values()) if holders else None

    def held(self, folder: str) -> set[str]:
        """The commits some holder holds now."""
        with self._lock:
            return set(self._read(folder))
