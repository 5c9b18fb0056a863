"""Replicator backends: one tf.distribute.Strategy subclass per topology."""
