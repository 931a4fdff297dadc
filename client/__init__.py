"""weightserve client: fetch model weights from a weightserve server."""
