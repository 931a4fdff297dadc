"""``POST /v1/models/ID/-/swarm``: a node cache joins the swarm of a revision of a model it may
read (service/sources/swarm/tracker.py; docs/protocol.md, "Peer fills")."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field

from weightserve.client.errors import InvalidRequest, ModelUnavailable
from weightserve.client.wire.routes import with_revision
from weightserve.service.serving.state import ServiceState
from weightserve.service.sources.swarm.tracker import Revision
from weightserve.service.transports.http.common import AccessCheck


class SwarmJoin(BaseModel):
    """A node's announcement: the revision it fills or seeds, where peers reach it, and the
    request for its certificate in that revision's swarm."""

    revision: str | None = Field(None, description="the revision or commit; none: main")
    port: int = Field(..., ge=1, le=65535, description="the node's peer port (TLS)")
    address: str | None = Field(
        None, max_length=255, description="the address peers reach the node at; none: as seen here"
    )
    certificate_request: str = Field(..., max_length=16384, description="a PEM CSR")
    leaving: bool = Field(False, description="the node no longer seeds this revision")
    complete: bool = Field(False, description="the node holds the revision whole (a seed)")


def add_swarm_routes(app: FastAPI, state: ServiceState, access: AccessCheck) -> None:
    @app.post("/v1/models/{model:model_id}/-/swarm", tags=["files"])
    def join_swarm(http: Request, model: str, body: SwarmJoin) -> dict[str, Any]:
        """Join the private swarm of a revision of the model (peer fills between node caches):
        the revision's torrent, a peer certificate signed by its authority, the other nodes
        that joined it lately and the files' digests. Needs read access
        to the model; answers 503 where this server runs no swarm."""
        desk = state.served.swarm_desk
        if desk is None:
            raise ModelUnavailable(state.served.swarm_off or "peer fills are off on this server")
        caller = access(http)
        named = with_revision(model, body.revision)
        found = state.readable_model(caller, named)
        files = found.repo_files.values()
        revision = Revision(
            model=model,
            commit=found.commit,
            revision=found.revision,
            files={f.name: f.path for f in files},
            etags={f.name: found.file_digest(f.path) for f in files},
        )
        address = body.address or (http.client.host if http.client else "")
        if not address:
            raise InvalidRequest("the node's address is unknown: give `address`")
        try:
            return desk.join(
                revision,
                address,
                body.port,
                body.certificate_request.encode(),
                leaving=body.leaving,
                complete=body.complete,
            )
        except ValueError as e:  # the certificate request
            raise InvalidRequest(f"cannot admit the node to the swarm of {model!r}: {e}") from None
