"""The node cache: an origin's files copied onto this node on request, kept within a size."""
