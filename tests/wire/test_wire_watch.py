"""The revision watch's lines (client/wire/watch.py) and the one backoff (client/wire/backoff.py),
as a client's ``watch`` and a node cache following its upstream use them."""

from __future__ import annotations

import io

import pytest

from weightserve.client.wire.backoff import Delays
from weightserve.client.wire.watch import parse_event, read_events


def test_events_are_read_until_the_server_ends_the_watch() -> None:
    body = b'{"event":"hello","main":"abc"}\n{"event":"heartbeat"}\n{"event":"revision","commit":"d"}\n'
    got = list(read_events(io.BytesIO(body).readline))
    assert [e["event"] for e in got] == ["hello", "heartbeat", "revision"]
    assert got[2]["commit"] == "d"


def test_a_watch_stops_when_told_before_a_read() -> None:
    lines = io.BytesIO(b'{"event":"heartbeat"}\n' * 5)
    reads = iter([True, True, False])
    assert len(list(read_events(lines.readline, lambda: next(reads)))) == 2


@pytest.mark.parametrize(
    "line", [b"not json\n", b"[1]\n", b'{"main":"abc"}\n', b'{"event":3}\n', b'"hello"\n']
)
def test_a_line_that_is_not_an_event_is_refused(line: bytes) -> None:
    with pytest.raises(ValueError):
        parse_event(line)
    with pytest.raises(ValueError):
        list(read_events(io.BytesIO(line).readline))


def test_reconnects_back_off_and_start_again_after_a_connection() -> None:
    delays = Delays(0.05, 0.3, jitter=False)
    assert [delays.next() for _ in range(5)] == [0.05, 0.1, 0.2, 0.3, 0.3]
    delays.reset()
    assert delays.next() == 0.05


def test_jittered_waits_stay_in_the_upper_half_of_each_step() -> None:
    delays = Delays(0.1, 0.4)
    for ceiling in (0.1, 0.2, 0.4, 0.4, 0.4):
        assert ceiling / 2 <= delays.next() <= ceiling
