"""Phalanx: self-healing foundation-model training on PyTorch."""

__version__ = "0.1.0"
