"""The optimizer's hooks of sharded optimizer state (ZeRO stage 1).

What a sharded optimizer is, and how it updates, saves and loads its flat
shards, is `sharding/optimizer_shards.py`. Here, only where Keras lets it
in, each replacement running the stock code for any other optimizer:

- `BaseOptimizer.build` makes a shadow (a weight's flat shard) per model
  variable (`optimizer_shards.build`);
- `TFOptimizer.add_variable_from_reference` makes each slot a flat shard,
  and the slot of a variable ModelParallel stores in blocks in blocks too,
  on that storage's devices;
- `BaseOptimizer.save_own_variables` and `load_own_variables` save whole
  slots and load each replica's shard, so a checkpoint restores on any
  replica count, sharded or not.

`replica_mean` calls `optimizer_shards.apply` in the replica step.
"""

from __future__ import annotations

from keras.src.backend.tensorflow import optimizer as tf_optimizer
from keras.src.optimizers import base_optimizer

from keras_replicator._src.core import placements
from keras_replicator._src.patches import registry
from keras_replicator._src.sharding import optimizer_shards

KINDS = frozenset({"local", "multi_worker"})


def _add_variable_from_reference(
    original, self, reference_variable, name=None, initializer="zeros"
):
    if placements.of(reference_variable) is not None:
        # A variable ModelParallel stores in blocks (`sharded_variables`):
        # its slot is made in blocks too (it inherits the layout), on the
        # storage's devices. The stock code colocates with
        # `reference_variable.value`, which is the full value here.
        with self._distribution_strategy.extended.colocate_vars_with(
            reference_variable._value
        ):
            return base_optimizer.BaseOptimizer.add_variable_from_reference(
                self, reference_variable, name=name, initializer=initializer
            )
    if not optimizer_shards.is_sharded(self):
        return original(
            self, reference_variable, name=name, initializer=initializer
        )
    return optimizer_shards.make_slot(
        self, reference_variable, name=name, initializer=initializer
    )


def _save_own_variables(original, self, store):
    if not optimizer_shards.is_sharded(self):
        return original(self, store)
    return optimizer_shards.save_state(self, store)


def _load_own_variables(original, self, store):
    if not optimizer_shards.is_sharded(self) or len(store.keys()) != len(
        self.variables
    ):
        # Stock Keras warns and skips on a count mismatch: its warning is
        # attributed to Keras' caller, not to this line.
        return registry.call_original(original, self, store)
    return optimizer_shards.load_state(self, store)


PATCH = registry.register(
    registry.Patch(
        name="shard_state",
        targets=(
            registry.Target(
                base_optimizer.BaseOptimizer, "build", optimizer_shards.build
            ),
            registry.Target(
                tf_optimizer.TFOptimizer,
                "add_variable_from_reference",
                _add_variable_from_reference,
            ),
            registry.Target(
                base_optimizer.BaseOptimizer,
                "save_own_variables",
                _save_own_variables,
            ),
            registry.Target(
                base_optimizer.BaseOptimizer,
                "load_own_variables",
                _load_own_variables,
            ),
        ),
        applies_to=KINDS,
        pins=(
            registry.Pin(
                "keras.src.optimizers.base_optimizer",
                (
                    # The slots of a variable are found through its key.
                    "def _get_variable_index(self, variable):",
                    "if self._var_key(v) not in "
                    "self._trainable_variables_indices:",
                    "store[str(i)] = variable.numpy()",
                    "variable.assign(store[str(i)])",
                ),
            ),
        ),
        delete_when=(
            "never: a feature, not a fix (Keras has no sharded optimizer "
            "state on TensorFlow)"
        ),
    )
)
