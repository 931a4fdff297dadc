"""The protocols offered to MAX: ``RemoteWeights`` (MAX's ``Weights``), its weight types, and
``load_weights`` / ``weights_format`` for URLs. The one place that imports ``max``. Private."""
