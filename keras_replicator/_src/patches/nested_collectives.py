"""Collectives inside `tf.cond`: the fix `steps_per_execution > 1` needs.

The symptom: under `MirroredStrategy` or `MultiWorkerMirroredStrategy` with
collective all-reduce (what CPU replicas and workers use), `model.fit` with
`steps_per_execution > 1` fails on its first step with

    INVALID_ARGUMENT: You must feed a value for placeholder tensor
    'while/cond/Placeholder_12'

for every model, with or without `BatchNormalization(synchronized=True)`
(keras-team/keras#19246 reports it for synchronized batch norm; the
optimizer's gradient all-reduce alone triggers it too).

The cause, read from TF 2.21's sources:

1. Collective ops take an *instance key* that must be fresh at every call,
   so `CollectiveReplicaLauncher._next_instance_key` does not bake it into
   the traced graph: it asks the function graph for a *call-time capture*
   (`FuncGraph.capture_call_time_value`), a placeholder fed with a new key
   each time the function runs.
2. Keras traces one step as a `tf.function` (`one_step_on_data`). With
   `steps_per_execution > 1` it calls that function inside `tf.cond` inside
   `tf.while_loop` (`multi_step_on_iterator`). Calling a function that has
   call-time captures from inside another function graph re-registers them
   as call-time captures of the *current* graph: here the `tf.cond` branch.
3. `tf.while_loop` resolves the call-time captures of its body graph, but
   `tf.cond` ignores those of its branch graphs, so the branch keeps a
   placeholder nobody feeds.

The fix: a call-time capture requested in a `tf.cond` branch graph is
registered on the graph around the `tf.cond` instead (recursively, up to
the enclosing function or loop body, which do resolve them) and captured
into the branch as an ordinary tensor. That is where TF's own launcher puts
captures it makes directly in control flow ("Control flow ops don't work
with capture_call_time_value, so we put the capture in the function graph
of that control flow op", `cross_device_utils.py`). A capture left on a
branch graph can only fail, so the change cannot break a program that
worked.

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
