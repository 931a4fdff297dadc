"""A file version's identity, its one mapping with read leases, its chunk digests, and the
sealed snapshots the same-node handoff maps."""
