"""The one backoff policy of the project, pure (no sleeping, no clock): each wait about twice
the one before, from ``first`` up to ``longest``, drawn at random from the upper half of that
(jitter, so a crowd of refused clients or reconnecting watchers does not come back in step).
The client's retries (client/_retry.py, which adds a time budget and the server's hint), an
origin's bounded retries and the watchers' reconnects all take their waits from it.
"""

from __future__ import annotations

import random


class Delays:
    """Successive waits: ``first``, doubled after each, capped at ``longest``; with ``jitter``
    each drawn from [half, whole] of that. ``reset()`` after progress."""

    def __init__(self, first: float, longest: float, jitter: bool = True) -> None:
        if not 0 < first <= longest:
            raise ValueError(
                f"waits must grow from first > 0 to longest >= first: {first}, {longest}"
            )
        self.first = first
        self.longest = longest
        self.jitter = jitter
        self._ceiling = first

    def reset(self) -> None:
        """Progress was made: the next wait is ``first`` again."""
        self._ceiling = self.first

    def next(self) -> float:
        """The wait before this try (the one after it twice as long, up to ``longest``)."""
        ceiling = self._ceiling
        self._ceiling = min(ceiling * 2, self.longest)
        return random.uniform(ceiling / 2, ceiling) if self.jitter else ceiling
