"""``weightserve pull`` of a model whose files change on the server mid-way ends with the files
of one revision: what is unchanged is kept or resumed, what changed is fetched again, a file
the new revision lacks is removed. The transfer goes through a byte-counting proxy, which shows
the unchanged big file crossed the wire once.
"""

from __future__ import annotations

import contextlib
import filecmp
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.support.byte_proxy import ByteCountingProxy
from weightserve.client._client import Client
from weightserve.client._download import STATE_FILE, FilePull
from weightserve.client.errors import TransportError
from weightserve.service.server import ServerConfig, WeightServer

MODEL = "org/m"
BIG = "b_model.safetensors"  # listed (and pulled) first: weights, then the side files by name
CONFIG = b'{"model_type": "test", "v": 1}'


def replace(path: Path, data: bytes) -> None:
    """Replaced the way tools do: a new file renamed over the old."""
    fresh = path.with_name(path.name + ".tmp")
    fresh.write_bytes(data)
    os.replace(fresh, path)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[WeightServer, Path, ByteCountingProxy]]:
    directory = tmp_path / "root" / MODEL
    directory.mkdir(parents=True)
    (directory / "a_config.json").write_bytes(CONFIG)
    save_file({"w": np.arange(1 << 21, dtype=np.float32)}, str(directory / BIG))  # 8 MiB
    (directory / "c_tokenizer.json").write_text('{"v": 1}')
    (directory / "d_vocab.txt").write_text("a\nb\n")
    config = ServerConfig(
        str(tmp_path / "root"), http_port=0, grpc_port=0, flight_port=None,
        rescan_seconds=0, watch=False,
    )  # fmt: skip
    with WeightServer(config) as srv, ByteCountingProxy(srv.http_port) as proxy:
        yield srv, directory, proxy


def pull_changing(
    srv: WeightServer,
    proxy: ByteCountingProxy,
    out: Path,
    change: Callable[[], None],
    after: int = 1000,
) -> Path:
    """Pull through the proxy; ``change`` the model (and rescan) once more than ``after``
    bytes have arrived (by default: inside the big file, which comes first)."""
    changed: list[bool] = []
    seen = [0]

    def on_bytes(n: int) -> None:
        seen[0] += n
        if not changed and seen[0] > after:
            changed.append(True)
            change()
            srv.rescan()

    with Client(f"http://127.0.0.1:{proxy.port}") as client:
        pulled = client.model(MODEL).download(out, on_bytes=on_bytes)
    assert changed
    return pulled


def same_as_server(pulled: Path, source: Path) -> None:
    names = sorted(p.name for p in source.iterdir())
    assert sorted(p.name for p in pulled.iterdir()) == names  # no .partial, no state file
    assert not (pulled / STATE_FILE).exists()
    for name in names:
        assert filecmp.cmp(pulled / name, source / name, shallow=False), name


def test_a_file_not_yet_pulled_changes_while_the_big_one_streams(
    served, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    srv, source, proxy = served
    big = (source / BIG).stat().st_size
    pulled = pull_changing(
        srv, proxy, tmp_path / "out", lambda: replace(source / "c_tokenizer.json", b'{"v": 2}')
    )
    same_as_server(pulled, source)
    # The big file did not change: it crossed the wire once.
    assert proxy.bytes_from_upstream < 1.5 * big
    assert "changed during the pull" in caplog.text  # seen, and followed


def rewrite_big(source: Path) -> None:
    save_file({"w": np.ones(1 << 20, dtype=np.float32)}, str(source / (BIG + ".new")))
    os.replace(source / (BIG + ".new"), source / BIG)


def test_a_file_already_pulled_changes_mid_way(served, tmp_path: Path) -> None:
    srv, source, proxy = served
    big = (source / BIG).stat().st_size
    # Once the big file is in place and the config came: the big file is fetched again.
    pulled = pull_changing(srv, proxy, tmp_path / "out", lambda: rewrite_big(source), big + 1)
    same_as_server(pulled, source)


def test_the_file_in_progress_changes_mid_way(served, tmp_path: Path) -> None:
    srv, source, proxy = served
    pulled = pull_changing(srv, proxy, tmp_path / "out", lambda: rewrite_big(source))
    same_as_server(pulled, source)


def test_a_file_the_new_revision_lacks_is_removed(served, tmp_path: Path) -> None:
    srv, source, proxy = served
    big = (source / BIG).stat().st_size
    pulled = pull_changing(
        srv, proxy, tmp_path / "out", lambda: (source / "a_config.json").unlink(),
        after=big + len(CONFIG),
    )  # fmt: skip
    same_as_server(pulled, source)
    assert not (pulled / "a_config.json").exists()


def test_a_rerun_after_a_change_keeps_everything(served, tmp_path: Path) -> None:
    srv, source, proxy = served
    pulled = pull_changing(
        srv, proxy, tmp_path / "out", lambda: replace(source / "d_vocab.txt", b"c\n")
    )
    same_as_server(pulled, source)
    proxy.reset()
    with Client(f"http://127.0.0.1:{proxy.port}") as client:
        client.model(MODEL).download(pulled)
    same_as_server(pulled, source)
    assert proxy.bytes_from_upstream < 100_000  # a listing, no file


def test_a_pull_cut_off_by_an_outage_says_to_run_it_again(served, tmp_path: Path) -> None:
    srv, source, proxy = served

    def outage(n: int) -> None:
        # The server is gone (its connections cut, no new ones taken), and no retry budget is
        # left to wait for it.
        for sock in list(proxy._socks):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        proxy.close()

    with (
        Client(f"http://127.0.0.1:{proxy.port}", retry_seconds=0) as client,
        pytest.raises(TransportError, match="run the pull again: it goes on where it stopped"),
    ):
        client.model(MODEL).download(tmp_path / "out", on_bytes=outage)
    assert (tmp_path / "out" / STATE_FILE).exists()  # what arrived is kept for the next run


def test_the_progress_total_follows_a_file_fetched_again(served, tmp_path: Path) -> None:
    """What the CLI's bar is told (``on_bytes``, then ``on_plan`` when the pull follows the
    new revision) ends at the new revision's total: the big file's bytes received before it
    changed no longer count once it is fetched again from its start."""
    srv, source, proxy = served
    done, totals, changed = [0], [], []

    def on_bytes(n: int) -> None:
        done[0] += n
        assert done[0] <= totals[-1]
        if not changed and done[0] > 1000:  # inside the big file, which comes first
            changed.append(True)
            rewrite_big(source)
            srv.rescan()

    def on_plan(total: int, already: int) -> None:
        totals.append(total)
        done[0] = already

    with Client(f"http://127.0.0.1:{proxy.port}") as client:
        pull = FilePull(client.model(MODEL), tmp_path / "out").plan()
        totals.append(pull.total)
        pull.run(on_bytes=on_bytes, on_plan=on_plan)
    assert changed and len(totals) == 2
    want = sum(p.stat().st_size for p in source.iterdir())
    assert totals[-1] == want and done[0] == want
    same_as_server(tmp_path / "out", source)
