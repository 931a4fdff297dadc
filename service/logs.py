"""The server's log lines: one JSON object per line on stderr, whatever the message holds
(quotes, newlines, tracebacks), so log collectors never see a broken record."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from typing import Any

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_RECORD_ATTRIBUTES = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
}


class JsonFormatter(logging.Formatter):
    """A record as ``{"time", "level", "logger", "message"}``, plus ``exception`` and
    ``stack`` when the record has them and the fields given with ``extra=``."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        for key, value in record.__dict__.items():
            if key not in _RECORD_ATTRIBUTES and key not in entry:
                entry[key] = value
        # ASCII only: a stderr whose encoding cannot hold a character would otherwise escape
        # it in a way JSON does not read; default=str keeps an odd ``extra`` value printable.
        return json.dumps(entry, separators=(",", ":"), default=str)


def configure_logging(level: str) -> None:
    """JSON lines on stderr at ``level`` (debug, info, warning or error) for every logger
    that propagates to the root."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler])
    # watchfiles says "N changes detected" at INFO for every batch of file events; the
    # rescans they cause log what changed themselves.
    logging.getLogger("watchfiles").setLevel(max(logging.WARNING, logging.getLogger().level))
