"""The exception hierarchy shared by client and service.

Every error carries a message that says what failed, on which model/tensor/file, why, and
what to do. The service maps each class to one HTTP status and one gRPC status code
(``STATUS_TABLE``); the client maps them back, so an error raised in the server surfaces in
the client as the same class. The four marked "client only" are raised by the client itself
and never cross the wire: no server sends them, so they have no row of their own.

    WeightserveError
    ├── CheckpointError          a checkpoint file breaks a rule of its format (service
    │                            defines one subclass per rule)
    ├── NotFound
    │   ├── ModelNotFound
    │   ├── TensorNotFound       also a KeyError, as MAX raises for missing weights
    │   ├── FileNotFound         a file name the model's repository does not hold
    │   └── RevisionNotFound     a revision (``ID@R``) the server holds no files of; the
    │                            message names the revisions it does hold
    ├── InvalidRequest           a malformed request: bad slice, bad name, bad offset
    │   └── RangeNotSatisfiable  a byte range that starts past the end of a file
    ├── Unauthenticated          no valid token
    ├── PermissionDenied         the token may not read this model
    ├── ResourceExhausted        a limit was reached: streams (temporary, ``retry_after``
    │                            set) or request size (final)
    │   └── CacheTooSmall        a model larger than the whole node cache (final)
    ├── ModelUnavailable         the model exists but cannot be served now (failed checks,
    │                            file changed underneath, server shutting down)
    │   ├── ModelFilling         a node cache is copying the model from its origin now;
    │   │                        the client waits as long as the server says so
    │   ├── OriginUnavailable    the origin a node cache fills from cannot be reached or
    │   │                        keeps failing (after bounded retries)
    │   └── OriginChanged        an origin's object changed or vanished while being fetched
    ├── RevisionMismatch         the model changed since the revision the request names
    ├── PublishConflict          a commit that cannot be made as asked: a file of the upload
    │   │                        still arriving, its base removed meanwhile
    │   └── MainMoved            another publish moved ``main`` since the upload began
    ├── TransportError           the server could not be reached, or the stream broke
    │   └── ServerUnreachable
    ├── WrongTransport           client only: the URL's scheme is not what its port
    │                            speaks (http:// at the gRPC port, grpc:// at the HTTP
    │                            or Flight port), or names a transport that does not
    │                            carry the call (publishing over grpc://); final
    ├── DataCorruption           a received tensor's digest did not match
    ├── DestinationError         client only: a pull's destination cannot take the files
    ├── ConversionRefused        client only: a model that does not convert to safetensors
    └── WeightsClosed            client only: ``data()`` after ``RemoteWeights.close()``;
                                 also a RuntimeError
"""

from __future__ import annotations


class WeightserveError(Exception):
    """Base class of every error weightserve raises on purpose."""

    # Seconds the server asks the client to wait before trying again, on refusals that are
    # temporary (a stream limit reached, a server shutting down); None on final ones.
    retry_after: float | None = None


class CheckpointError(WeightserveError):
    """A checkpoint file breaks a rule of its format.

    ``file`` names the file, ``rule`` is the short name of the broken rule, ``tensor`` the
    tensor involved if any.
    """

    rule = "invalid checkpoint"

    def __init__(self, file: object, detail: str, *, tensor: str | None = None) -> None:
        self.file = str(file)
        self.tensor = tensor
        self.detail = detail
        where = f"{self.file}" + (f", tensor {tensor!r}" if tensor else "")
        super().__init__(f"{where}: {self.rule}: {detail}")


class NotFound(WeightserveError):
    """Something named in a request does not exist."""


class ModelNotFound(NotFound):
    pass


class TensorNotFound(NotFound, KeyError):
    """A tensor name that the model does not hold. A KeyError too, as in MAX."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class FileNotFound(NotFound):
    """A file name that the model's repository does not hold (files API, Hub routes)."""


class RevisionNotFound(NotFound):
    """A revision (``ID@R``, ``revision=R``) the server holds no files of: a server serves the
    revisions whose files it holds, so one whose model moved on cannot serve an older commit.
    The message names the revisions it does hold."""


class InvalidRequest(WeightserveError):
    pass


class RangeNotSatisfiable(InvalidRequest):
    """A byte range of a file that starts past its end (HTTP 416)."""


class Unauthenticated(WeightserveError):
    pass


class PermissionDenied(WeightserveError):
    pass


class ResourceExhausted(WeightserveError):
    """A limit was reached. With ``retry_after`` (stream slots) it is temporary and the client
    waits and tries again; without (too many names, a request body too large) it is final."""

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class CacheTooSmall(ResourceExhausted):
    """A model larger than the whole node cache (``--cache-size``, or all its file system has
    room for), or a full disk with nothing left to evict: final, the message names the sizes;
    a larger cache, free space or another server is the way out."""


class ModelUnavailable(WeightserveError):
    """The model cannot be served now; with ``retry_after`` (a server shutting down) the client
    waits and tries again, which reaches another replica or the restarted server."""

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ModelFilling(ModelUnavailable):
    """A node cache is copying the model from its origin (the message says how far). Always
    temporary: the client waits without spending its retry budget, since each such answer
    is news of a fill that ends, with the model or with OriginUnavailable."""


class OriginUnavailable(ModelUnavailable):
    """The origin a node cache fills from (object storage, an upstream weightserve) could not
    be reached or kept failing, after bounded retries; models already cached are still
    served. The message names the origin and the cause."""


class OriginChanged(ModelUnavailable):
    """An origin's object changed (or vanished) while it was being fetched: list the origin
    again and fetch the new version."""


class RevisionMismatch(WeightserveError):
    pass


class PublishConflict(WeightserveError):
    """A publish's commit that cannot be made as asked (HTTP 409): a file of the upload is
    still arriving, or the base it was built on was removed meanwhile. The message says
    which; nothing was committed and ``main`` stayed."""


class MainMoved(PublishConflict):
    """Another publish moved ``main`` after this upload began (compare-and-set on ``main``):
    committing it would silently drop that revision. Nothing was committed; publish again
    on the new ``main`` (the message names it)."""


class TransportError(WeightserveError):
    """The connection failed or the stream broke; retrying may help."""


class ServerUnreachable(TransportError):
    pass


class WrongTransport(WeightserveError):
    """The port answers in another protocol than the URL's scheme names, or the transport the
    URL names does not carry the call asked of it (publishing over gRPC); the message says
    what the call needs. Not a TransportError: trying the same URL again cannot help."""


class DataCorruption(WeightserveError):
    pass


class DestinationError(WeightserveError):
    """The pull's destination cannot take the files: not a directory, not writable, full,
    or holding different files of the same names (overwrite with ``force``). Client only."""


class ConversionRefused(WeightserveError):
    """A model whose format does not convert to safetensors faithfully (GGUF). Client only."""


class WeightsClosed(WeightserveError, RuntimeError):
    """``data()`` / ``allocate()`` after ``close()``: the received buffers were dropped.
    Client only."""


# Said with a refused token on this side: the server's own message speaks of its protocol's
# header, while a client user gives the token as one of these.
TOKEN_HINT = (
    "give the server's token as Client(..., token=...) or in the WEIGHTSERVE_TOKEN "
    "environment variable"
)
TOKEN_HINT_CLI = (
    "give the server's token with --token or the WEIGHTSERVE_TOKEN environment variable"
)


# One table: exception class -> (HTTP status, gRPC status code name). Subclasses inherit the
# row of their nearest listed ancestor (the client-only classes: WeightserveError's, never
# used). A test checks every class above resolves to a row.
STATUS_TABLE: dict[type[WeightserveError], tuple[int, str]] = {
    TensorNotFound: (404, "NOT_FOUND"),
    FileNotFound: (404, "NOT_FOUND"),
    ModelNotFound: (404, "NOT_FOUND"),
    NotFound: (404, "NOT_FOUND"),
    RangeNotSatisfiable: (416, "OUT_OF_RANGE"),
    InvalidRequest: (400, "INVALID_ARGUMENT"),
    Unauthenticated: (401, "UNAUTHENTICATED"),
    PermissionDenied: (403, "PERMISSION_DENIED"),
    # 507 Insufficient Storage: waiting (429's promise) cannot make the model fit.
    CacheTooSmall: (507, "RESOURCE_EXHAUSTED"),
    ResourceExhausted: (429, "RESOURCE_EXHAUSTED"),
    CheckpointError: (422, "FAILED_PRECONDITION"),
    ModelUnavailable: (503, "UNAVAILABLE"),
    RevisionMismatch: (412, "FAILED_PRECONDITION"),
    PublishConflict: (409, "ABORTED"),
    DataCorruption: (500, "DATA_LOSS"),
    TransportError: (502, "UNAVAILABLE"),
    WeightserveError: (500, "INTERNAL"),
}


def status_for(exc: WeightserveError) -> tuple[int, str]:
    for cls in type(exc).__mro__:
        if cls in STATUS_TABLE:
            return STATUS_TABLE[cls]  # type: ignore[index]
    return STATUS_TABLE[WeightserveError]


# The wire carries the class name so the client can raise the same class.
ERROR_CLASSES: dict[str, type[WeightserveError]] = {
    cls.__name__: cls
    for cls in [
        WeightserveError,
        CheckpointError,
        NotFound,
        ModelNotFound,
        TensorNotFound,
        FileNotFound,
        RevisionNotFound,
        InvalidRequest,
        RangeNotSatisfiable,
        Unauthenticated,
        PermissionDenied,
        ResourceExhausted,
        CacheTooSmall,
        ModelUnavailable,
        ModelFilling,
        OriginUnavailable,
        OriginChanged,
        RevisionMismatch,
        PublishConflict,
        MainMoved,
        TransportError,
        ServerUnreachable,
        DataCorruption,
    ]
}


def error_from_wire(
    class_name: str, message: str, retry_after: float | None = None
) -> WeightserveError:
    """Rebuild the exception a server reported, as the same class when it is one of ours,
    with the server's retry hint (seconds) when it sent one."""
    cls = ERROR_CLASSES.get(class_name, WeightserveError)
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    if isinstance(exc, Unauthenticated) and hasattr(exc, "add_note"):  # Python >= 3.11
        # Shown under a traceback, kept out of the message (the same on both sides).
        exc.add_note(TOKEN_HINT)
    if retry_after is not None:
        exc.retry_after = retry_after
    return exc
