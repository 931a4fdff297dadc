"""weightserve service: the catalog, checkpoint format readers and the HTTP and gRPC transports."""
