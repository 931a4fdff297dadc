"""A stream's lease: everything one transfer holds on the server, taken as it starts and given
back exactly once however it ends.

Every transport's data call (an HTTP stream or file, gRPC StreamTensors, ReadFile and
GetTensor, a Flight DoGet, a handoff) runs under one ``StreamLease``: it takes the stream slot
(the limits and the open-streams gauge), keeps the model from eviction and read-leases its
files, arms the idle cut, counts the bytes sent and records how the call ended.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType

from weightserve.service.serving.idle import IdleWatch
from weightserve.service.serving.metrics import CallRecorder
from weightserve.service.serving.request import TensorRequest
from weightserve.service.serving.state import ServiceState
from weightserve.service.serving.streams import PlannedTensor, plan_stream
from weightserve.service.sources.model import Model


class StreamLease:
    """One call's hold on the server, released exactly once.

    Used as a context manager around the call, its refusals included: on leaving, whatever
    way, the lease is closed, unless it was ``handed_over()`` to what sends the answer (an
    HTTP response, Flight's batches), which closes it when the answer ends. Closing frees
    what ``admit`` took, stops the idle watch, adds the bytes to
    ``weightserve_bytes_served_total`` and, where ``counted``, records the call's outcome in
    its transport's ``CallRecorder`` (HTTP counts every answer in its middleware instead).
    """

    def __init__(
        self, state: ServiceState, transport: str, operation: str = "stream", counted: bool = True
    ) -> None:
        self.state = state
        self.transport = transport
        self.operation = operation
        self.calls: CallRecorder | None = getattr(state.metrics, transport) if counted else None
        self.started = time.perf_counter()
        self.model_id: str | None = None
        self.sent = 0  # data bytes handed to the transport
        self._held: contextlib.ExitStack | None = None
        self._idle: IdleWatch | None = None
        self._finished = False
        self._handed_over = False
        self._closed = False
        self._lock = threading.Lock()

    def plan(
        self, model: Model, request: TensorRequest, client: str, reads_files: bool = True
    ) -> list[PlannedTensor]:
        """Plan the stream (errors become statuses, not broken streams), then ``admit`` it
        with the files it reads: none where ``reads_files`` is False (an answer kept in
        memory, its files still checked by the plan)."""
        planned = plan_stream(model, request, self.state.limits.max_names)
        self.admit(model, {p.entry.file for p in planned} if reads_files else (), client)
        return planned

    def admit(self, model: Model, files: Iterable[Path], client: str) -> None:
        """Take a stream slot (``client`` is the per-client limit's key), keep ``model``
        from eviction (``Catalog.using``) and hold its ``files`` against in-place writers
        (``MappedFile.hold``) until the lease is released. A refusal raises, holding nothing."""
        state = self.state
        with contextlib.ExitStack() as stack:
            stack.enter_context(state.stream_slot(self.transport, client))
            stack.enter_context(state.catalog.using(model.id))
            stack.enter_context(model.holding(files))
            self._held = stack.pop_all()
        self.model_id = model.id

    def hold(self, model: Model, files: Iterable[Path]) -> None:
        """Also keep ``model`` from eviction and hold its ``files`` until the lease is
        released (a second model a call reads, such as a delta's base); after ``admit``."""
        assert self._held is not None, "admit first: the stream slot comes before the holds"
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.state.catalog.using(model.id))
            stack.enter_context(model.holding(files))
            self._held.push(stack.pop_all())

    def watch_idle(self, cut: Callable[[], None]) -> IdleWatch:
        """Arm the idle cut: ``cut`` is called once the client took nothing for
        ``idle_timeout``. The watch stops when the lease closes (or when closed sooner)."""
        self._idle = self.state.idle_cutter.watch(cut)
        return self._idle

    @property
    def idle_cut(self) -> bool:
        """Whether the idle cut fired: the call ends as an ``IdleTimeout``."""
        return self._idle is not None and self._idle.fired

    def progress(self, nbytes: int = 0) -> None:
        """The client took something (``nbytes`` of tensor or file data)."""
        self.sent += nbytes
        if self._idle is not None:
            self._idle.progress()

    def finished(self) -> None:
        """The answer went out whole: a cancellation from now on still counts as success."""
        self._finished = True

    def release(self) -> None:
        """Free the slot and the files now (idempotent); the rest waits for ``close``."""
        with self._lock:
            held, self._held = self._held, None
        if held is not None:
            held.close()

    def handed_over(self) -> StreamLease:
        """The caller's ``with`` no longer closes the lease on a normal exit: the object it
        is handed to does."""
        self._handed_over = True
        return self

    def close(self, error: BaseException | None = None) -> None:
        """End the lease (only the first call counts): ``error`` is what ended the call, None
        when it finished (see ``finished``) or was cut short without an error."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.release()
        finally:
            if self._idle is not None:
                self._idle.close()
            if self.model_id is not None:
                metrics = self.state.metrics
                metrics.child(metrics.bytes_served, self.transport, self.model_id).inc(self.sent)
            if self.calls is not None:
                self.calls.ended(self.operation, self.started, error, self._finished, self.idle_cut)

    def __enter__(self) -> StreamLease:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if error is not None or not self._handed_over:
            self.close(error)
