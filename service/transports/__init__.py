"""Which transport carries a request: HTTP (FastAPI), gRPC, Arrow Flight and the same-node
handoff. Each decodes its wire form, calls serving, and encodes the answer."""
