"""Every replacement of a Keras/TensorFlow attribute, in one registry.

Importing this package registers every patch (`registry.patches()`);
replicators install the ones of their kind (`install_for`). See
`registry.py` for what a patch declares.
"""

from keras_replicator._src.patches import atomic_assign
from keras_replicator._src.patches import backup_and_restore
from keras_replicator._src.patches import backup_guard
from keras_replicator._src.patches import batch_statistics
from keras_replicator._src.patches import chief_only
from keras_replicator._src.patches import chief_saves
from keras_replicator._src.patches import compiled_updates
from keras_replicator._src.patches import exact_eval
from keras_replicator._src.patches import iterator_teardown
from keras_replicator._src.patches import keras_compat
from keras_replicator._src.patches import keras_distribution
from keras_replicator._src.patches import loop_beats
from keras_replicator._src.patches import nested_collectives
from keras_replicator._src.patches import per_replica_jit
from keras_replicator._src.patches import plain_iterator
from keras_replicator._src.patches import registry
from keras_replicator._src.patches import replica_mean
from keras_replicator._src.patches import shard_state
from keras_replicator._src.patches import sharded_variables
from keras_replicator._src.patches import trainer_loops
from keras_replicator._src.patches import upstream_pins

__all__ = (
    "atomic_assign",
    "backup_and_restore",
    "backup_guard",
    "batch_statistics",
    "chief_only",
    "chief_saves",
    "compiled_updates",
    "exact_eval",
    "install_for",
    "iterator_teardown",
    "keras_compat",
    "keras_distribution",
    "loop_beats",
    "nested_collectives",
    "per_replica_jit",
    "plain_iterator",
    "registry",
    "replica_mean",
    "shard_state",
    "sharded_variables",
    "trainer_loops",
    "upstream_pins",
)


# A TensorFlow or Keras newer than the supported range: accepted with a
# warning if every pin holds, refused otherwise.
registry.check_pins()


def install_for(kind: str) -> None:
    """Installs every patch that replicators of `kind` need (idempotent)."""
    registry.install(registry.for_kind(kind))
