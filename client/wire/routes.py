"""Parse weightserve URLs: a server (``http://h:p``, ``grpc://h:p``) or a model on one
(``http://h:p/v1/models/ORG/NAME``, ``grpc://h:p/ORG/NAME``; ``https``/``grpcs`` for TLS;
``unix:///PATH/TO/SOCKET/v1/models/ORG/NAME`` for a server's same-node socket), read the
revision a model id names (``ORG/NAME@R``), and build the HTTP paths of a model's routes."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

from weightserve.client.errors import InvalidRequest

SCHEMES = {
    "http": ("http", False),
    "https": ("http", True),
    "grpc": ("grpc", False),
    "grpcs": ("grpc", True),
    "unix": ("http", False),  # the HTTP API on a same-node socket (``serve --uds PATH``)
}
# The path part that separates a model id from the route below it (``/v1/models/ID/-/stream``).
# No model id has it, so no id or tensor name can be mistaken for a route.
RESERVED_PART = "-"
# ``ID@R`` names revision R of model ID; ``ID:VARIANT`` another weight set of a directory.
# Neither character is in a name that forms an id, so both read without any lookup.
REVISION_SEPARATOR = "@"
VARIANT_SEPARATOR = ":"
# The ref that names a model's files as the server holds them now (the newest revision).
MAIN_REVISION = "main"
# Below a model: a publish in progress (/v1/models/ID/-/uploads/UPLOAD/...).
UPLOADS_ROUTE = "uploads"
DEFAULT_PORTS = {
    ("http", False): 80,
    ("http", True): 443,
    ("grpc", False): 50051,
    ("grpc", True): 443,
}


@dataclass(frozen=True)
class ServerAddress:
    transport: str  # "http" | "grpc"
    tls: bool
    host: str
    port: int
    socket_path: str | None = None  # a Unix socket instead of host and port

    @property
    def url(self) -> str:
        if self.socket_path is not None:
            return f"unix://{self.socket_path}"
        scheme = {
            ("http", False): "http",
            ("http", True): "https",
            ("grpc", False): "grpc",
            ("grpc", True): "grpcs",
        }[(self.transport, self.tls)]
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"


def is_url(text: str) -> bool:
    return urlsplit(str(text)).scheme in SCHEMES


def parse_url(url: str) -> tuple[ServerAddress, str | None]:
    """(server, model id or None) from a server or model URL."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(
            f"not a weightserve URL: {url!r} (use http://, https://, grpc:// or grpcs://)"
        )
    transport, tls = SCHEMES[parts.scheme]
    if parts.scheme == "unix":
        return _parse_unix_url(url)
    if not parts.hostname:
        raise ValueError(f"no host in {url!r}")
    server = ServerAddress(
        transport, tls, parts.hostname, parts.port or DEFAULT_PORTS[(transport, tls)]
    )
    path = unquote(parts.path).strip("/")
    if transport == "http":
        if path in ("", "v1/models"):
            return server, None
        if not path.startswith("v1/models/"):
            raise ValueError(
                f"an HTTP model URL looks like http://HOST:PORT/v1/models/MODEL, got {url!r}"
            )
        # A URL of one of the model's routes (``.../v1/models/ID/-/stream``) names it too.
        path = path[len("v1/models/") :].partition(f"/{RESERVED_PART}/")[0]
    return server, path or None


def _parse_unix_url(url: str) -> tuple[ServerAddress, str | None]:
    """``unix://SOCKET[/v1/models/MODEL]``: the socket path is everything before
    ``/v1/models`` (a socket has no directory of that name below it)."""
    rest = unquote(url[len("unix://") :])
    if rest.startswith("localhost/"):  # unix://localhost/PATH, as file:// URLs allow
        rest = rest[len("localhost") :]
    if not rest.startswith("/"):
        raise ValueError(f"a unix:// URL names an absolute socket path: unix:///PATH, got {url!r}")
    socket_path, found, model = rest.partition("/v1/models")
    model = model.strip("/")
    if found and model.partition(f"/{RESERVED_PART}/")[0] != model:
        model = model.partition(f"/{RESERVED_PART}/")[0]
    server = ServerAddress("http", False, "localhost", 0, socket_path=socket_path.rstrip("/"))
    return server, model or None


# Shorter hex names would soon match several commits of a busy model; 12 is git's own
# default abbreviation length for large repositories.
MIN_PREFIX_CHARS = 12
HEX_DIGITS = frozenset("0123456789abcdef")


def is_content_name(name: str) -> bool:
    """Whether a revision ``name`` has the form of content (at least ``MIN_PREFIX_CHARS``
    hex digits of a revision or commit) rather than of a ref: a name some server may hold,
    whether or not this one does."""
    return len(name) >= MIN_PREFIX_CHARS and set(name.lower()) <= HEX_DIGITS


def split_revision(model_id: str) -> tuple[str, str | None]:
    """(the model id without its revision, the revision or None): ``org/name@R`` is revision
    ``R`` of ``org/name``. The revision runs to the next ``/`` or ``:``, so a hub snapshot's
    sub-model ``org/name@R/unet`` is ``org/name/unet`` at ``R`` (the Hub writes the revision on
    the repository part) and ``org/name@R:fp16`` is ``org/name:fp16`` at ``R``."""
    at = model_id.find(REVISION_SEPARATOR)
    if at == -1:
        return model_id, None
    ends = [i for i in (model_id.find(c, at + 1) for c in ("/", VARIANT_SEPARATOR)) if i != -1]
    end = min(ends, default=len(model_id))
    revision = model_id[at + 1 : end]
    base = model_id[:at] + model_id[end:]
    if not revision or REVISION_SEPARATOR in model_id[at + 1 :]:
        raise InvalidRequest(
            f"invalid model id {model_id!r}: name one revision as ID{REVISION_SEPARATOR}REVISION "
            f"(a commit, a prefix of one, or a ref such as {MAIN_REVISION!r})"
        )
    return base, revision


def with_revision(model_id: str, revision: str | None) -> str:
    """``model_id`` pinned to ``revision`` (``ID@R``), or as it is for None. An id that names
    a revision already keeps it if it is the same one; another is InvalidRequest."""
    if revision is None:
        return model_id
    if not revision or any(c in revision for c in ("/", VARIANT_SEPARATOR, REVISION_SEPARATOR)):
        raise InvalidRequest(
            f"invalid revision {revision!r}: give a commit, a prefix of at least 12 hex digits "
            f"of one, or a ref such as {MAIN_REVISION!r} (no '/', ':' or '@')"
        )
    _, named = split_revision(model_id)
    if named is None:
        return f"{model_id}{REVISION_SEPARATOR}{revision}"
    if named != revision:
        raise InvalidRequest(
            f"model id {model_id!r} names revision {named!r} and the load asks for revision "
            f"{revision!r}; give one of them"
        )
    return model_id


def http_model_path(model_id: str, *route: str) -> str:
    """The HTTP path of a model (``/v1/models/ID``) or of a route below it:
    ``http_model_path(m, "stream")``, ``http_model_path(m, "tensors", name)``.

    Every part is percent-encoded (``%``, ``?``, ``#``, spaces); the id keeps its slashes
    (they separate its path parts), a tensor name does not (it is one opaque string).
    """
    path = f"/v1/models/{quote(model_id, safe='/')}"
    if route:
        path += f"/{RESERVED_PART}/" + "/".join(quote(part, safe="") for part in route)
    return path
