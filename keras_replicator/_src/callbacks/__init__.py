"""Callback implementations: sync batch norm, metric reduction, chief-only."""
