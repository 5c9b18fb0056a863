"""Implementation of keras_replicator. Private: import from the package root."""
