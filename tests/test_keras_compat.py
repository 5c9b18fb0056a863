"""Guards the Keras internals that keras_compat answers."""

import inspect

import tensorflow as tf
from keras.src.backend.tensorflow import trainer

from keras_replicator._src.patches import keras_compat


def test_keras_trainer_still_makes_the_calls_we_answer():
    # If this fails, Keras changed how its TF trainer reduces under a
    # multi-worker strategy: re-check keras_compat against the new code and
    # run tests/multi_worker/test_fit.py.
    source = inspect.getsource(trainer)
    for line in keras_compat.KERAS_TRAINER_CALLS:
        assert line in source, line


def test_symbolic_build_still_checks_what_fully_built_checks():
    # keras_compat._fully_built mirrors these checks: if they change, so
    # must it (else a fit could skip a build Keras still needs).
    from keras.src.trainers import trainer as base_trainer

    source = inspect.getsource(base_trainer.Trainer._symbolic_build)
    for line in keras_compat.KERAS_SYMBOLIC_BUILD_CHECKS:
        assert line in source, line


def test_keras_trainer_detects_multi_worker_by_isinstance():
    # Our replicator reaches the multi-worker branches only because it is a
    # MultiWorkerMirroredStrategy subclass.
    source = inspect.getsource(trainer._collective_all_reduce_multi_worker)
    assert (
        "isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)"
        in (source)
    )


def test_install_is_reversible_and_uninstall_restores_stock():
    keras_compat.install()
    keras_compat.install()  # idempotent
    assert trainer.reduce_per_replica is not (
        keras_compat._stock_reduce_per_replica
    )
    keras_compat.uninstall()
    assert trainer.reduce_per_replica is keras_compat._stock_reduce_per_replica
    assert trainer.TensorFlowTrainer._maybe_symbolic_build is (
        keras_compat._stock_maybe_symbolic_build
    )


def test_installed_reduce_leaves_other_strategies_stock():
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
    keras_compat.install()
    try:
        got = trainer.reduce_per_replica(per_replica, strategy, "auto")
    finally:
        keras_compat.uninstall()
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
