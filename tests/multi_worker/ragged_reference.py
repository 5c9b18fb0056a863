"""The model, data and meshes of the ragged-last-batch multi-process test.

scikit-learn's 1797 digits at a global batch of 64: 28 whole batches and
a last one of 5 rows, which the processes split as a replicator splits it
over their devices (`patches/keras_distribution.py`); and the first 65 of
them, whose last batch of 1 row leaves every process but the first
without one. Shared by the worker script and the one-device reference.
"""

import keras
import numpy as np
import tensorflow as tf

GLOBAL_BATCH = 64
EPOCHS = 2
# Kernels with a dimension of 48: it divides over a model axis of 2, 3, 4
# or 6 devices.
LAYOUTS = {".*d1/kernel": (None, "model"), ".*d2/kernel": ("model", None)}
# Examples of each run: every digit, and a last batch of one row.
SIZES = {"digits": 1797, "one_row": 65}


def build():
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(48, activation="relu", name="d1"),
            keras.layers.Dense(10, name="d2"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def dataset(name):
    """The first `SIZES[name]` digits in global batches of 64."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")[: SIZES[name]]
    y = digits.target.astype("int32")[: SIZES[name]]
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)


def run(model, name):
    """Fits and evaluates on `dataset(name)`: history, evaluation, weights."""
    data = dataset(name)
    history = model.fit(data, epochs=EPOCHS, shuffle=False, verbose=0)
    evaluation = model.evaluate(data, verbose=0, return_dict=True)
    return {
        "history": history.history,
        "evaluate": evaluation,
        "weights": model.get_weights(),
    }


def one_device_run(folder):
    """The reference: initial weights saved to `folder`, then one device.

    Returns:
        `{"init": <initial weights .npz>, name: run(...) for each name}`.
    """
    model = build()
    init = folder / "init.npz"
    np.savez(init, *model.get_weights())
    report = {"init": init}
    for name in SIZES:
        model = build()
        report[name] = run(model, name)
    return report


def distribution(kind):
    """`"data_parallel"`, or `"model_parallel"` on a (1, devices) mesh."""
    devices = keras.distribution.list_devices()
    if kind == "data_parallel":
        return keras.distribution.DataParallel(devices=devices)
    mesh = keras.distribution.DeviceMesh(
        (1, len(devices)), ("batch", "model"), devices
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, axes in LAYOUTS.items():
        layout_map[key] = axes
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
