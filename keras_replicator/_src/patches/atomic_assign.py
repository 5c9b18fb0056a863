"""Atomic `assign_add`/`assign_sub` of Keras variables on parameter servers.

Keras' `Variable.assign_add`/`assign_sub` read the variable, add and write
back: two workers doing that at once lose one update (100 steps on two
workers left `optimizer.iterations` at 81). For variables a
`ParameterServerStrategy` created, the replacement uses the variable's own
atomic `assign_add` (one resource op on the server), so iteration counts and
metric totals are exact. Every other variable takes Keras' stock method.
"""

from __future__ import annotations

import tensorflow as tf
from keras.src.backend.common import variables as common_variables
from tensorflow.python.distribute import ps_values
from tensorflow.python.distribute import sharded_variable

from keras_replicator._src import upstream
from keras_replicator._src.patches import registry

# Variables a ParameterServerStrategy creates (round-robin, one replica per
# worker: CachingVariable; several: AggregatingVariable; partitioned:
# ShardedVariable). Only these get the atomic update.
_PS_VARIABLES = (
    ps_values.CachingVariable,
    ps_values.AggregatingVariable,
    sharded_variable.ShardedVariable,
)


def _atomic(name):
    def method(original, self, value):
        inner = self._value
        if not isinstance(inner, _PS_VARIABLES) or (
            common_variables.in_stateless_scope()
        ):
            return original(self, value)
        value = self._convert_to_tensor(value, dtype=self._dtype)
        # One resource op on the parameter server: atomic, unlike Keras'
        # `self.assign(self + value)` read-modify-write.
        return getattr(inner, name)(tf.cast(value, inner.dtype))

    method.__name__ = name
    return method


PATCH = registry.register(
    registry.Patch(
        name="atomic_assign",
        # The TF Variable class inherits both methods from the common
        # class; uninstalling removes them from it again.
        targets=tuple(
            registry.Target(upstream.tf_core.Variable, name, _atomic(name))
            for name in ("assign_add", "assign_sub")
        ),
        applies_to=frozenset({"async"}),
        pins=(
            registry.Pin(
                "keras.src.backend.common.variables",
                (
                    "def assign_add(self, value):",
                    "self.assign(self + value)",
                    "def assign_sub(self, value):",
                    "self.assign(self - value)",
                ),
            ),
        ),
        delete_when=(
            "Keras' TF Variable delegates assign_add/assign_sub to the "
            "underlying tf.Variable"
        ),
    )
)
