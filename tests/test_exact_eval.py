"""The exact-evaluation test step: scoped, reversible, pinned to Keras."""

import hashlib
import inspect

import keras
import numpy as np
from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.trainers import compile_utils

import keras_replicator as kr
from keras_replicator._src import exact_eval

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


def _padded_eval(strategy):
    x = np.arange(12, dtype="float32").reshape(6, 2)
    y = np.array([0, 1, 0, 1, 1, 0], dtype="int32")
    weights = np.array([1, 1, 1, 1, 0, 0], dtype="float32")  # 2 padded
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((2,)), keras.layers.Dense(2, activation="softmax")]
        )
        model.compile(
            "sgd", "sparse_categorical_crossentropy", metrics=["accuracy"]
        )
    return model.evaluate(
        x, y, sample_weight=weights, batch_size=6, verbose=0
    ), model


def test_install_is_scoped_to_replicators_and_reversible():
    exact_eval.uninstall()
    assert tf_trainer.TensorFlowTrainer.test_step is exact_eval._stock_test_step
    stock, _ = _padded_eval(_DefaultScope())
    exact_eval.install()
    try:
        plain, _ = _padded_eval(_DefaultScope())
        # A model outside any replicator keeps stock Keras behaviour.
        np.testing.assert_allclose(plain, stock, rtol=1e-6)
        exact, model = _padded_eval(kr.LocalReplicator(2))
        # Under a replicator the two zero-weight rows count for nothing:
        # accuracy over the 4 real rows equals a direct computation.
        predictions = model.predict(
            np.arange(12, dtype="float32").reshape(6, 2)[:4], verbose=0
        )
        expected = np.mean(np.argmax(predictions, -1) == [0, 1, 0, 1])
        assert exact[1] == expected
    finally:
        exact_eval.uninstall()
    assert tf_trainer.TensorFlowTrainer.test_step is exact_eval._stock_test_step


class _DefaultScope:
    def scope(self):
        import contextlib

        return contextlib.nullcontext()
