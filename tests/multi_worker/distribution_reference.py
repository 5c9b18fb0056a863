"""The model, data and meshes of the keras.distribution multi-worker tests.

Shared by the worker script and the one-device reference. The data is a
`tf.data.Dataset` of GLOBAL batches: under `keras.distribution` on several
processes Keras cuts each global batch by process
(`Distribution.distribute_dataset`), so step t sees the same examples as
step t on one device.
"""

import keras
import numpy as np
import tensorflow as tf

GLOBAL_BATCH = 16
EPOCHS = 2
LAYOUTS = {".*d1/kernel": (None, "model"), ".*d2/kernel": ("model", None)}


def build():
    keras.utils.set_random_seed(11)
    model = keras.Sequential(
        [
            keras.Input((12,)),
            keras.layers.Dense(16, activation="relu", name="d1"),
            keras.layers.Dense(8, activation="tanh", name="d2"),
            keras.layers.Dense(3, name="d3"),
        ]
    )
    return _compiled(model)


def _compiled(model):
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def build_batch_statistics():
    """A model whose training-time numbers depend on the whole batch.

    `Dropout` (one mask over the global batch) and `BatchNormalization`
    (the global batch's moments): under `keras.distribution` each process's
    replicas draw and normalise as one device does over the global batch.
    """
    keras.utils.set_random_seed(13)
    model = keras.Sequential(
        [
            keras.Input((12,)),
            # No bias before the normalisation (its gradient is zero: Adam
            # would turn float noise into steps).
            keras.layers.Dense(16, use_bias=False, name="d1"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.Activation("relu"),
            keras.layers.Dropout(0.5, seed=7, name="drop"),
            keras.layers.Dense(3, name="d3"),
        ]
    )
    return _compiled(model)


def dataset(batched=True, known_length=True, static=False):
    """The examples, in global batches; `known_length=False`: a `filter`.

    `static=True`: batches whose size is known when traced
    (`drop_remainder`; 64 examples make 4 whole batches either way).

    Keras trains a dataset of unknown length until it runs out, and its
    extra call at each epoch's end counts one more optimizer iteration (on
    one device too), so such a run is compared with its own one-device
    run, not with the known-length one.
    """
    rng = np.random.default_rng(5)
    x = rng.normal(size=(64, 12)).astype("float32")
    y = rng.integers(0, 3, size=(64,)).astype("int32")
    examples = tf.data.Dataset.from_tensor_slices((x, y))
    if not known_length:
        examples = examples.filter(lambda x, y: True)
    if not batched:
        return examples
    return examples.batch(GLOBAL_BATCH, drop_remainder=static)


def train(model, data=None):
    """Fits on `data` (default: `dataset()`); returns the history."""
    data = dataset() if data is None else data
    history = model.fit(data, epochs=EPOCHS, shuffle=False, verbose=0)
    return history.history


# The mixed-precision run: float32 weights, bfloat16 products.
MIXED = "mixed_bfloat16"


def build_mixed():
    """`build`'s layers made wide enough that products move rows.

    d1 and d2 are 64 x 64 (`LAYOUTS`): 4096 values, more than the 16 rows
    of 64 + 64 a step moves, so each product gathers rows, not the kernel.
    """
    keras.utils.set_random_seed(17)
    model = keras.Sequential(
        [
            keras.Input((12,)),
            keras.layers.Dense(64, activation="relu", name="d0"),
            keras.layers.Dense(64, activation="relu", name="d1"),
            keras.layers.Dense(64, activation="tanh", name="d2"),
            keras.layers.Dense(3, name="d3", dtype="float32"),
        ]
    )
    return _compiled(model)


def one_device_run(
    folder, known_length=True, make=build, policy=None, static=False
):
    """The reference: initial weights saved to `folder`, then one device.

    `policy`: a Keras dtype policy to build and train under (then restored).

    Returns:
        `{"init": <initial weights .npz>, "history": ..., "weights": ...}`.
    """
    if policy is not None:
        saved = keras.config.dtype_policy()
        keras.config.set_dtype_policy(policy)
        try:
            return one_device_run(folder, known_length, make, static=static)
        finally:
            keras.config.set_dtype_policy(saved)
    model = make()
    init = folder / "init.npz"
    np.savez(init, *model.get_weights())
    history = train(model, dataset(known_length=known_length, static=static))
    return {"init": init, "history": history, "weights": model.get_weights()}


def assert_matches(got, reference, atol, what):
    """`got`'s history and weights equal `reference`'s (`one_device_run`)."""
    from tests import helpers

    assert sorted(got["history"]) == sorted(reference["history"]), what
    for key, values in reference["history"].items():
        helpers.assert_close(
            got["history"][key], values, f"{what} {key}", atol=atol
        )
    for i, (a, e) in enumerate(
        zip(got["weights"], reference["weights"], strict=True)
    ):
        helpers.assert_close(a, e, f"{what} weight {i}", atol=atol)


def distribution(kind):
    """A distribution over every listed device.

    `"data_parallel"`; `"model_parallel"` (and `"sharder"`, fed by our
    sharder), a (2, N / 2) mesh `("batch", "model")`; `"model_across"`,
    a (1, N) mesh (over several processes its model axis spans them).
    """
    devices = keras.distribution.list_devices()
    if kind == "data_parallel":
        return keras.distribution.DataParallel(devices=devices)
    batch = 1 if kind == "model_across" else 2
    mesh = keras.distribution.DeviceMesh(
        (batch, len(devices) // batch), ("batch", "model"), devices
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, axes in LAYOUTS.items():
        layout_map[key] = axes
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )


# The resharding-resume tests: `preempt_reference`'s data and steps, with a
# hidden layer the meshes split.
PREEMPT_LAYOUTS = {".*hidden/kernel": (None, "model")}


def build_preempt():
    """`preempt_reference`'s regression, under the current distribution."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(8, activation="tanh", name="hidden"),
            keras.layers.Dense(1, name="out"),
        ]
    )
    model.compile(keras.optimizers.Adam(0.05), "mse")
    return model


def preempt_distribution(shape, devices=None):
    """`ModelParallel` on a `("batch", "model")` mesh of `shape`."""
    devices = devices or keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh(shape, ("batch", "model"), devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, axes in PREEMPT_LAYOUTS.items():
        layout_map[key] = axes
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )


def preempt_dataset():
    """`preempt_reference`'s examples as a dataset of global batches.

    Not reshuffled per epoch: a `reshuffle_each_iteration` shuffle draws
    another order under a `tf.distribute` strategy than on one device.
    """
    from tests.multi_worker import preempt_reference as ref

    inputs = ref.fit_inputs("arrays", None)
    return tf.data.Dataset.from_tensor_slices((inputs["x"], inputs["y"])).batch(
        ref.GLOBAL_BATCH
    )
