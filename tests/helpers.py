"""Helpers shared by tests: models, data, references and assertions."""

import contextlib

import keras
import numpy as np
import tensorflow as tf


def conv_dense_model(batch_norm=None, num_classes=3):
    """A small Conv + Dense classifier; `batch_norm` adds a BN layer."""
    layers = [
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(4, 3, activation="relu"),
    ]
    if batch_norm is not None:
        layers.append(batch_norm)
    layers += [
        keras.layers.Flatten(),
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(num_classes, activation="softmax"),
    ]
    return keras.Sequential(layers)


def classification_data(n=128, num_classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8, 8, 1)).astype("float32")
    y = rng.integers(0, num_classes, size=(n,)).astype("int32")
    return x, y


def jit_dense_model(optimizer, steps_per_execution=1, jit_compile=True):
    """A seeded 8-16-1 regressor, compiled with mse and mae.

    Create it in the strategy's scope (or a device scope for a reference).
    """
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(
        optimizer,
        "mse",
        metrics=["mae"],
        jit_compile=jit_compile,
        steps_per_execution=steps_per_execution,
    )
    return model


def assert_close(actual, expected, what, atol=1e-5):
    """Asserts two numbers or arrays agree within `atol`, naming `what`."""
    np.testing.assert_allclose(
        np.asarray(actual),
        np.asarray(expected),
        atol=atol,
        rtol=0,
        err_msg=what,
    )


def assert_weights_close(actual, expected, atol=1e-5):
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        np.testing.assert_allclose(
            a, e, atol=atol, rtol=0, err_msg=f"weight {i} differs"
        )


def replica_ordered_input_fn(x, y, global_batch):
    """An `input_fn` where global replica r of step k takes batch N*k + r.

    With N replicas over W workers, per-replica batches are grouped by
    step, then the groups are sharded by worker, so the replicas together
    see the first `global_batch` examples at step 0, the next at step 1,
    and so on, as one device does.
    """
    import tensorflow as tf

    def input_fn(ctx):
        per_replica = ctx.get_per_replica_batch_size(global_batch)
        local_replicas = ctx.num_replicas_in_sync // ctx.num_input_pipelines
        return (
            tf.data.Dataset.from_tensor_slices((x, y))
            .batch(per_replica)
            .batch(local_replicas)
            .shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
            .unbatch()
        )

    return input_fn


def stock_mirrored():
    """Stock `MirroredStrategy` on CPU:0 and CPU:1, the reference strategy.

    It reduces on one device instead of with collective ops: two stock
    instances in one process number their collectives alike and abort each
    other ("Shape mismatch in the collective instance",
    tensorflow/tensorflow#62790), which our replicators avoid. A sum of two
    replicas is the same float either way.
    """
    return tf.distribute.MirroredStrategy(
        ["CPU:0", "CPU:1"],
        cross_device_ops=tf.distribute.ReductionToOneDevice(),
    )


def device_mesh(shape, axes=("batch", "model")):
    """A `keras.distribution.DeviceMesh` of the first devices, `shape`."""
    devices = keras.distribution.list_devices()[: int(np.prod(shape))]
    return keras.distribution.DeviceMesh(shape, axes, devices)


def model_parallel(shape, layouts, axes=("batch", "model")):
    """`ModelParallel` over `device_mesh(shape, axes)`.

    `layouts` maps LayoutMap keys to axes; the batch is split over the
    first mesh axis.
    """
    layout_map = keras.distribution.LayoutMap(device_mesh(shape, axes))
    for key, value in layouts.items():
        layout_map[key] = value
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name=axes[0]
    )


def tf_functions_started():
    """How many `tf.function`s this process has called a first time.

    TensorFlow's own counter (`/tensorflow/core/tf_function_counter`), by
    which a `tf.function` made anew at every call shows: each one adds 1
    and traces. (A function's later traces show in its
    `experimental_get_tracing_count()`.)
    """
    from tensorflow.python.eager.polymorphic_function import (
        polymorphic_function,
    )

    counter = polymorphic_function._tf_function_counter
    return sum(counter.get_cell(jit).value() for jit in ("0", "1"))


@contextlib.contextmanager
def floatx(name):
    """Keras' floatx and dtype policy both `name` meanwhile.

    Keras keeps the dtype policy it first made from floatx: set both.
    """
    saved = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx(name)
    keras.config.set_dtype_policy(name)
    try:
        yield
    finally:
        keras.config.set_floatx(saved[0])
        keras.config.set_dtype_policy(saved[1])
