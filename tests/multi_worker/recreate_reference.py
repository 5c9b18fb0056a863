"""The model and data of the re-creation tests, shared by tests and workers.

keras.io's multi-worker guide at laptop scale: a small regression, one
epoch of 8 steps of global batch 8 per fit, unshuffled, so that a model
restored from a checkpoint and fitted again continues exactly.
"""

import keras
import numpy as np

GLOBAL_BATCH = 8
STEPS = 8


def get_compiled_model():
    """The guide's `get_compiled_model`, seeded."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(4, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(keras.optimizers.Adam(0.05), "mse")
    return model


def data():
    """`(x, y)`: one epoch."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * GLOBAL_BATCH, 5)).astype("float32")
    return x, (x @ rng.normal(size=(5, 1))).astype("float32")


def fit(model):
    """One epoch, as every fit of the tests."""
    x, y = data()
    model.fit(x, y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)


def evaluate(model):
    x, y = data()
    return model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0)


def reference():
    """One device: the loss after one epoch, then weights and loss after two.

    What the workers report: round 0 evaluates after one epoch, the last
    (odd) round continues round 0's checkpoint for one epoch.
    """
    model = get_compiled_model()
    fit(model)
    first = evaluate(model)
    fit(model)
    return {"losses": [first, evaluate(model)], "weights": model.get_weights()}
