"""Bearer-token authentication and per-model access, shared by the four transports (HTTP,
gRPC, Flight, the same-node handoff).

The token file holds one token per line, optionally followed by the model ids (or
``fnmatch`` patterns) it may read; a token with no patterns may read every model.
``admin=PATTERN`` lets the token use the operator's routes (prefetch, evict, verify a node
cache's models) on the models PATTERN matches; it adds nothing to what the token reads.
``publish=PATTERN`` lets it publish revisions of the models PATTERN matches (and read them);
``hold=PATTERN`` lets it hold their revisions against retention (publish= implies it)::

    s3cr3t-token-for-everything
    team-a-token   team-a/*  shared/base-model
    ops-token      admin=*
    trainer-token  publish=team-a/policy
    worker-token   team-a/policy  hold=team-a/policy

Blank lines and lines starting with ``#`` are ignored. The file is re-read when it changes
(checked at most once a second), so tokens rotate without a restart.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import hmac
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from weightserve.client.errors import InvalidRequest, PermissionDenied, Unauthenticated
from weightserve.client.wire.routes import split_revision

ADMIN_KEYWORD = "admin="
PUBLISH_KEYWORD = "publish="
HOLD_KEYWORD = "hold="
KEYWORDS = (ADMIN_KEYWORD, PUBLISH_KEYWORD, HOLD_KEYWORD)


@dataclass(frozen=True)
class Grant:
    token: str
    patterns: tuple[str, ...]  # empty: every model
    admin: tuple[str, ...] = ()  # models it may administer (``admin=PATTERN``); empty: none
    publish: tuple[str, ...] = ()  # models it may publish to (``publish=PATTERN``); empty: none
    hold: tuple[str, ...] = ()  # models whose revisions it may hold (``hold=PATTERN``)

    def may_read(self, model_id: str) -> bool:
        """Whether a pattern names the model (a ``publish=`` one too: publishing implies
        reading); a grant for a model covers its revisions (``ID@R`` is read as ``ID``)."""
        return (
            not self.patterns
            or _names_any(model_id, self.patterns)
            or _names_any(model_id, self.publish)
        )

    def may_publish(self, model_id: str) -> bool:
        return _names_any(model_id, self.publish)

    def may_hold(self, model_id: str) -> bool:
        """A hold keeps a revision's disk from retention: ``hold=`` (or ``publish=``)."""
        return _names_any(model_id, self.hold) or self.may_publish(model_id)

    def may_administer(self, model_id: str) -> bool:
        """Whether an ``admin=`` pattern names the model, its revisions covered as for reads."""
        return _names_any(model_id, self.admin)

    @property
    def identity(self) -> str:
        """Who holds this token, safe to log and to show in errors: a short hash of it
        (never the token itself)."""
        return "token " + hashlib.sha256(self.token.encode()).hexdigest()[:12]


def _names_any(model_id: str, patterns: tuple[str, ...]) -> bool:
    """Whether a pattern matches ``model_id`` or, for ``ID@R``, ``ID``."""
    names = {model_id}
    with contextlib.suppress(InvalidRequest):  # a malformed id is refused where it is read
        names.add(split_revision(model_id)[0])
    return any(fnmatch.fnmatchcase(name, p) for name in names for p in patterns)


def parse_tokens(text: str) -> list[Grant]:
    grants = []
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        patterns = [p.rstrip(",") for p in fields[1:]]
        keyed: dict[str, tuple[str, ...]] = {}
        for keyword in KEYWORDS:
            keyed[keyword] = tuple(p[len(keyword) :] for p in patterns if p.startswith(keyword))
            if "" in keyed[keyword]:
                raise ValueError(f"{keyword} needs a model id or pattern ({keyword}*: every model)")
        reads = tuple(p for p in patterns if not p.startswith(KEYWORDS))
        grants.append(
            Grant(fields[0], reads, *(keyed[k] for k in KEYWORDS))  # admin, publish, hold
        )
    return grants


class TokenStore:
    def __init__(self, path: str | os.PathLike, check_interval: float = 1.0) -> None:
        self.path = Path(path)
        self.check_interval = check_interval
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._checked = 0.0
        self._grants: list[Grant] = []
        self._reload(force=True)

    def _reload(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._checked < self.check_interval:
            return
        self._checked = now
        st = self.path.stat()
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp != self._stamp:
            grants = parse_tokens(self.path.read_text())
            if not grants:
                raise ValueError(f"token file {self.path} holds no token")
            self._grants, self._stamp = grants, stamp

    def grant(self, authorization: str | None) -> Grant:
        """The grant for an ``Authorization: Bearer ...`` value, or Unauthenticated."""
        with self._lock:
            # Keep the last good tokens if the file is briefly missing or empty (a rotation).
            with contextlib.suppress(OSError, ValueError):
                self._reload()
            grants = self._grants
        if not authorization or not authorization.startswith("Bearer "):
            raise Unauthenticated("this server needs a bearer token (Authorization: Bearer ...)")
        presented = authorization[len("Bearer ") :].strip().encode()
        found = None
        for g in grants:  # compare with every token, in constant time each
            if hmac.compare_digest(presented, g.token.encode()):
                found = g
        if found is None:
            raise Unauthenticated("the bearer token is not valid")
        return found


class Access:
    """What one request may do: everything (no auth configured) or what its grant allows."""

    def __init__(self, grant: Grant | None) -> None:
        self.grant = grant

    def may_read(self, model_id: str) -> bool:
        return self.grant is None or self.grant.may_read(model_id)

    def client_key(self, address: str) -> str:
        """The key of the per-client stream limit: the token's identity when the request
        carries one (many workers behind one ingress or node address are many clients), else
        the peer ``address``."""
        return self.grant.identity if self.grant is not None else address

    def check(self, model_id: str) -> None:
        if not self.may_read(model_id):
            raise PermissionDenied(f"this token may not read model {model_id!r}")

    def check_admin(self, model_id: str, *, on_this_node: bool) -> None:
        """The operator's routes (prefetch, evict, verify): with tokens, the grant's
        ``admin=`` patterns must match the model; without a token file, only a caller on this
        node (loopback, the Unix socket) may use them, since anyone who reaches the port
        could otherwise empty the cache."""
        if self.grant is None:
            if not on_this_node:
                raise PermissionDenied(
                    "the operator routes answer only callers on this node (loopback or the Unix "
                    "socket) while the server has no token file; give it --token-file with an "
                    "admin=PATTERN grant to use them from elsewhere"
                )
            return
        if not self.grant.may_administer(model_id):
            raise PermissionDenied(
                f"this token may not administer model {model_id!r}: its line in the token file "
                "needs admin=PATTERN matching it"
            )

    def check_publish(self, model_id: str, *, allowed_openly: bool) -> None:
        """Publishing: with tokens, a ``publish=`` pattern must match the model; without a
        token file, only a server started with ``--allow-publish`` takes publishes."""
        if self.grant is None:
            if not allowed_openly:
                raise PermissionDenied(
                    "this server takes no publishes: start it with a --token-file whose line "
                    "for your token grants publish=PATTERN, or with --allow-publish"
                )
            return
        if not self.grant.may_publish(model_id):
            raise PermissionDenied(
                f"this token may not publish model {model_id!r}: its line in the token file "
                "needs publish=PATTERN matching it"
            )

    def check_hold(self, model_id: str) -> str:
        """Holding a revision: with tokens, the grant needs ``hold=`` or ``publish=`` for the
        model (read access is not enough: a hold keeps disk the operator's retention would
        free); without a token file, anyone who may read (holds are bounded in time). The
        holder's identity with tokens: the token's."""
        self.check(model_id)
        if self.grant is None:
            return ""
        if not self.grant.may_hold(model_id):
            raise PermissionDenied(
                f"this token may not hold revisions of model {model_id!r}: its line in the "
                "token file needs hold=PATTERN (or publish=PATTERN) matching it"
            )
        return self.grant.identity


OPEN_ACCESS = Access(None)


def authorize(store: TokenStore | None, authorization: str | None) -> Access:
    return OPEN_ACCESS if store is None else Access(store.grant(authorization))
