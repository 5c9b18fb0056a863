"""keras.distribution on TensorFlow: DataParallel and ModelParallel.

Every case compares with one device: the same model, seed, data and global
batch give the same losses and weights.
"""

import functools
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.distribution import distribution_lib

import keras_replicator as kr
from keras_replicator._src.core import placements
from keras_replicator._src.sharding import sharded
from tests import helpers
from tests import keras_io_distribution as guide

TOL = 1e-5

# The guide fits a tf.data.Dataset with Keras' default shuffle=True, on
# which Keras warns.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`shuffle=True` was passed:UserWarning"
)


@pytest.fixture(autouse=True)
def no_distribution():
    keras.distribution.set_distribution(None)
    yield
    keras.distribution.set_distribution(None)


def _close(a, b, rtol=TOL):
    a, b = np.asarray(a), np.asarray(b)
    scale = max(float(np.max(np.abs(a))), 1e-6)
    assert float(np.max(np.abs(a - b))) <= rtol * scale, (
        float(np.max(np.abs(a - b))),
        scale,
    )


def _same_weights(reference, model, rtol=TOL):
    ref = reference.get_weights()
    got = model.get_weights()
    assert len(ref) == len(got)
    for a, b in zip(ref, got, strict=True):
        assert a.shape == b.shape
        _close(a, b, rtol)


def _same_history(h0, h1, rtol=TOL):
    assert h0.keys() == h1.keys()
    for key in h0:
        _close(h0[key], h1[key], rtol)


_mesh = helpers.device_mesh
_model_parallel = helpers.model_parallel


# --- keras.io's guide --------------------------------------------------------


@functools.cache
def _guide_reference():
    keras.distribution.set_distribution(None)
    keras.utils.set_random_seed(7)
    return guide._train(0.0)


def test_guide_data_parallel_is_a_local_replicator_with_one_devices_numbers():
    reference, h0 = _guide_reference()
    keras.utils.set_random_seed(7)
    model, h1 = guide.data_parallel(dropout=0.0, use_mesh=True)
    strategy = model.distribute_strategy
    assert isinstance(strategy, kr.LocalReplicator)
    assert strategy.num_replicas_in_sync == 8
    shapes = kr.shard_shapes(model.get_layer("d1").kernel)
    assert shapes == {f"cpu:{i}": (784, 200) for i in range(8)}
    _same_history(h0, h1)
    _same_weights(reference, model)


def test_guide_model_parallel_shards_d1_and_gives_one_devices_numbers():
    reference, h0 = _guide_reference()
    keras.utils.set_random_seed(7)
    model, h1 = guide.model_parallel(dropout=0.0)
    assert model.distribute_strategy.num_replicas_in_sync == 8
    kernel = model.get_layer("d1").kernel
    assert kr.shard_shapes(kernel) == {f"cpu:{i}": (784, 50) for i in range(8)}
    # Each device stores only its block, and so do Adam's slots... here the
    # guide's default RMSprop: its velocity has the kernel's layout.
    stored = [tuple(c.shape) for c in kernel._value.values]
    assert stored == [(784, 50)] * 8
    slots = [
        v for v in model.optimizer.variables if placements.of(v) is not None
    ]
    assert [kr.shard_shapes(s)["cpu:3"] for s in slots] == [(784, 50)]
    # The unmatched d2 is replicated whole.
    d2 = kr.shard_shapes(model.get_layer("d2").kernel)
    assert set(d2.values()) == {(200, 10)}
    _same_history(h0, h1)
    _same_weights(reference, model)
    np.testing.assert_allclose(
        model.predict(guide.dataset(), verbose=0),
        reference.predict(guide.dataset(), verbose=0),
        rtol=TOL,
        atol=1e-6,
    )


def test_set_distribution_none_leaves_no_strategy():
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=guide.devices())
    )
    assert tf.distribute.has_strategy()
    keras.distribution.set_distribution(None)
    assert not tf.distribute.has_strategy()
    with _model_parallel((2, 2), {"d/kernel": (None, "model")}).scope():
        assert isinstance(tf.distribute.get_strategy(), kr.LocalReplicator)
    assert not tf.distribute.has_strategy()


# --- Optimizers and options on 2x2 and 1x4 meshes ---------------------------

_LAYOUTS = {
    # Both mesh axes (FSDP-like), one axis, and a vector.
    "emb/embeddings": ("model", "batch"),
    "d1/kernel": ("batch", "model"),
    "d1/bias": ("model",),
    "d2/kernel": ("model", None),
}

OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "clipnorm": lambda: keras.optimizers.Adam(0.01, clipnorm=0.05),
    "global_clipnorm": lambda: keras.optimizers.Adam(
        0.01, global_clipnorm=0.05
    ),
    "accumulation": lambda: keras.optimizers.Adam(
        0.01, gradient_accumulation_steps=2
    ),
}


def _data():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 32, size=(64, 6)).astype("int32")
    y = rng.normal(size=(64, 4)).astype("float32")
    return x, y


def _embedding_model(make_optimizer):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(32, 8, name="emb")(inputs)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(16, activation="tanh", name="d1")(h)
    outputs = keras.layers.Dense(4, name="d2")(h)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=make_optimizer(), loss="mse", metrics=["mae"])
    return model


def _fit(make_optimizer):
    model = _embedding_model(make_optimizer)
    x, y = _data()
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    return model, history.history


@functools.cache
def _reference(name):
    keras.distribution.set_distribution(None)
    return _fit(OPTIMIZERS[name])


@pytest.mark.parametrize("shape", [(2, 2), (1, 4)], ids=["2x2", "1x4"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_model_parallel_equals_one_device(name, shape):
    reference, h0 = _reference(name)
    keras.distribution.set_distribution(_model_parallel(shape, _LAYOUTS))
    model, h1 = _fit(OPTIMIZERS[name])
    assert placements.of(model.get_layer("emb").embeddings) is not None
    # Layers that multiply by sharded weights are rematerialised (their
    # gathered weights are not kept for the backward pass); a lookup not.
    assert model.get_layer("d1")._keras_replicator_remat
    assert not hasattr(model.get_layer("emb"), "_keras_replicator_remat")
    _same_history(h0, h1)
    _same_weights(reference, model)
    # Optimizer state too (its slots are whole in get_weights' sense).
    for a, b in zip(
        reference.optimizer.variables, model.optimizer.variables, strict=True
    ):
        _close(a.numpy(), b.numpy())


def _wide_mlp_weights_after_adam():
    """`benchmarks/vs_jax.py`'s MLP (4 x Dense(2048), batch 64) after 12
    steps of Adam at 1e-4, under the distribution set (issue #59's)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * 12, 2048)).astype("float32")
    y = rng.normal(size=(64 * 12, 2048)).astype("float32")
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((2048,))]
        + [
            keras.layers.Dense(2048, activation="relu", name=f"d{i}")
            for i in range(3)
        ]
        + [keras.layers.Dense(2048, name="d3")]
    )
    model.compile(keras.optimizers.Adam(1e-4), "mse")
    model.fit(x, y, batch_size=64, shuffle=False, verbose=0)
    return model.get_weights()


def test_model_parallel_adam_keeps_every_weight_within_1e_5_of_one_device():
    # Adam turns a gradient's last bits into whole steps where it is near
    # epsilon; each element is checked, not the largest relative to scale.
    reference = _wide_mlp_weights_after_adam()
    keras.distribution.set_distribution(
        helpers.model_parallel((1, 4), {r".*/d\d/kernel": (None, "model")})
    )
    for a, b in zip(reference, _wide_mlp_weights_after_adam(), strict=True):
        assert float(np.max(np.abs(a - b))) <= 1e-5


@pytest.mark.parametrize("layer", ["dense", "einsum_dense"])
def test_model_parallel_bias_layers_predict_one_devices_bits(layer):
    # TensorFlow 2.22 fuses one device's product and bias add (its sums
    # start from the bias); each block's product adds its bias alike.
    def predictions():
        keras.utils.set_random_seed(3)
        make = {
            "dense": lambda i: keras.layers.Dense(
                512, activation="relu", name=f"d{i}"
            ),
            "einsum_dense": lambda i: keras.layers.EinsumDense(
                "ab,bc->ac", 512, bias_axes="c", activation="relu", name=f"d{i}"
            ),
        }[layer]
        model = keras.Sequential([keras.Input((512,)), make(0), make(1)])
        x = np.random.default_rng(0).normal(size=(64, 512)).astype("float32")
        return model, model.predict(x, batch_size=64, verbose=0)

    _, reference = predictions()
    keras.distribution.set_distribution(
        helpers.model_parallel((1, 4), {r".*/d\d/kernel": (None, "model")})
    )
    model, got = predictions()
    # Sharded as laid out, not one device's fall-back.
    assert kr.shard_shapes(model.get_layer("d0").kernel) == {
        f"cpu:{i}": (512, 128) for i in range(4)
    }
    np.testing.assert_array_equal(got, reference)


def test_embedding_is_sharded_as_laid_out_on_every_device():
    keras.distribution.set_distribution(_model_parallel((2, 2), _LAYOUTS))
    model = _embedding_model(OPTIMIZERS["adam"])
    table = model.get_layer("emb").embeddings
    assert kr.shard_shapes(table) == {f"cpu:{i}": (16, 4) for i in range(4)}
    full = table.numpy()
    # Device (b, m) holds rows block m, columns block b.
    for replica, (b, m) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        np.testing.assert_array_equal(
            table._value.values[replica].numpy(),
            full[m * 16 : (m + 1) * 16, b * 4 : (b + 1) * 4],
        )


def test_train_on_batch_custom_train_step_evaluate_and_predict():
    class Custom(keras.Model):
        def train_step(self, data):
            x, y = data[:2]
            with tf.GradientTape() as tape:
                loss = keras.ops.mean(keras.ops.square(self(x) - y))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables)
            return {"loss": loss}

    def run():
        keras.utils.set_random_seed(2)
        inputs = keras.Input((6,))
        h = keras.layers.Dense(8, name="d1")(inputs)
        model = Custom(inputs, keras.layers.Dense(4, name="d2")(h))
        model.compile(optimizer=keras.optimizers.Adam(0.01))
        x = np.linspace(-1, 1, 96, dtype="float32").reshape(16, 6)
        y = np.cos(x[:, :4])
        logs = [float(model.train_on_batch(x, y)) for _ in range(2)]
        logs.append(model.fit(x, y, batch_size=8, verbose=0).history["loss"])
        return model, logs, model.predict(x, verbose=0)

    reference, logs0, p0 = run()
    keras.distribution.set_distribution(
        _model_parallel((1, 4), {"d1/kernel": (None, "model")})
    )
    model, logs1, p1 = run()
    assert kr.shard_shapes(model.get_layer("d1").kernel)["cpu:0"] == (6, 2)
    _close(np.hstack(logs0), np.hstack(logs1))
    _same_weights(reference, model)
    _close(p0, p1)


def _jit_run(distribution):
    keras.distribution.set_distribution(distribution)
    model = _embedding_model(OPTIMIZERS["adam"])
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="mse",
        metrics=["mae"],
        jit_compile=True,
    )
    x, y = _data()
    history = model.fit(
        x, y, batch_size=16, epochs=2, verbose=0, shuffle=False
    ).history
    evaluated = model.evaluate(x, y, batch_size=16, verbose=0)
    predicted = model.predict(x, batch_size=16, verbose=0)
    return model, history, evaluated, predicted


@pytest.mark.parametrize("shape", [(1, 4), (2, 2)], ids=["1x4", "2x2"])
def test_jit_compile_true_gets_one_devices_numbers(shape):
    """XLA compiles each device's share; the collectives stay outside."""
    reference = _jit_run(None)
    got = _jit_run(_model_parallel(shape, _LAYOUTS))
    model = got[0]
    assert model.jit_compile is True
    # The weights are sharded, on both mesh axes for the 2x2 mesh.
    assert kr.shard_shapes(model.get_layer("d1").kernel)["cpu:0"] == (
        (48 // shape[0], 16 // shape[1])
    )
    _same_history(reference[1], got[1])
    _same_weights(reference[0], model)
    _close(reference[2], got[2])
    _close(reference[3], got[3])


_XLA_PROBE = """
import os, sys
import keras_replicator as kr
kr.configure_cpu_replicas(4)
import keras, numpy as np
mesh = keras.distribution.DeviceMesh(
    (1, 4), ["batch", "model"], keras.distribution.list_devices()[:4]
)
layouts = keras.distribution.LayoutMap(mesh)
layouts[".*d/kernel"] = (None, "model")
keras.distribution.set_distribution(
    keras.distribution.ModelParallel(layout_map=layouts)
)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="d")])
model.compile("adam", "mse", jit_compile=sys.argv[1] == "1")
model.fit(np.ones((32, 8)), np.ones((32, 16)), batch_size=16, verbose=0)
assert kr.shard_shapes(model.get_layer("d").kernel)["cpu:0"] == (8, 4)
"""


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "no_jit"])
def test_jit_compile_true_compiles_clusters_under_model_parallel(jit):
    """TensorFlow logs its first XLA compilation in a process: only with jit."""
    import subprocess
    import sys

    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "0"}
    result = subprocess.run(
        [sys.executable, "-c", _XLA_PROBE, "1" if jit else "0"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = "Compiled cluster using XLA" in result.stderr
    assert compiled == jit, result.stderr[-3000:]
    assert ("compiles each device's share" in result.stderr) == jit


# --- Saved files are whole --------------------------------------------------


def test_saving_loading_and_reading_sharded_values_trace_nothing_again(
    tmp_path,
):
    keras.distribution.set_distribution(_model_parallel((1, 4), _LAYOUTS))
    model, _ = _fit(OPTIMIZERS["adam"])
    strategy = model.distribute_strategy
    sharded_variables = [
        v
        for v in [*model.weights, *model.optimizer.variables]
        if placements.of(v) is not None
    ]

    def one_round():
        model.save_weights(tmp_path / "m.weights.h5")
        model.load_weights(tmp_path / "m.weights.h5")
        kr.save_checkpoint(model, tmp_path / "ckpt", asynchronous=False)
        kr.load_checkpoint(model, tmp_path / "ckpt")
        for variable in sharded_variables:
            full = variable.numpy()
            # Over several processes a host read is this all-gather; in
            # one process it runs the same over the local devices.
            gathered = sharded._gather_blocks(
                strategy, variable._value, placements.of(variable)
            )
            np.testing.assert_array_equal(gathered.numpy(), full)
        functions = getattr(strategy, "_keras_replicator_gathers", {}).values()
        return helpers.tf_functions_started(), sum(
            f.experimental_get_tracing_count() for f in functions
        )

    first = one_round()
    assert one_round() == first
    assert one_round() == first
    # One trace per placement and dtype: Adam's slots share their weight's.
    assert first[1] == 4 < len(sharded_variables)


def test_files_saved_under_a_mesh_load_on_one_device_and_data_parallel(
    tmp_path,
):
    x, y = _data()
    keras.distribution.set_distribution(_model_parallel((2, 2), _LAYOUTS))
    model, _ = _fit(OPTIMIZERS["adam"])
    expected = model.predict(x, verbose=0)
    model.save(tmp_path / "m.keras")
    model.save_weights(tmp_path / "m.weights.h5")

    keras.distribution.set_distribution(None)
    one = keras.models.load_model(tmp_path / "m.keras")
    assert not tf.distribute.has_strategy()
    _close(one.predict(x, verbose=0), expected)
    for a, b in zip(
        model.optimizer.variables, one.optimizer.variables, strict=True
    ):
        _close(a.numpy(), b.numpy())

    keras.distribution.set_distribution(
        keras.distribution.DataParallel(
            devices=keras.distribution.list_devices()[:4]
        )
    )
    data_parallel = _embedding_model(OPTIMIZERS["adam"])
    # As on one device, a weights file holds the optimizer's state too:
    # build the optimizer first.
    data_parallel.optimizer.build(data_parallel.trainable_variables)
    data_parallel.load_weights(tmp_path / "m.weights.h5")
    _close(data_parallel.predict(x, verbose=0), expected)

    # And back onto another mesh: 1x4 blocks from the whole file.
    keras.distribution.set_distribution(_model_parallel((1, 4), _LAYOUTS))
    again = keras.models.load_model(tmp_path / "m.keras")
    assert kr.shard_shapes(again.get_layer("d1").kernel)["cpu:0"] == (48, 4)
    _close(again.predict(x, verbose=0), expected)


# --- Bad input ---------------------------------------------------------------


def _build_dense(units, input_dim):
    layer = keras.layers.Dense(units, name="d1")
    layer.build((None, input_dim))
    return layer


def test_a_layout_axis_that_does_not_divide_the_dimension_is_named():
    keras.distribution.set_distribution(
        _model_parallel((1, 4), {"d1/kernel": (None, "model")})
    )
    with pytest.raises(ValueError, match="does not divide") as info:
        _build_dense(6, 8)
    message = str(info.value)
    for part in ("'d1/kernel'", "shape=(8, 6)", "(None, 'model')", "(1, 4)"):
        assert part in message


def test_an_axis_not_in_the_mesh_is_named():
    layout_map = keras.distribution.LayoutMap(_mesh((1, 4)))
    with pytest.raises(ValueError, match="modle"):
        layout_map["d1/kernel"] = (None, "modle")
    # A layout made before its mesh is known is checked with the variable.
    layout_map = keras.distribution.LayoutMap(None)
    layout_map["d1/kernel"] = (None, "modle")
    distribution = keras.distribution.ModelParallel.__new__(
        keras.distribution.ModelParallel
    )
    distribution_lib.Distribution.__init__(distribution, _mesh((1, 4)))
    distribution._layout_map = layout_map
    keras.distribution.set_distribution(distribution)
    with pytest.raises(ValueError, match="'modle' is not an axis") as info:
        _build_dense(8, 8)
    assert "'d1/kernel'" in str(info.value)


def test_a_layout_longer_than_the_variable_is_named():
    keras.distribution.set_distribution(
        _model_parallel((1, 4), {"d1/bias": ("model", None)})
    )
    with pytest.raises(ValueError, match="1 dimensions") as info:
        _build_dense(8, 8)
    assert "layout=('model', None)" in str(info.value)


def test_a_shorter_layout_leaves_the_other_dimensions_whole_as_on_jax():
    # Keras' own initializer_test lays out a (2, 4) "bias" as ("model",) on
    # a (2, 2) mesh: JAX splits its rows and leaves its columns whole.
    mesh = _mesh((2, 2))
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["kernel"] = keras.distribution.TensorLayout([None, "model"])
    layout_map["bias"] = keras.distribution.TensorLayout(["model"])
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map)
    )
    bias = keras.Variable("ones", (2, 4), "float32", name="bias")
    kernel = keras.Variable("ones", (2, 4), "float32", name="kernel")
    assert set(kr.shard_shapes(bias).values()) == {(1, 4)}
    assert set(kr.shard_shapes(kernel).values()) == {(2, 2)}
    np.testing.assert_array_equal(bias.numpy(), np.ones((2, 4)))
    np.testing.assert_array_equal(kernel.numpy(), np.ones((2, 4)))


def test_an_axis_named_twice_is_refused_with_the_path():
    keras.distribution.set_distribution(
        _model_parallel((1, 4), {"d1/kernel": ("model", "model")})
    )
    with pytest.raises(ValueError, match="splits two dimensions") as info:
        _build_dense(8, 8)
    assert "'d1/kernel'" in str(info.value)


def test_a_mesh_larger_than_the_devices_is_refused_before_training():
    names = [f"cpu:{i}" for i in range(16)]
    mesh = keras.distribution.DeviceMesh((4, 4), ("batch", "model"), names)
    layout_map = keras.distribution.LayoutMap(mesh)
    with pytest.raises(ValueError, match="16 devices but only 8") as info:
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(layout_map=layout_map)
        )
    assert "(4, 4)" in str(info.value)
    assert not tf.distribute.has_strategy()


def test_an_unknown_distribution_raises_not_implemented():
    with pytest.raises(NotImplementedError, match="Received: distribution"):
        keras.distribution.set_distribution(
            distribution_lib.Distribution(_mesh((4,), ("batch",)))
        )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"job_addresses": "a:1,b:2", "num_processes": 2, "process_id": 2},
            "process_id=2, num_processes=2",
        ),
        (
            {"job_addresses": "a:1", "num_processes": 2, "process_id": 1},
            "1 job_addresses='a:1', num_processes=2",
        ),
        (
            {"job_addresses": "a:1,b:2", "num_processes": 2},
            "process_id=None, num_processes=2",
        ),
        ({"num_processes": 0}, "num_processes=0"),
        ({"num_processes": 1, "process_id": 3}, "process_id=3"),
    ],
)
def test_initialize_with_inconsistent_arguments_names_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        keras.distribution.initialize(**kwargs)
    assert distribution_lib.distribution_lib.num_processes() == 1


def test_initialize_arguments_that_disagree_with_tf_config_are_named(
    monkeypatch,
):
    monkeypatch.setenv(
        "TF_CONFIG",
        '{"cluster": {"worker": ["localhost:1", "localhost:2"]}, '
        '"task": {"type": "worker", "index": 1}}',
    )
    with pytest.raises(ValueError, match=r"\(2 processes, this one 1\)"):
        keras.distribution.initialize(num_processes=3)
    with pytest.raises(ValueError, match="process_id=0"):
        keras.distribution.initialize(process_id=0)
    assert distribution_lib.distribution_lib.num_processes() == 1


def test_initialize_with_one_process_changes_nothing():
    keras.distribution.initialize(num_processes=1, process_id=0)
    assert distribution_lib.distribution_lib.num_processes() == 1
    assert distribution_lib.distribution_lib.process_id() == 0
    assert keras.distribution.list_devices()[0] == "cpu:0"


def test_distribute_tensor_and_device_count():
    # The backend hook; Keras exports it as keras.distribution's since 3.13.
    assert distribution_lib.distribution_lib.get_device_count() == 8
    if hasattr(keras.distribution, "get_device_count"):
        assert keras.distribution.get_device_count() == 8
    layout = keras.distribution.TensorLayout(("batch", None), _mesh((4, 2)))
    x = tf.ones((4, 3))
    # A batch layout: the whole batch, which each step cuts itself.
    assert keras.distribution.distribute_tensor(x, layout) is x
    # Another dimension split outside a step: refused, never ignored.
    split = keras.distribution.TensorLayout((None, "model"), _mesh((4, 2)))
    with pytest.raises(NotImplementedError, match="batch") as info:
        keras.distribution.distribute_tensor(tf.ones((4, 2)), split)
    assert "Received: layout axes=(None, 'model')" in str(info.value)


def test_keras_hub_generate_under_model_parallel_gives_one_devices_tokens():
    # keras-hub's generate lays its inputs out with distribute_tensor.
    import runpy

    keras_hub = pytest.importorskip("keras_hub")
    example = runpy.run_path(
        str(
            __import__("pathlib").Path(__file__).resolve().parents[1]
            / "examples/gemma_model_parallel.py"
        )
    )
    prompt = {
        "token_ids": np.ones((4, 8), "int32"),
        "padding_mask": np.arange(8)[None, :].repeat(4, 0) < 2,
    }

    def generate():
        model = example["build_model"]()
        out = model.generate(prompt, max_length=8, stop_token_ids=None)
        return np.asarray(out["token_ids"])

    one_device = generate()
    mesh = _mesh((1, 4))
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh),
            batch_dim_name="batch",
        )
    )
    np.testing.assert_array_equal(generate(), one_device)


def test_a_constraint_on_a_sharded_variable_is_refused():
    keras.distribution.set_distribution(
        _model_parallel((1, 4), {"d1/kernel": (None, "model")})
    )
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(
        8, name="d1", kernel_constraint=keras.constraints.MaxNorm(1.0)
    )(inputs)
    model = keras.Model(inputs, outputs)
    model.compile("sgd", "mse")
    x = np.ones((8, 8), "float32")
    with pytest.raises(NotImplementedError, match="d1/kernel"):
        model.fit(x, x, batch_size=8, verbose=0)


def test_tf_train_checkpoint_holds_whole_values_and_export_is_refused(
    tmp_path,
):
    keras.distribution.set_distribution(_model_parallel((2, 2), _LAYOUTS))
    model = _embedding_model(OPTIMIZERS["adam"])
    kernel = model.get_layer("d1").kernel
    expected = kernel.numpy()
    path = tf.train.Checkpoint(kernel=kernel).write(str(tmp_path / "ckpt"))
    assert tf.train.load_variable(
        path, "kernel/.ATTRIBUTES/VARIABLE_VALUE"
    ).shape == (48, 16)
    kernel.assign(np.zeros_like(expected))
    tf.train.Checkpoint(kernel=kernel).read(path).assert_consumed()
    np.testing.assert_array_equal(kernel.numpy(), expected)
    with pytest.raises(NotImplementedError, match="SavedModel"):
        model.export(str(tmp_path / "exported"))
    # An archive of the variables alone, too (Keras 3.16 converts each to
    # its storage).
    archive = keras.export.ExportArchive()
    with pytest.raises(NotImplementedError, match="SavedModel"):
        archive.add_variable_collection("weights", model.variables)
        archive.add_endpoint(
            "serve",
            model.__call__,
            input_signature=[tf.TensorSpec((None, 6), "int32")],
        )
        archive.write_out(str(tmp_path / "archive"))


def test_bfloat16_weights_train_under_model_parallel_as_data_parallel():
    # keras-hub's presets are bfloat16; TensorFlow's CPU all-gather takes
    # no bfloat16, so blocks travel as their bits.
    def train(distribution):
        keras.distribution.set_distribution(distribution)
        keras.utils.set_random_seed(4)
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16, name="d1", dtype="bfloat16"),
                keras.layers.Dense(4, name="d2", dtype="bfloat16"),
            ]
        )
        model.compile(keras.optimizers.SGD(0.1), "mse")
        x = np.random.default_rng(0).normal(size=(32, 8))
        model.fit(x, x[:, :4], batch_size=16, shuffle=False, verbose=0)
        weights = [np.asarray(w, np.float32) for w in model.get_weights()]
        keras.distribution.set_distribution(None)
        return weights

    devices = keras.distribution.list_devices()[:4]
    sharded = train(_model_parallel((1, 4), {".*kernel": (None, "model")}))
    replicated = train(keras.distribution.DataParallel(devices=devices))
    # To bfloat16's precision (8 bits of mantissa): the sums round apart.
    for a, b in zip(sharded, replicated, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-2, atol=2e-3)
