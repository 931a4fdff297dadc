"""Value types for the ``weightserve`` command line: each turns a flag's (or an environment
variable's) text into a value, or says in a few words what an acceptable value looks like."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

MAX_PORT = 65535


def _number(text: str, kind: type[int] | type[float]) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        noun = "a whole number" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _within(
    text: str, kind: type[int] | type[float], ok: Callable[[float], bool], need: str
) -> int | float:
    """``text`` as a number of ``kind`` for which ``ok`` holds, else an error saying ``need``."""
    value = _number(text, kind)
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{need}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """A count that must be at least 1 (streams, parallel downloads)."""
    return int(_within(text, int, lambda v: v >= 1, "must be at least 1"))


def positive_seconds(text: str) -> float:
    """A duration that must be more than zero (a timeout)."""
    return float(_within(text, float, lambda v: v > 0, "must be more than 0 seconds"))


def non_negative_seconds(text: str) -> float:
    """A duration of zero or more (a grace period, a rescan interval where 0 means never)."""
    return float(_within(text, float, lambda v: v >= 0, "must be 0 seconds or more"))


def port(text: str) -> int:
    """A TCP port, 0..65535 (0: any free port)."""
    return int(_within(text, int, lambda v: 0 <= v <= MAX_PORT, f"a port is 0..{MAX_PORT}"))


def port_or_off(text: str) -> int:
    """A TCP port, or -1 for "no listener"."""
    if text.strip() == "-1":
        return -1
    try:
        return port(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"a port is 0..{MAX_PORT}, or -1 for none, got {text!r}"
        ) from None


def switch(text: str) -> bool:
    """On or off, as an environment variable spells it."""
    word = text.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected 1 or 0 (true/false, yes/no), got {text!r}")


def one_of(*choices: str) -> Callable[[str], str]:
    """One word out of ``choices``, any case."""

    def choice(text: str) -> str:
        word = text.strip().lower()
        if word not in choices:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(choices)}, got {text!r}")
        return word

    return choice


def non_empty(value: str) -> str:
    """Any text but an empty one."""
    if not value.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return value
