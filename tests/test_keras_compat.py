"""The keras_compat patch: reversible, stock for other strategies."""

import inspect

import tensorflow as tf
from keras.src.backend.tensorflow import trainer

from keras_replicator._src.patches import keras_compat


def test_keras_trainer_detects_multi_worker_by_isinstance():
    # Our replicator reaches the multi-worker branches only because it is a
    # MultiWorkerMirroredStrategy subclass.
    source = inspect.getsource(trainer._collective_all_reduce_multi_worker)
    assert (
        "isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)"
        in (source)
    )


def test_install_is_reversible_and_uninstall_restores_stock(restore_patches):
    registry = restore_patches
    registry.uninstall_all()
    stock_reduce = trainer.reduce_per_replica
    stock_build = trainer.TensorFlowTrainer._maybe_symbolic_build
    registry.install(["keras_compat"])
    registry.install(["keras_compat"])  # idempotent
    assert trainer.reduce_per_replica is not stock_reduce
    registry.uninstall(["keras_compat"])
    assert trainer.reduce_per_replica is stock_reduce
    assert trainer.TensorFlowTrainer._maybe_symbolic_build is stock_build


def test_installed_reduce_leaves_other_strategies_stock(restore_patches):
    # A MirroredStrategy is not ours: its logs take Keras' own path and get
    # the same numbers as with the stock function.
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    per_replica = strategy.run(
        lambda: {
            "loss": tf.cast(
                tf.distribute.get_replica_context().replica_id_in_sync_group,
                "float32",
            ),
            "acc": tf.constant(0.5),
        }
    )
    restore_patches.install(["keras_compat"])
    got = trainer.reduce_per_replica(per_replica, strategy, "auto")
    restore_patches.uninstall(["keras_compat"])
    expected = trainer.reduce_per_replica(per_replica, strategy, "auto")
    assert sorted(got) == ["acc", "loss"]
    for key in got:
        assert float(got[key]) == float(expected[key])
    assert float(got["loss"]) == 0.5


def test_fully_built_only_after_model_loss_metrics_and_optimizer_are():
    import keras
    import numpy as np

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse", metrics=["mae"])
    # Layers are built, compiled loss, metrics and optimizer are not.
    assert not keras_compat._fully_built(model)
    model.fit(np.ones((4, 3)), np.ones((4, 2)), verbose=0)
    assert keras_compat._fully_built(model)


def _steps_seen(scope, fit_args):
    """The labels of each replica batch `fit` trains on, in order."""
    import keras

    seen = []

    class Recorder(keras.Model):
        def train_step(self, data):
            tf.py_function(
                lambda y: seen.append(y.numpy().tolist()), [data[1]], []
            )
            return super().train_step(data)

    keras.utils.set_random_seed(3)
    with scope:
        inputs = keras.Input((1,))
        model = Recorder(inputs, keras.layers.Dense(1)(inputs))
        model.compile("sgd", "mse")
    model.fit(**fit_args(), epochs=2, verbose=0, shuffle=False)
    return seen, model.get_weights()


def test_a_reshuffled_dataset_sees_one_devices_orders():
    """The first build reads shapes from the spec, pulling no batch.

    A dataset that reshuffles each iteration draws a new order per
    iterator. Stock Keras under a strategy pulls a batch from one extra
    iterator to build the model, so its epochs see orders 1 and 3 where one
    device (which builds while tracing) sees 0 and 2. Ours see 0 and 2.
    """
    import numpy as np

    import keras_replicator as kr

    def fit_args():
        examples = tf.data.Dataset.range(16).map(
            lambda i: (tf.cast(i, tf.float32)[None], i)
        )
        return {"x": examples.shuffle(16, seed=1).batch(8)}

    def flat(steps):
        return [label for batch in steps for label in batch]

    one, one_weights = _steps_seen(
        tf.distribute.get_strategy().scope(), fit_args
    )
    ours, our_weights = _steps_seen(kr.LocalReplicator(2).scope(), fit_args)
    stock, _ = _steps_seen(
        tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"]).scope(), fit_args
    )
    assert flat(ours) == flat(one)
    for a, e in zip(our_weights, one_weights, strict=True):
        np.testing.assert_allclose(a, e, atol=1e-6, rtol=0)
    # Stock's first epoch is one device's second order: the wasted iterator.
    assert flat(stock)[:16] != flat(one)[:16]
    assert sorted(flat(stock)[:16]) == list(range(16))


def test_a_reshuffled_dataset_trains_as_one_device_under_model_parallel():
    import keras
    import numpy as np

    def fit(distribution):
        keras.distribution.set_distribution(distribution)
        try:
            keras.utils.set_random_seed(11)
            model = keras.Sequential(
                [
                    keras.Input((12,)),
                    keras.layers.Dense(16, activation="relu", name="d1"),
                    keras.layers.Dense(3, name="d2"),
                ]
            )
            model.compile(
                keras.optimizers.Adam(0.01),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
            rng = np.random.default_rng(5)
            x = rng.normal(size=(64, 12)).astype("float32")
            y = rng.integers(0, 3, size=(64,)).astype("int32")
            data = tf.data.Dataset.from_tensor_slices((x, y))
            data = data.shuffle(64, seed=1).batch(16)
            model.fit(data, epochs=3, verbose=0, shuffle=False)
            return model.get_weights()
        finally:
            keras.distribution.set_distribution(None)

    one_device = fit(None)
    mesh = keras.distribution.DeviceMesh(
        (2, 2), ("batch", "model"), keras.distribution.list_devices()[:4]
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*d1/kernel"] = (None, "model")
    sharded = fit(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    )
    for a, e in zip(sharded, one_device, strict=True):
        np.testing.assert_allclose(a, e, atol=1e-5, rtol=0)
