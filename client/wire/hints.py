"""The "did you mean" hint every refusal of an unknown name carries (a tensor, a model, a file),
on the server and in the client alike: the one closest name, if any is close enough."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest_name(name: str, known: Iterable[str]) -> str | None:
    """The known name closest to ``name``, None when none is close (difflib's 0.6 ratio)."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return close[0] if close else None


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for the closest known name, else nothing: appended to an error
    message that ends its sentence."""
    close = closest_name(name, known)
    return f" Did you mean {close!r}?" if close is not None else ""
