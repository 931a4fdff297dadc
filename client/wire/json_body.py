"""A JSON object read from bytes, or refused: the publish route's request bodies and the
same-node handoff's frames both take nothing else."""

from __future__ import annotations

import json
from typing import Any


def load_json_object(raw: bytes, error_type: type[Exception], what: str) -> dict[str, Any]:
    """``raw`` as a JSON object; otherwise ``error_type`` saying that ``what`` (e.g. "the
    request body") is not JSON, or not an object."""
    try:
        found = json.loads(raw)
    except ValueError as e:
        raise error_type(f"{what} is not JSON: {e}") from None
    except RecursionError:  # nested deeper than the parser's stack
        raise error_type(f"{what} is JSON nested too deeply") from None
    if not isinstance(found, dict):
        raise error_type(f"{what} must be a JSON object")
    return found
