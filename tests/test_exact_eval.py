"""The exact-evaluation test step: scoped, reversible, pinned to Keras."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.backend.tensorflow import trainer as tf_trainer

import keras_replicator as kr
from keras_replicator._src.core import markers

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
    # Same numbers under a replicator (which installs the exact step) as on
    # one device: only data the sharder padded takes the exact path.
    np.testing.assert_allclose(
        _user_weighted_eval(kr.LocalReplicator(2)),
        _user_weighted_eval(tf.distribute.get_strategy()),
        rtol=1e-6,
    )


def test_sharder_padding_counts_for_nothing():
    replicator = kr.LocalReplicator(2)
    model = _model(replicator)
    expected = np.mean(np.argmax(model.predict(X, verbose=0), -1) == Y)
    examples = tf.data.Dataset.from_tensor_slices((X, Y))
    # 6 examples, global batch 4, static shapes: the last batch is padded.
    dist = replicator.distribute(examples, 4, mode="eval", static_shapes=True)
    assert getattr(dist, markers.PADDED_ATTR)
    _, accuracy = model.evaluate(dist, verbose=0)
    assert accuracy == pytest.approx(expected, abs=1e-6)
    # The same through the user's own distribute_datasets_from_function.
    input_fn = kr.data.shard(examples, 4, mode="eval", static_shapes=True)
    own = replicator.distribute_datasets_from_function(input_fn)
    _, accuracy = model.evaluate(own, steps=2, verbose=0)
    assert accuracy == pytest.approx(expected, abs=1e-6)


def test_install_and_uninstall_swap_keras_methods(restore_patches):
    registry = restore_patches
    registry.uninstall_all()
    stock_step = tf_trainer.TensorFlowTrainer.test_step
    stock_evaluate = tf_trainer.TensorFlowTrainer.evaluate
    kr.LocalReplicator(2)
    assert registry.installed("exact_eval")
    assert tf_trainer.TensorFlowTrainer.test_step.__wrapped__ is stock_step
    registry.uninstall_all()
    assert tf_trainer.TensorFlowTrainer.test_step is stock_step
    assert tf_trainer.TensorFlowTrainer.evaluate is stock_evaluate
