"""How long a request waits for the fill it triggered or joined, and the fill handed over to a
caller that follows it instead (a Hub client, whose timeouts are shorter than a fill)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import logging
from collections.abc import Iterator

from weightserve.client.errors import (
    ModelFilling,
)
from weightserve.service.sources.cache.landing import LandedFile
from weightserve.service.sources.cache.node_cache import NodeCache
from weightserve.service.sources.origin.base import OriginFile

log = logging.getLogger("weightserve.service")


# How long a request waits for the fill it triggered or joined before it is answered 503
# with the fill's progress and a Retry-After: a handler thread is not held for a whole fill,
# and the client's retry budget covers the rest.
FILL_WAIT_SECONDS = 10.0
FILL_RETRY_AFTER_SECONDS = 2.0
# Set by a caller that cannot be held for a fill (a Hub client's timeouts are shorter than a
# fill) and follows it instead: the fill is started and handed over at once (FillInProgress).
_FOLLOW_FILLS: contextvars.ContextVar[bool] = contextvars.ContextVar("follow_fills", default=False)


@contextlib.contextmanager
def following_fills() -> Iterator[None]:
    """Within the block, a request that needs a fill raises ``FillInProgress`` at once."""
    token = _FOLLOW_FILLS.set(True)
    try:
        yield
    finally:
        _FOLLOW_FILLS.reset(token)


class FillInProgress(ModelFilling):
    """ModelFilling raised at once where fills are followed (``following_fills``): the model's
    fill runs, its files (the origin's listing) and their bytes can be followed as they land."""

    def __init__(
        self,
        message: str,
        cache: NodeCache,
        model_id: str,
        files: tuple[OriginFile, ...],
        pending: concurrent.futures.Future[None],
    ) -> None:
        super().__init__(message, retry_after=FILL_RETRY_AFTER_SECONDS)
        self.cache = cache
        self.model_id = model_id
        self.files = files
        self._pending = pending

    def origin_file(self, name: str) -> OriginFile | None:
        """The listed file a model-relative ``name`` is: ``ID/name``, or the file of a file
        model (or a split GGUF's part) beside it."""
        for file in self.files:
            inside = file.name.startswith(self.model_id + "/")
            if file.name == f"{self.model_id}/{name}" or (
                not inside and file.name.rpartition("/")[2] == name
            ):
                return file
        return None

    def landed(self, name: str) -> LandedFile | None:
        """The file's bytes as the fill lands them; None where this fill does not fetch it."""
        file = self.origin_file(name)
        return self.cache.landed(self.model_id, file.name) if file is not None else None

    def wait(self, timeout: float | None) -> bool:
        """Whether the fill ended within ``timeout`` seconds; raises its error if it failed."""
        try:
            self._pending.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            return False
        return True
