"""`jit_compile=True` on several CPU replicas: XLA compiles each replica."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.backend.tensorflow import trainer as tf_trainer

import keras_replicator as kr
from keras_replicator._src.patches import per_replica_jit
from tests import helpers
from tests.helpers import assert_weights_close

GLOBAL_BATCH = 16


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    return x, y


def _optimizer(name):
    if name == "sgd_momentum":
        return keras.optimizers.SGD(0.1, momentum=0.9)
    return keras.optimizers.Adam(0.01)


def _model(strategy=None, jit=True, optimizer="sgd_momentum", spe=1):
    scope = strategy.scope() if strategy else tf.device("/cpu:0")
    with scope:
        return helpers.jit_dense_model(_optimizer(optimizer), spe, jit)


def _fit_evaluate_predict(model):
    x, y = _data()
    x_val, y_val = _data(32, seed=1)
    history = model.fit(
        x, y, batch_size=GLOBAL_BATCH, epochs=3, shuffle=False, verbose=0
    )
    evaluation = model.evaluate(
        x_val, y_val, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True
    )
    predictions = model.predict(x_val, batch_size=GLOBAL_BATCH, verbose=0)
    return model.get_weights(), history.history, evaluation, predictions


@pytest.mark.parametrize(
    "replicas, optimizer, spe",
    [(2, "sgd_momentum", 1), (4, "adam", 3)],
    ids=["2_sgd_momentum_spe1", "4_adam_spe3"],
)
def test_fit_evaluate_predict_match_single_device_jit(replicas, optimizer, spe):
    expected = _fit_evaluate_predict(_model(None, True, optimizer, spe))
    replicator = kr.LocalReplicator(replicas)
    got = _fit_evaluate_predict(_model(replicator, True, optimizer, spe))
    weights, history, evaluation, predictions = got
    assert_weights_close(weights, expected[0])
    assert sorted(history) == sorted(expected[1]) == ["loss", "mae"]
    for key, values in expected[1].items():
        helpers.assert_close(history[key], values, key)
    for key, value in expected[2].items():
        helpers.assert_close(evaluation[key], value, f"evaluate {key}")
    helpers.assert_close(predictions, expected[3], "predictions")


class _StringOps(keras.layers.Layer):
    """Adds 0 computed through string ops, which XLA cannot compile."""

    def call(self, x):
        lengths = tf.strings.length(tf.strings.as_string(x))
        return x + tf.cast(tf.reduce_sum(lengths), x.dtype) * 0.0


def test_xla_really_compiles_each_replica_step():
    replicator = kr.LocalReplicator(2)
    x, y = _data()
    for jit in (False, True):
        with replicator.scope():
            model = keras.Sequential(
                [keras.Input((8,)), _StringOps(), keras.layers.Dense(1)]
            )
            model.compile("sgd", "mse", jit_compile=jit)
        fit = lambda m=model: m.fit(x, y, batch_size=16, epochs=1, verbose=0)  # noqa: E731
        evaluate = lambda m=model: m.evaluate(x, y, batch_size=16, verbose=0)  # noqa: E731
        if not jit:
            fit()
            evaluate()
            continue
        # XLA names the function it failed to compile: ours, per replica.
        for run in (fit, evaluate):
            with pytest.raises(
                tf.errors.InvalidArgumentError,
                match="tf2xla conversion failed while converting "
                "__inference_xla_replica_step",
            ):
                run()


def test_sharded_static_shapes_fit_and_padded_evaluate():
    x, y = _data(128)
    # 50 examples: the last global batch of 16 is padded with 14.
    x_val, y_val = _data(50, seed=2)
    reference = _model(None, True)
    reference.fit(x, y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
    expected = reference.evaluate(
        x_val, y_val, batch_size=50, verbose=0, return_dict=True
    )
    replicator = kr.LocalReplicator(4)
    model = _model(replicator, True)
    train = replicator.distribute(
        tf.data.Dataset.from_tensor_slices((x, y)),
        GLOBAL_BATCH,
        static_shapes=True,
    )
    model.fit(train, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), reference.get_weights())
    val = replicator.distribute(
        tf.data.Dataset.from_tensor_slices((x_val, y_val)),
        GLOBAL_BATCH,
        mode="eval",
        static_shapes=True,
    )
    for spec in tf.nest.flatten(val.element_spec, expand_composites=True):
        assert spec.shape.is_fully_defined(), spec
    got = model.evaluate(val, verbose=0, return_dict=True)
    for key, value in expected.items():
        helpers.assert_close(got[key], value, f"evaluate {key}")


class _TwoOptimizers(keras.Model):
    """A GAN-like step: two optimizers, two updates per step."""

    def __init__(self):
        super().__init__(name="two_optimizers")
        self.first = keras.layers.Dense(4)
        self.second = keras.layers.Dense(1)

    def call(self, x):
        return self.second(self.first(x))

    def compile(self, **kwargs):
        super().compile(**kwargs)
        self.first_optimizer = keras.optimizers.SGD(0.1)
        self.second_optimizer = keras.optimizers.SGD(0.1)

    def train_step(self, data):
        x, y = data
        for optimizer, layer in (
            (self.first_optimizer, self.first),
            (self.second_optimizer, self.second),
        ):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((self(x) - y) ** 2)
            grads = tape.gradient(loss, layer.trainable_weights)
            optimizer.apply_gradients(
                zip(grads, layer.trainable_weights, strict=True)
            )
        return {"loss": loss}


def test_two_optimizer_applies_in_one_step_raise():
    replicator = kr.LocalReplicator(2)
    x, y = _data()
    for jit in (False, True):
        with replicator.scope():
            model = _TwoOptimizers()
            model(np.zeros((1, 8), "float32"))  # builds the layers
            model.compile(loss="mse", jit_compile=jit)
        if not jit:
            model.fit(x, y, batch_size=16, epochs=1, verbose=0)
            continue
        with pytest.raises(ValueError, match="at most once") as info:
            model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        message = str(info.value)
        assert "`jit_compile=False`" in message
        assert "Received: 2 calls to `apply` in one step" in message


def test_collective_inside_the_step_raises():
    replicator = kr.LocalReplicator(2)
    with replicator.scope():
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(4),
                keras.layers.BatchNormalization(synchronized=True),
                keras.layers.Dense(1),
            ]
        )
        model.compile("sgd", "mse", jit_compile=True)
    x, y = _data()
    with pytest.raises(RuntimeError, match="cross-replica all-reduce") as info:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert "`jit_compile=False`" in str(info.value)


def test_other_models_and_strategies_keep_the_stock_path():
    def wants(strategy, **compile_kwargs):
        with strategy.scope():
            model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
            model.compile("sgd", "mse", **compile_kwargs)
        return per_replica_jit._wants_per_replica_jit(model)

    two = kr.LocalReplicator(2)
    assert wants(two, jit_compile=True)
    assert not wants(two, jit_compile=False)
    assert not wants(two, run_eagerly=True)
    assert not wants(kr.LocalReplicator(1), jit_compile=True)
    mirrored = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    assert not wants(mirrored, jit_compile=True)


def test_uninstall_restores_stock_keras(restore_patches):
    registry = restore_patches
    replicator = kr.LocalReplicator(2)  # installs
    registry.install(["per_replica_jit"])  # idempotent
    assert registry.installed("per_replica_jit")
    stock = registry.original(tf_trainer.TensorFlowTrainer, "_make_function")
    x, y = _data()
    registry.uninstall(["per_replica_jit"])
    registry.uninstall(["per_replica_jit"])  # idempotent
    assert tf_trainer.TensorFlowTrainer._make_function is stock
    assert not registry.installed("per_replica_jit")
    # What the patch fixes: stock Keras launches the whole step on one
    # device, which cannot reach replica 1's variables.
    model = _model(replicator)
    with pytest.raises(tf.errors.InvalidArgumentError, match="CPU:1"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    registry.install(["per_replica_jit"])
    assert tf_trainer.TensorFlowTrainer._make_function is not stock
