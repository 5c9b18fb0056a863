"""Exact Keras evaluation of padded batches: padding counts for nothing.

The sharder pads the last evaluation batch (static shapes) with sample
weight 0, but Keras 3.15's `evaluate` still counts it: the loss tracker
weighs batch losses by batch size, padding included, and `metrics=` (unlike
`weighted_metrics=`) never see sample weights (`CompileMetrics.update_state`).

While a model under a replicator evaluates sharder-padded data
(`replicator.distribute(..., mode="eval")`, or a dataset from a
`kr.data.shard(..., mode="eval")` input function), the test step installed
here treats weight-0 examples as absent: the loss averages real examples,
and unweighted metrics get the 0/1 mask as weight. Any other evaluation,
the user's own zero weights included, runs Keras' step.

This patch owns `test_step`; `trainer_loops` owns `evaluate` and calls
`prepare` here first.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras.src import tree
from keras.src.losses import loss as loss_module

from keras_replicator._src import upstream
from keras_replicator._src.core import markers
from keras_replicator._src.core import traits
from keras_replicator._src.patches import registry

# Set on a model while it evaluates padded data; read when the test
# function is traced.
_EXACT_ATTR = "_keras_replicator_exact_eval"


def prepare(model, x) -> None:
    """Before `model.evaluate(x)`: exact steps if the sharder padded `x`."""
    exact = markers.is_padded(x)
    if getattr(model, _EXACT_ATTR, False) != exact:
        setattr(model, _EXACT_ATTR, exact)
        # The test step reads the flag when traced: trace it again.
        model.test_function = None


def _exact_test_step(original, self, data):
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    compile_metrics = self._compile_metrics
    if (
        not getattr(self, _EXACT_ATTR, False)
        or not traits.is_ours(self.distribute_strategy)
        or sample_weight is None
        or tree.is_nested(sample_weight)
        or type(self).compute_metrics
        is not upstream.BaseTrainer.compute_metrics
    ):
        return original(self, data)
    if self._call_has_training_arg:
        y_pred = self(x, training=False)
    else:
        y_pred = self(x)
    loss = self._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False
    )
    present = tf.not_equal(sample_weight, 0)
    if present.shape.rank and present.shape.rank > 1:
        present = tf.reduce_any(
            present, axis=list(range(1, present.shape.rank))
        )
    mask = tf.cast(present, "float32")
    real = tf.reduce_sum(mask)
    if self._loss_tracker is not None and loss is not None:
        # Keras divided the summed loss by the batch size; re-average it over
        # the real examples, and weight the batch by their number.
        batch = tf.cast(tf.shape(mask)[0], "float32")
        mean = loss_module.unscale_loss_for_distribution(
            tf.cast(loss, "float32")
        )
        self._loss_tracker.update_state(
            tf.math.divide_no_nan(mean * batch, real), sample_weight=real
        )
    if compile_metrics is not None:
        _update_compile_metrics(compile_metrics, y, y_pred, sample_weight, mask)
    return self.get_metrics_result()


def _update_compile_metrics(compile_metrics, y, y_pred, sample_weight, mask):
    """`CompileMetrics.update_state`, with the mask for unweighted metrics."""
    if not compile_metrics.built:
        compile_metrics.build(y, y_pred)
    # Keras 3.14's `CompileMetrics` has no `_flatten_y` (3.10 to 3.13 and
    # 3.15 have it): it flattens with `tree.flatten`.
    # TODO: delete when the oldest supported Keras is 3.15.
    flatten = getattr(compile_metrics, "_flatten_y", tree.flatten)
    y_true = flatten(y)
    y_pred = flatten(y_pred)
    for metrics, weight in (
        (compile_metrics._flat_metrics, mask),  # noqa: SLF001
        (compile_metrics._flat_weighted_metrics, sample_weight),  # noqa: SLF001
    ):
        for metric, y_t, y_p in zip(metrics, y_true, y_pred, strict=False):
            if metric:
                metric.update_state(y_t, y_p, sample_weight=weight)


PATCH = registry.register(
    registry.Patch(
        name="exact_eval",
        targets=(
            registry.Target(
                upstream.TensorFlowTrainer, "test_step", _exact_test_step
            ),
        ),
        applies_to=frozenset({"local", "multi_worker", "tpu"}),
        # The stock test step and `CompileMetrics.update_state`, which
        # `_exact_test_step` and `_update_compile_metrics` mirror.
        pins=(
            registry.Pin(
                "keras.src.backend.tensorflow.trainer",
                (
                    "def test_step(self, data):",
                    "x, y, sample_weight = data_adapter_utils.unpack_x_y_"
                    "sample_weight(data)",
                    "loss = self._compute_loss(",
                    "x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, "
                    "training=False",
                    "loss_module.unscale_loss_for_distribution(loss),",
                    "return self.compute_metrics(x, y, y_pred, "
                    "sample_weight=sample_weight)",
                ),
                attributes=(f"{upstream.TF_TRAINER}._compute_loss",),
            ),
            # The loss tracker's weight: the batch size, from the first
            # input (that is not None, since Keras 3.12).
            registry.Pin(
                "keras.src.backend.tensorflow.trainer",
                ("next(i for i in tree.flatten(x) if i is not None)",),
                keras=">=3.12",
            ),
            registry.Pin(
                "keras.src.backend.tensorflow.trainer",
                ("sample_weight=tf.shape(tree.flatten(x)[0])[0],",),
                keras="<3.12",
            ),
            registry.Pin(
                "keras.src.trainers.compile_utils",
                ("y_true = self._flatten_y(y_true)",),
                keras="!=3.14.*",
            ),
            registry.Pin(
                "keras.src.trainers.compile_utils",
                ("y_true = tree.flatten(y_true)",),
                keras="==3.14.*",
            ),
            registry.Pin(
                "keras.src.trainers.compile_utils",
                (
                    "for m, y_t, y_p in zip(self._flat_metrics, y_true, "
                    "y_pred):",
                    "m.update_state(y_t, y_p)",
                    "self._flat_weighted_metrics, y_true, y_pred, "
                    "sample_weight",
                    "m.update_state(y_t, y_p, s_w)",
                ),
            ),
        ),
        delete_when=(
            "Keras weights the loss tracker by the batch's total sample "
            "weight and passes sample weights to unweighted metrics when "
            "they mask padding"
        ),
    )
)
