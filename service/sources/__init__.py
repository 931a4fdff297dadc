"""Where a model's bytes come from: the local directory catalog (layout rules, mapped files,
read leases, revisions), origins (object storage, an upstream weightserve) and the node cache."""
