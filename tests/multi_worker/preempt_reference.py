"""The model and data of the preemption tests, shared by tests and workers.

3 epochs of 8 steps of global batch 8: a tiny regression whose Adam state
and shuffled data order must both continue exactly after a resume.
"""

import json

import keras
import numpy as np
import tensorflow as tf

STEPS_PER_EPOCH = 8
EPOCHS = 3
GLOBAL_BATCH = 8
TOTAL_STEPS = STEPS_PER_EPOCH * EPOCHS
# "repeated": an endless dataset with `steps_per_epoch`, whose one iterator
# Keras keeps across epochs.
DATA_KINDS = ("arrays", "dataset", "distribute", "repeated")


def build(replicator):
    """The model, compiled under `replicator`, seeded."""
    keras.utils.set_random_seed(0)
    with replicator.scope():
        model = keras.Sequential(
            [
                keras.Input((5,)),
                keras.layers.Dense(4, activation="tanh"),
                keras.layers.Dense(1),
            ]
        )
        model.compile(keras.optimizers.Adam(0.05), "mse")
    return model


def fit_inputs(kind, replicator):
    """`fit` arguments: shuffled arrays, a reshuffled dataset, or ours."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS_PER_EPOCH * GLOBAL_BATCH, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")
    if kind == "arrays":
        return {"x": x, "y": y, "batch_size": GLOBAL_BATCH, "shuffle": True}
    if kind in ("dataset", "repeated"):
        dataset = (
            tf.data.Dataset.from_tensor_slices((x, y))
            .shuffle(len(x), seed=1, reshuffle_each_iteration=True)
            .batch(GLOBAL_BATCH)
        )
        if kind == "dataset":
            return {"x": dataset, "shuffle": False}
        return {
            "x": dataset.repeat(),
            "steps_per_epoch": STEPS_PER_EPOCH,
            "shuffle": False,
        }
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    distributed = replicator.distribute(dataset, GLOBAL_BATCH, shuffle_seed=1)
    return {"x": distributed, "shuffle": False}


class Probe(keras.callbacks.Callback):
    """Records the (epoch, batch) of every step; calls `at_step(step)`.

    `step` counts from the first step of the whole training (1-based), so
    a resumed fit sees the same numbers as an uninterrupted one.
    """

    def __init__(self, at_step=None):
        super().__init__()
        self.trained = []
        self._epoch = 0
        self._at_step = at_step

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.trained.append((self._epoch, batch))
        if self._at_step is not None:
            self._at_step(self._epoch * STEPS_PER_EPOCH + batch + 1)


def reference_weights(strategy=None):
    """The weights of an uninterrupted fit on `strategy` (default: none)."""
    strategy = strategy or tf.distribute.get_strategy()
    model = build(strategy)
    model.fit(**fit_inputs("arrays", None), epochs=EPOCHS, verbose=0)
    return model.get_weights()


def backup_step(backup):
    """The step of the whole training a backup was written at (1-based)."""
    sharded = backup / "sharded" / "index.json"
    if sharded.exists():
        # A ModelParallel backup: the position is in the checkpoint's index.
        metadata = json.loads(sharded.read_text())["metadata"]
    else:
        metadata = json.loads((backup / "training_metadata.json").read_text())
    ours = metadata["keras_replicator"]
    return ours["epoch"] * STEPS_PER_EPOCH + ours["steps_done"]


def step_of(epoch_batch):
    """The 0-based step of the whole training of an (epoch, batch) pair."""
    epoch, batch = epoch_batch
    return epoch * STEPS_PER_EPOCH + batch


def assert_weights(result, expected, atol=1e-5):
    """Asserts a worker's reported weights equal `expected` within `atol`."""
    assert result is not None and "weights" in result, result
    for i, (a, e) in enumerate(zip(result["weights"], expected, strict=True)):
        np.testing.assert_allclose(
            np.array(a), e, atol=atol, rtol=0, err_msg=f"weight {i}"
        )
