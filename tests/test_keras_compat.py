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
