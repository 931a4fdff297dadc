"""What every model source reports besides its models."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """A model the source found but refused: which file, which rule."""

    model: str
    file: str
    reason: str
