"""Collectives inside `tf.cond`: the fix `steps_per_execution > 1` needs.

Under `MirroredStrategy` or `MultiWorkerMirroredStrategy` with collective
all-reduce (CPU replicas and workers), `fit` with `steps_per_execution > 1`
fails on its first step, for every model, with

    INVALID_ARGUMENT: You must feed a value for placeholder tensor
    'while/cond/Placeholder_12'

(keras-team/keras#19246 for synchronized batch norm; the gradients'
all-reduce alone triggers it). From TF 2.21's sources:

1. A collective's instance key is fresh per call:
   `CollectiveReplicaLauncher._next_instance_key` asks the graph for a
   call-time capture (`FuncGraph.capture_call_time_value`), a placeholder
   fed a new key at each run.
2. With `steps_per_execution > 1` Keras calls its step function inside
   `tf.cond` inside `tf.while_loop` (`multi_step_on_iterator`); calling it
   there re-registers its call-time captures on the `tf.cond` branch graph.
3. `tf.while_loop` resolves its body's call-time captures; `tf.cond` ignores
   its branches', leaving a placeholder nobody feeds.

The fix registers a capture asked in a `tf.cond` branch on the graph around
it (recursively, up to the function or loop body, which resolve them) and
captures it into the branch as a tensor, as TF's launcher does for control
flow ("Control flow ops don't work with capture_call_time_value, so we put
the capture in the function graph of that control flow op",
`cross_device_utils.py`). A capture left on a branch can only fail.

TODO(keras-replicator): remove once `cond_v2` resolves deferred captures of
its branches; `tests/test_cross_replica_batch_norm.py` shows whether it is
still needed (`test_fit_steps_per_execution_needs_cond_fix`).
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.ops import control_flow_v2_func_graphs as cf_graphs

from keras_replicator._src.patches import registry


def _capture(
    original,
    self,
    closure,
    spec,
    key=None,
    default_value=None,
    placeholder=None,
):
    if placeholder is not None:
        # Loading a SavedModel passes its own placeholder; keep TF's path.
        return original(self, closure, spec, key, default_value, placeholder)
    outer = self.outer_graph
    with outer.as_default():
        outer_value = outer.capture_call_time_value(
            closure, spec, key=key, default_value=default_value
        )
    with self.as_default():
        return tf.nest.map_structure(self.capture, outer_value)


PATCH = registry.register(
    registry.Patch(
        name="nested_collectives",
        targets=(
            registry.Target(
                cf_graphs.CondBranchFuncGraph,
                "capture_call_time_value",
                _capture,
            ),
        ),
        applies_to=frozenset({"local", "multi_worker"}),
        pins=(
            registry.Pin(
                "tensorflow.python.framework.func_graph",
                ("def capture_call_time_value(",),
            ),
            registry.Pin(
                "tensorflow.python.distribute.cross_device_utils",
                ("capture_call_time_value(",),
            ),
        ),
        delete_when=(
            "cond_v2 resolves the deferred captures of its branch graphs "
            "(keras-team/keras#19246); "
            "test_fit_steps_per_execution_needs_cond_fix shows whether it "
            "is still needed"
        ),
    )
)
