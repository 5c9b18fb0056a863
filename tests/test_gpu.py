"""GPU paths: replicas, NCCL all-reduces and sharded weights on GPUs.

These tests need a CUDA GPU that TensorFlow sees (`pip install ".[gpu]"`
on Linux with an NVIDIA driver); everywhere else the whole module is
skipped, with the reason. None of them has run yet: the machines this
project has been tested on have no GPU.

conftest.py configures the GPUs once, before TensorFlow starts: one GPU
becomes two logical GPUs, several stay one logical GPU each, and every
logical GPU is limited to `GPU_MEMORY_LIMIT_MB`. TensorFlow all-reduces
with NCCL between physical GPUs only (between logical GPUs of one GPU it
uses its RING implementation), so the NCCL test needs two GPUs.

TensorFloat-32 is switched off here: with it, float32 matmuls on Ampere
and later GPUs round to 10 mantissa bits, and no two runs would agree
to 1e-4.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr

if not tf.config.list_physical_devices("GPU"):
    pytest.skip(
        "no GPU visible to TensorFlow (tf.config.list_physical_devices('GPU')"
        " is empty); these tests need a CUDA GPU: pip install '.[gpu]' on "
        "Linux with an NVIDIA driver",
        allow_module_level=True,
    )

pytestmark = pytest.mark.gpu

# One device's numbers, to the order in which a GPU sums.
TOL = 1e-4
WIDTH = 64


@pytest.fixture(autouse=True)
def exact_float32_and_no_distribution():
    tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
    tf.config.experimental.enable_tensor_float_32_execution(False)
    keras.distribution.set_distribution(None)
    yield
    keras.distribution.set_distribution(None)
    tf.config.experimental.enable_tensor_float_32_execution(tf32)


def _physical_gpus():
    return tf.config.list_physical_devices("GPU")


def _logical_gpus():
    """`["/device:GPU:0", ...]`; conftest made at least two."""
    gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
    if len(gpus) < 2:
        pytest.skip(f"needs 2 logical GPUs; TensorFlow has {gpus}")
    return gpus


def _memory_limit_bytes():
    """The logical GPUs' `memory_limit` (conftest sets it), in bytes."""
    config = tf.config.get_logical_device_configuration(_physical_gpus()[0])
    if not config or config[0].memory_limit is None:
        pytest.skip("the logical GPUs have no memory_limit")
    return config[0].memory_limit * 2**20


def _memory(gpu):
    """TensorFlow's allocator count for `gpu`: `current` and `peak` bytes."""
    return tf.config.experimental.get_memory_info(_short(gpu))


def _short(name):
    """`"GPU:1"` for `"/device:GPU:1"`, as the memory functions take it."""
    spec = tf.DeviceSpec.from_string(name)
    return f"{spec.device_type}:{spec.device_index}"


def _device_type(name):
    return tf.DeviceSpec.from_string(name).device_type


def _mlp(width=WIDTH, depth=2):
    keras.utils.set_random_seed(3)
    layers = [keras.Input((width,))]
    for i in range(depth):
        layers.append(
            keras.layers.Dense(width, activation="tanh", name=f"d{i}")
        )
    layers.append(keras.layers.Dense(4, name="out"))
    model = keras.Sequential(layers)
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


def _data(width=WIDTH, n=64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, width)).astype("float32")
    y = rng.normal(size=(n, 4)).astype("float32")
    return x, y


def _fit(model, epochs=2):
    x, y = _data(model.input_shape[-1])
    history = model.fit(
        x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0
    )
    return history.history["loss"]


def _assert_same_training(reference, ref_losses, model, losses):
    np.testing.assert_allclose(losses, ref_losses, rtol=TOL, atol=TOL)
    for a, b in zip(reference.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(b, a, rtol=TOL, atol=TOL)


def _reference():
    """One device (Keras puts it on GPU:0), no distribution."""
    model = _mlp()
    return model, _fit(model)


def _collective_hints(step):
    """The `communication_hint` of every all-reduce `step` traces."""
    graph = step.get_concrete_function().graph.as_graph_def()
    nodes = list(graph.node)
    for function in graph.library.function:
        nodes.extend(function.node_def)
    return {
        node.attr["communication_hint"].s.decode().lower()
        for node in nodes
        if node.op.startswith("CollectiveReduce")
    }


def _all_reduce_step(replicator):
    @tf.function
    def step():
        def replica_fn():
            mine = tf.cast(kr.replica_id(), tf.float32) + 1.0
            return kr.all_reduce(tf.fill([1024], mine))

        return replicator.run(replica_fn)

    return step


def test_local_replicator_puts_replicas_and_weights_on_the_gpus():
    gpus = _logical_gpus()
    reference, ref_losses = _reference()
    replicator = kr.LocalReplicator()  # every GPU by default
    assert replicator.num_replicas_in_sync == len(gpus)
    workers = replicator.extended.worker_devices
    assert [_device_type(d) for d in workers] == ["GPU"] * len(gpus)
    with replicator.scope():
        model = _mlp()
    for weight in model.weights:
        copies = kr.shard_shapes(weight)
        assert sorted(copies) == sorted(f"gpu:{i}" for i in range(len(gpus)))
        assert set(copies.values()) == {tuple(weight.shape)}
    _assert_same_training(reference, ref_losses, model, _fit(model))


@pytest.mark.skipif(
    len(tf.config.list_physical_devices("GPU")) < 2,
    reason="NCCL all-reduces between physical GPUs; this host has one",
)
def test_all_reduce_across_physical_gpus_is_nccl():
    gpus = _logical_gpus()
    replicator = kr.LocalReplicator()
    step = _all_reduce_step(replicator)
    total = sum(range(1, len(gpus) + 1))
    for value in replicator.experimental_local_results(step()):
        assert _device_type(value.device) == "GPU"
        np.testing.assert_array_equal(value.numpy(), np.full([1024], total))
    assert _collective_hints(step) == {"nccl"}
    # And Keras' fit, whose gradients take the same all-reduce.
    reference, ref_losses = _reference()
    with replicator.scope():
        model = _mlp()
    _assert_same_training(reference, ref_losses, model, _fit(model))


@pytest.mark.skipif(
    len(tf.config.list_physical_devices("GPU")) != 1,
    reason="one GPU split into logical GPUs; this host has several",
)
def test_all_reduce_between_logical_gpus_of_one_gpu_is_ring():
    gpus = _logical_gpus()
    replicator = kr.LocalReplicator()
    step = _all_reduce_step(replicator)
    total = sum(range(1, len(gpus) + 1))
    for value in replicator.experimental_local_results(step()):
        np.testing.assert_array_equal(value.numpy(), np.full([1024], total))
    # NCCL needs a GPU per rank; TensorFlow falls back to RING here.
    assert _collective_hints(step) == {"ring"}


def _model_parallel(devices):
    mesh = keras.distribution.DeviceMesh(
        (1, len(devices)), ("batch", "model"), devices
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    # Every hidden layer's kernel, split along its columns (Keras matches
    # the whole path: "sequential/d0/kernel").
    layout_map[r"(.*/)?d\d+/kernel"] = (None, "model")
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )


def test_model_parallel_stores_blocks_on_the_gpus():
    gpus = _logical_gpus()
    devices = keras.distribution.list_devices("gpu")
    assert len(devices) == len(gpus)
    reference, ref_losses = _reference()
    keras.distribution.set_distribution(_model_parallel(devices))
    model = _mlp()
    kernel = model.get_layer("d0").kernel
    block = (WIDTH, WIDTH // len(devices))
    assert kr.shard_shapes(kernel) == {d: block for d in devices}
    # Where the blocks really are, not only where the layout says.
    stored = kernel._value.values
    assert [_device_type(b.device) for b in stored] == ["GPU"] * len(gpus)
    assert len({b.device for b in stored}) == len(gpus)
    assert {tuple(b.shape) for b in stored} == {block}
    _assert_same_training(reference, ref_losses, model, _fit(model))
    # Adam's slots are stored like the kernel they belong to.
    slots = [
        v for v in model.optimizer.variables if tuple(v.shape) == (WIDTH, WIDTH)
    ]
    assert slots
    for slot in slots:
        assert kr.shard_shapes(slot) == {d: block for d in devices}


def test_model_parallel_fits_under_a_memory_limit_one_copy_exceeds():
    gpus = _logical_gpus()
    limit = _memory_limit_bytes()
    devices = keras.distribution.list_devices("gpu")
    n = len(devices)
    # Training a full copy takes 16 bytes a parameter (weights, gradients,
    # Adam's two slots): 1.2x a GPU's limit, so one device, or a
    # DataParallel replica, cannot. Sharded, each of n GPUs holds 16/n bytes
    # a parameter, plus about one layer's full weights and gradients at a
    # time (the layers are rematerialised): 0.68x the limit on 2 GPUs.
    depth = 16
    width = int(np.sqrt(1.2 * limit / 16 / depth)) // (8 * n) * (8 * n)
    parameters = depth * width * width
    assert 16 * parameters > limit
    for gpu in gpus:
        tf.config.experimental.reset_memory_stats(_short(gpu))
    before = [_memory(gpu)["current"] for gpu in gpus]
    keras.distribution.set_distribution(_model_parallel(devices))
    model = _mlp(width=width, depth=depth)
    after = [_memory(gpu)["current"] for gpu in gpus]
    # Every GPU holds about its 1/n of the kernels, not a copy.
    for gpu, b, a in zip(gpus, before, after, strict=True):
        assert a - b < 4 * parameters * (1 / n + 0.1), (gpu, a - b)
    losses = _fit(model, epochs=1)
    assert np.isfinite(losses).all()
    for gpu in gpus:
        assert _memory(gpu)["peak"] <= limit
