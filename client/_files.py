"""The files of one model's repository (``RemoteModel.files``, ``download``): listed, pulled
into a directory (client/_download.py), or brought from a revision it holds to the model's
in place (client/_pull_since.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from weightserve.client._download import DownloadableModel, download_files
from weightserve.client._models import RemoteFile
from weightserve.client._pull_since import pull_since
from weightserve.client._retry import OnWait, call_with_retry
from weightserve.client.wire.routes import ServerAddress

OnBytes = Callable[[int], None] | None


class ModelFiles:
    """The files of ``model``: what ``list`` says the server holds, what ``download`` writes."""

    def __init__(self, model: DownloadableModel) -> None:
        self.model = model

    def list(self) -> list[RemoteFile]:
        client, model_id = self.model.client, self.model.id
        address: ServerAddress = client.address
        listing = call_with_retry(
            lambda: client.transport.list_files(model_id),
            client.retry_seconds,
            f"{address.url} files of {model_id!r}",
            client.on_wait,
        )
        return [RemoteFile.from_json(f) for f in listing["files"]]

    def download(
        self,
        dest: Path,
        *,
        force: bool,
        since: str | None,
        on_bytes: OnBytes,
        on_wait: OnWait | None,
    ) -> tuple[Path, dict[str, int] | None]:
        """``dest``, and with ``since`` what the update did (files by outcome, bytes)."""
        if since is not None:
            report = pull_since(self.model, dest, since, on_bytes=on_bytes, on_wait=on_wait)
            return dest, report.as_counts()
        return download_files(
            self.model, dest, force=force, on_bytes=on_bytes, on_wait=on_wait
        ), None
