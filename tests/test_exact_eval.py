"""The exact-evaluation test step: scoped, reversible, pinned to Keras."""

import hashlib
import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.trainers import compile_utils

import keras_replicator as kr
from keras_replicator._src.patches import exact_eval

# sha256 of the Keras 3.15 code that exact_eval mirrors. When a Keras upgrade
# changes it, re-read exact_eval against the new code, then update these.
STOCK_TEST_STEP = (
    "a8f04a25512e74e247e95fbfb6b8a0900d9f5028d36f06bf44b20ae028bfa87c"
)


def _sha(fn):
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()


def test_patched_keras_code_is_unchanged():
    assert _sha(exact_eval._stock_test_step) == STOCK_TEST_STEP, (
        "Keras' TensorFlowTrainer.test_step changed: re-check exact_eval."
    )
    source = inspect.getsource(compile_utils.CompileMetrics.update_state)
    # exact_eval re-implements this loop with a mask for unweighted metrics.
    assert "for m, y_t, y_p in zip(self._flat_metrics, y_true, y_pred):" in (
        source
    )
    assert "m.update_state(y_t, y_p)\n" in source


X = np.arange(12, dtype="float32").reshape(6, 2)
Y = np.array([0, 1, 0, 1, 1, 0], dtype="int32")


def _model(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((2,)), keras.layers.Dense(2, activation="softmax")]
        )
        model.compile(
            "sgd", "sparse_categorical_crossentropy", metrics=["accuracy"]
        )
    return model


def _user_weighted_eval(strategy):
    # The user's own zero weights: Keras counts these rows in `metrics=`.
    weights = np.array([1, 1, 1, 1, 0, 0], dtype="float32")
    return _model(strategy).evaluate(
        X, Y, sample_weight=weights, batch_size=6, verbose=0
    )


def test_users_zero_weights_keep_stock_keras_semantics():
    exact_eval.install()
    try:
        # Same numbers under a replicator as on one device: only data the
        # sharder padded takes the exact path.
        np.testing.assert_allclose(
            _user_weighted_eval(kr.LocalReplicator(2)),
            _user_weighted_eval(tf.distribute.get_strategy()),
            rtol=1e-6,
        )
    finally:
        exact_eval.uninstall()


def test_sharder_padding_counts_for_nothing():
    replicator = kr.LocalReplicator(2)
    model = _model(replicator)
    expected = np.mean(np.argmax(model.predict(X, verbose=0), -1) == Y)
    examples = tf.data.Dataset.from_tensor_slices((X, Y))
    # 6 examples, global batch 4, static shapes: the last batch is padded.
    dist = replicator.distribute(examples, 4, mode="eval", static_shapes=True)
    assert getattr(dist, exact_eval.PADDED_ATTR)
    _, accuracy = model.evaluate(dist, verbose=0)
    assert accuracy == pytest.approx(expected, abs=1e-6)
    # The same through the user's own distribute_datasets_from_function.
    input_fn = kr.data.shard(examples, 4, mode="eval", static_shapes=True)
    own = replicator.distribute_datasets_from_function(input_fn)
    _, accuracy = model.evaluate(own, steps=2, verbose=0)
    assert accuracy == pytest.approx(expected, abs=1e-6)


def test_install_and_uninstall_swap_keras_methods():
    exact_eval.install()
    assert tf_trainer.TensorFlowTrainer.test_step is exact_eval._exact_test_step
    exact_eval.uninstall()
    assert tf_trainer.TensorFlowTrainer.test_step is exact_eval._stock_test_step
    assert tf_trainer.TensorFlowTrainer.evaluate is exact_eval._stock_evaluate
