"""A keras-tuner `RandomSearch` as keras-tuner's guide writes it.

keras-tuner's "Getting started" (`build_model(hp)` with a tuned width and
learning rate, `RandomSearch(..., objective="val_accuracy",
max_trials=...)`, `tuner.search(x, y, epochs=..., validation_data=...)`),
with `distribution_strategy=` given, as its "Distributed tuning" section
says. The data are generated; the search is seeded, and each trial's
model starts from the same seed, so one device and any replicator try the
same hyperparameters from the same weights.
"""

import keras
import numpy as np

MAX_TRIALS = 3


def data(n=128, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)).astype("float32")
    y = (x[:, :3].sum(axis=1) > 0).astype("int32")
    return (x[:96], y[:96]), (x[96:], y[96:])


def build_model(hp):
    keras.utils.set_random_seed(3)
    model = keras.Sequential()
    model.add(keras.Input((16,)))
    model.add(
        keras.layers.Dense(
            units=hp.Int("units", min_value=8, max_value=32, step=8),
            activation="relu",
        )
    )
    model.add(keras.layers.Dense(2, activation="softmax"))
    learning_rate = hp.Float(
        "lr", min_value=1e-3, max_value=1e-1, sampling="log"
    )
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=learning_rate),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def search(directory, distribution_strategy=None):
    """The trials: {trial id: (hyperparameters, val_accuracy, val_loss)}."""
    import keras_tuner

    tuner = keras_tuner.RandomSearch(
        hypermodel=build_model,
        objective="val_accuracy",
        max_trials=MAX_TRIALS,
        seed=1,
        distribution_strategy=distribution_strategy,
        directory=str(directory),
        project_name="search",
        overwrite=True,
    )
    (x, y), (x_val, y_val) = data()
    tuner.search(
        x,
        y,
        epochs=2,
        batch_size=32,
        shuffle=False,
        validation_data=(x_val, y_val),
        verbose=0,
    )
    out = {}
    for trial_id, trial in sorted(tuner.oracle.trials.items()):
        metrics = trial.metrics
        out[trial_id] = (
            dict(trial.hyperparameters.values),
            float(metrics.get_best_value("val_accuracy")),
            float(metrics.get_best_value("val_loss")),
        )
    return out
