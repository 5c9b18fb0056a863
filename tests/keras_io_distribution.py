# ruff: noqa: I001 (keras_replicator is imported first, as the guide says)
"""keras.io's guide "Distributed training with Keras 3", as users write it.

The code of its DataParallel and ModelParallel sections
(`keras-io/guides/distribution.py`), unchanged but for the backend: the
guide imports `jax` and takes `jax.devices("gpu")`; here `import
keras_replicator` comes first and the devices are
`keras.distribution.list_devices()` (8 logical CPUs). The dropout rate is a
parameter so that a test can compare with one device (`Dropout(0)`); the
guide's is 0.4. `keras.distribution.ModelParallel` takes `layout_map=` as a
keyword on Keras 3.15 (the 2023 guide passed it positionally).
"""

import keras_replicator  # noqa: F401  (first: splits the CPU, fills the API)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import layers  # noqa: E402
from tensorflow import data as tf_data  # noqa: E402


def devices():
    return keras.distribution.list_devices()


def dataset():
    # The guide's dummy data, seeded here so that runs compare.
    rng = np.random.default_rng(0)
    inputs = rng.normal(size=(128, 28, 28, 1)).astype("float32")
    labels = rng.normal(size=(128, 10)).astype("float32")
    return tf_data.Dataset.from_tensor_slices((inputs, labels)).batch(16)


def model(dropout=0.4):
    inputs = layers.Input(shape=(28, 28, 1))
    y = layers.Flatten()(inputs)
    y = layers.Dense(units=200, use_bias=False, activation="relu", name="d1")(y)
    y = layers.Dropout(dropout)(y)
    y = layers.Dense(units=10, activation="softmax", name="d2")(y)
    return keras.Model(inputs=inputs, outputs=y)


def data_parallel(dropout=0.4, use_mesh=False):
    """The guide's DataParallel section; returns (model, fit history)."""
    if use_mesh:
        mesh_1d = keras.distribution.DeviceMesh(
            shape=(8,), axis_names=["data"], devices=devices()
        )
        data_parallel = keras.distribution.DataParallel(device_mesh=mesh_1d)
    else:
        data_parallel = keras.distribution.DataParallel(devices=devices())
    keras.distribution.set_distribution(data_parallel)
    return _train(dropout)


def model_parallel(dropout=0.4, shape=(2, 4)):
    """The guide's ModelParallel section; returns (model, fit history)."""
    mesh_2d = keras.distribution.DeviceMesh(
        shape=shape, axis_names=["data", "model"], devices=devices()
    )
    layout_map = keras.distribution.LayoutMap(mesh_2d)
    # The rule below means that for any weights that match with d1/kernel, it
    # will be sharded with model dimensions (4 devices), same for the
    # d1/bias. All other weights will be fully replicated.
    layout_map["d1/kernel"] = (None, "model")
    layout_map["d1/bias"] = ("model",)
    # You can also set the layout for the layer output like
    layout_map["d2/output"] = ("data", None)
    model_parallel = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="data"
    )
    keras.distribution.set_distribution(model_parallel)
    return _train(dropout)


def _train(dropout):
    m = model(dropout)
    m.compile(loss="mse")
    history = m.fit(dataset(), epochs=3, verbose=0)
    m.evaluate(dataset(), verbose=0)
    return m, history.history
