"""An origin (object storage, an upstream weightserve) and its catalog through the node
cache: listing, metadata without a fill, past revisions, following, the operator's controls."""
