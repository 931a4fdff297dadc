"""The server's log lines are JSON whatever a message holds: the formatter alone, and the
stderr of ``weightserve serve`` as the command sets its logging up."""

from __future__ import annotations

import io
import json
import logging
from datetime import datetime, timezone
from pathlib import Path

from tests.support.commands import clean_env, start_server
from weightserve.service.logs import JsonFormatter

AWKWARD = 'a "q" \n é ✓ \\ {"x": 1}'


def test_a_record_with_an_exception_and_extra_fields_is_one_json_line() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("weightserve.test-logs")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        try:
            raise ValueError(f"bad {AWKWARD}")
        except ValueError:
            logger.exception("failed: %s", AWKWARD, extra={"model": "org/x", "where": Path("/m")})
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
    text = out.getvalue()
    assert text.count("\n") == 1 and text.isascii()
    entry = json.loads(text)
    assert entry["message"] == f"failed: {AWKWARD}"
    assert entry["level"] == "ERROR" and entry["logger"] == "weightserve.test-logs"
    assert entry["exception"].startswith("Traceback (most recent call last):")
    assert entry["exception"].endswith(f"ValueError: bad {AWKWARD}")
    assert entry["model"] == "org/x" and entry["where"] == "/m"  # not JSON: its str()
    assert entry["time"].endswith("Z")
    when = datetime.fromisoformat(entry["time"].replace("Z", "+00:00"))
    assert abs((datetime.now(timezone.utc) - when).total_seconds()) < 60
    assert list(entry)[:4] == ["time", "level", "logger", "message"]


def test_serve_writes_json_lines_whatever_the_message_holds(tmp_path: Path) -> None:
    # An empty root is logged by path (no models found), so its odd name lands in a message.
    root = tmp_path / AWKWARD
    root.mkdir()
    served = start_server(
        [str(root), "--http-port", "0", "--grpc-port", "0", "--flight-port", "-1"],
        clean_env(WEIGHTSERVE_CACHE_DIR=str(tmp_path / "cache")),
        tmp_path,
    )
    assert served.stop() == 0
    lines = served.stderr.read_text(encoding="utf-8").splitlines()
    entries = [json.loads(line) for line in lines]  # every stderr line, none broken
    warnings = [e for e in entries if e["level"] == "WARNING" and str(root) in e["message"]]
    assert len(warnings) == 1, lines
    assert warnings[0]["logger"] == "weightserve.serve"
    assert warnings[0]["message"].startswith(f"no models found under {root}: ")
