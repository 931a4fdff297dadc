"""How the client reaches a server: one ``Transport`` seam, with HTTP, gRPC, Arrow Flight and
the same-node handoff behind it, and the choice of data plane. Private to the client."""
