"""Keras 3 compatibility for multi-worker strategies."""

from __future__ import annotations


class KerasCompatMixin:
    """Placeholder."""
