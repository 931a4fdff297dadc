"""Kept for imports of the old private name; the module is ``weightserve.client.arg_types``."""

from weightserve.client.arg_types import (
    non_empty,
    non_negative_seconds,
    one_of,
    port,
    port_or_off,
    positive_int,
    positive_seconds,
    switch,
)

__all__ = [
    "non_empty",
    "non_negative_seconds",
    "one_of",
    "port",
    "port_or_off",
    "positive_int",
    "positive_seconds",
    "switch",
]
