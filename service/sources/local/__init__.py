"""A local directory of models: discovery and look-up (the catalog)."""
