"""Checkpoint format readers, one module per format behind ``FormatReader``."""

from weightserve.service.readers.base import FormatReader, ModelContents, TensorEntry

__all__ = ["FormatReader", "ModelContents", "TensorEntry"]
