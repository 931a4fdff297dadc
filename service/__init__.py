"""weightserve service: model sources (local directory, origins, node cache), checkpoint readers,
serving (plan, admission, leases) and the transports: HTTP, gRPC, Arrow Flight, same-node handoff."""
