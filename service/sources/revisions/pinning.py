"""Which revision a load names: ``ID@R`` picks one of the revisions a source holds of ``ID``.

``R`` is a ref (``main``: the model's files as they are now; a hub cache's other refs and
snapshot commits, by name) or content: the 16-hex revision, the 40-hex commit, or a prefix of
at least ``MIN_PREFIX_CHARS`` hex digits of either (service/sources/revisions/content.py says what
they name). ``pick_revision`` is the one rule every source answers ``ID@R`` by;
``names_content`` the one test of a pin a stream, a file read or a handoff carries.
"""

from __future__ import annotations

from collections.abc import Mapping

from weightserve.client.errors import InvalidRequest, RevisionNotFound
from weightserve.client.wire.routes import (
    HEX_DIGITS,
    MAIN_REVISION,
    MIN_PREFIX_CHARS,
    is_content_name,
)
from weightserve.service.sources.model import Model


def names_content(model: Model, name: str) -> bool:
    """Whether ``name`` (the revision, the commit, or a prefix of at least
    ``MIN_PREFIX_CHARS`` hex digits of them) names the model's content."""
    return is_content_name(name) and model.revision_digest().startswith(name.lower())


def pick_revision(model_id: str, revision: str, held: Mapping[str, Model]) -> Model:
    """The model ``revision`` names among ``held``, the revisions a source holds of
    ``model_id`` by ref name (``main`` first): a ref by its name, else content by its
    revision, commit or a prefix of them. RevisionNotFound names what is held;
    InvalidRequest for a hex name too short to be a prefix, or one that starts two commits."""
    found = held.get(revision)
    if found is not None:
        return found
    if revision and set(revision.lower()) <= HEX_DIGITS:
        if len(revision) < MIN_PREFIX_CHARS:
            raise InvalidRequest(
                f"revision {revision!r} of model {model_id!r} is too short: give a ref "
                f"('{MAIN_REVISION}'), the commit or at least {MIN_PREFIX_CHARS} hex digits of it"
            )
        matches: dict[str, Model] = {}
        for model in held.values():
            if names_content(model, revision):
                matches.setdefault(model.commit, model)
        if len(matches) == 1:
            return next(iter(matches.values()))
        if matches:
            raise InvalidRequest(
                f"revision {revision!r} of model {model_id!r} is ambiguous: it starts the "
                f"commits {', '.join(sorted(matches))}; give more digits"
            )
    raise RevisionNotFound(
        f"model {model_id!r} has no revision {revision!r} on this server; it holds "
        f"{held_revisions(held)}. A server serves the revisions whose files it holds: load "
        f"one of those (or '{MAIN_REVISION}'), or a server that holds {revision!r}"
    )


def held_revisions(held: Mapping[str, Model]) -> str:
    """The revisions held, for a message: ``main (commit C)``, a hub ref ``v1 (commit C)``."""
    return ", ".join(f"{name} (commit {model.commit})" for name, model in held.items())
