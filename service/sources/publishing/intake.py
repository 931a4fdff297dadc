"""The uploads in progress (``Intake``, which the Publisher is): each part's bytes counted
against ``--max-upload-bytes`` before they are written, commits kept from parts still
arriving, and uploads left idle removed.

Every byte an upload holds counts: its files, its tensors (or the tensors its patch led to)
and the parts arriving now, each reserving its Content-Length as it starts, so parts sent
side by side cannot hold more than the limit together. A commit seals its upload (no part
starts after it) and waits for the parts arriving to end, so no byte lands after the commit
answers: a revision never changes. An upload untouched for ``idle_seconds`` is removed by
a sweep that runs while uploads are in progress.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time

from weightserve.client.errors import NotFound, PublishConflict, ResourceExhausted
from weightserve.service.sources.publishing.uploads import (
    TENSORS_PART,
    Upload,
    part_label,
)

log = logging.getLogger("weightserve.publish")

UPLOAD_IDLE_SECONDS = 600.0  # an upload no request touched this long was abandoned: removed
UPLOAD_BODY_TIMEOUT = 60.0  # a part's body that sends nothing this long is cut off
SWEEP_SECONDS = 5.0  # at most this long between sweeps for idle uploads


class Intake:
    """The uploads in progress and their parts (see the module's text)."""

    def __init__(
        self,
        max_upload_bytes: int,
        body_timeout: float = UPLOAD_BODY_TIMEOUT,
        idle_seconds: float = UPLOAD_IDLE_SECONDS,
    ) -> None:
        self.max_upload_bytes = max_upload_bytes
        self.body_timeout = body_timeout
        self.idle_seconds = idle_seconds
        self._uploads: dict[str, Upload] = {}
        self._intake_lock = threading.Lock()
        self._sweeping = False

    def _track(self, upload: Upload) -> None:
        with self._intake_lock:
            self._uploads[upload.id] = upload
            start = not self._sweeping
            self._sweeping = True
        if start:
            threading.Thread(target=self._sweep, name="weightserve-uploads", daemon=True).start()

    def upload(self, model_id: str, upload_id: str) -> Upload:
        with self._intake_lock:
            found = self._uploads.get(upload_id)
        if found is None or found.model_id != model_id:
            raise NotFound(
                f"no upload {upload_id!r} of model {model_id!r} in progress (committed, "
                f"aborted, or left idle for longer than {self.idle_seconds:.0f} s): start "
                "the publish again"
            )
        found.touched = time.monotonic()
        return found

    def _untrack(self, upload: Upload) -> None:
        with self._intake_lock:
            self._uploads.pop(upload.id, None)

    def tracked(self, upload: Upload) -> bool:
        """Whether the upload is still in progress (not aborted, expired or committed)."""
        with self._intake_lock:
            return self._uploads.get(upload.id) is upload

    # -- parts --------------------------------------------------------------------------------

    def start_part(self, upload: Upload, part: str, declared: int | None) -> None:
        with self._intake_lock:
            if upload.sealed:
                raise PublishConflict(
                    f"the upload of {upload.model_id!r} is being committed (or was): "
                    f"{part_label(part)} cannot be added to it; start another upload"
                )
            if part in upload.receiving:
                raise PublishConflict(
                    f"{part_label(part)} of the upload of {upload.model_id!r} is arriving "
                    "already in another request"
                )
            # The part replaces what an earlier one of the same name left.
            if part == TENSORS_PART:
                upload.tensor_bytes = 0
            elif part.startswith("files/"):
                upload.files.pop(part.removeprefix("files/"), None)
            self._check_limit(upload, declared or 0)
            upload.receiving[part] = declared or 0
            upload.touched = time.monotonic()
        if declared is not None:
            free = shutil.disk_usage(upload.directory).free
            if declared > free:
                self.end_part(upload, part)
                raise ResourceExhausted(
                    f"{part_label(part)} of {declared} bytes does not fit: {free} bytes free "
                    "under the server's root"
                )

    def grow_part(self, upload: Upload, part: str, arrived: int) -> None:
        with self._intake_lock:
            upload.touched = time.monotonic()
            reserved = upload.receiving.get(part, 0)
            if arrived <= reserved:
                return
            self._check_limit(upload, arrived - reserved)
            upload.receiving[part] = arrived

    def end_part(self, upload: Upload, part: str) -> None:
        with self._intake_lock:
            upload.receiving.pop(part, None)
            upload.touched = time.monotonic()

    def settle_part(self, upload: Upload, part: str, size: int) -> None:
        """The part's body arrived whole as ``size`` bytes: held by the upload from now."""
        with self._intake_lock:
            upload.receiving.pop(part, None)
            if part == TENSORS_PART:
                upload.tensor_bytes = size
            else:
                upload.files[part.removeprefix("files/")] = size
            upload.touched = time.monotonic()

    def _check_limit(self, upload: Upload, more: int) -> None:
        """Refuse ``more`` bytes past ``max_upload_bytes`` (all the upload's bytes together)."""
        held = upload.held_bytes()
        if self.max_upload_bytes and held + more > self.max_upload_bytes:
            raise ResourceExhausted(
                f"the upload of {upload.model_id!r} would hold {held + more} bytes (its files, "
                "tensors and the parts arriving now, together), over this server's limit of "
                f"{self.max_upload_bytes} (--max-upload-bytes)"
            )

    def seal(self, upload: Upload) -> None:
        with self._intake_lock:
            if upload.sealed:
                raise PublishConflict(
                    f"a commit of the upload of {upload.model_id!r} is under way already"
                )
            upload.sealed = True

    def unseal(self, upload: Upload) -> None:
        with self._intake_lock:
            upload.sealed = False

    # -- ending -------------------------------------------------------------------------------

    def abort(self, upload_id: str, reason: str = "aborted") -> None:
        """Forget the upload and remove what it wrote."""
        with self._intake_lock:
            upload = self._uploads.pop(upload_id, None)
        if upload is not None:
            shutil.rmtree(upload.directory, ignore_errors=True)
            log.info("upload %s of %r discarded: %s", upload_id, upload.model_id, reason)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._intake_lock:
            stale = [
                u.id
                for u in self._uploads.values()
                if not u.receiving and not u.sealed and now - u.touched > self.idle_seconds
            ]
        for upload_id in stale:
            self.abort(upload_id, f"left idle for over {self.idle_seconds:.0f} s")

    def _sweep(self) -> None:
        """Remove idle uploads while any is in progress; ends with the last one."""
        pause = max(0.05, min(SWEEP_SECONDS, self.idle_seconds / 4))
        while True:
            time.sleep(pause)
            self._expire()
            with self._intake_lock:
                if not self._uploads:
                    self._sweeping = False
                    return
