"""An idle server is quiet at the default log level: its rescans log only when what is served
changes, file events are not logged line by line, and a node cache's log line counts what its
banner counts."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.support.commands import ANY_PORTS, clean_env, start_server

IDLE_SECONDS = 12


def log_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def test_an_idle_demo_writes_a_handful_of_lines_however_often_it_rescans(tmp_path: Path) -> None:
    env = clean_env(WEIGHTSERVE_CACHE_DIR=str(tmp_path / "cache"), WEIGHTSERVE_RESCAN_SECONDS="0.5")
    served = start_server(["--demo", *ANY_PORTS], env, tmp_path)
    try:
        at_start = len(log_lines(served.stderr))
        root = tmp_path / "cache" / "demo-root"
        # File events under the root (a side file written and rewritten) and ~24 rescans.
        for i in range(4):
            (root / "demo" / "tiny-lm" / "notes.txt").write_text(f"note {i}\n")
            time.sleep(IDLE_SECONDS / 4)
        idle = log_lines(served.stderr)[at_start:]
    finally:
        served.stop()
    assert len(idle) <= 3, [line["message"] for line in idle]
    assert not any("changes detected" in line["message"] for line in idle)
    assert [line for line in log_lines(served.stderr) if line["message"].startswith("catalog:")]
