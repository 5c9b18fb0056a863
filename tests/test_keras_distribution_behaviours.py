"""What Keras 3.15.1's own distribution tests check, on TensorFlow.

Keras tests `keras.distribution` in `distribution/distribution_lib_test.py`
(the backend-independent API; its JAX-only classes are skipped on
TensorFlow) and `backend/jax/distribution_lib_test.py` (the JAX backend).
Every behaviour they check that is not JAX-internal is checked here with
this library, in tests written for it:

- meshes: shape, axis names and device grid; their argument checks; the
  device list and count;
- layouts: axes checked against the mesh when it is given, now or later; a
  layout without a mesh has no backend layout;
- `Distribution.scope()`: nested scopes restore the outer distribution,
  and here its replicator too;
- `DataParallel` built from a mesh, from devices or from every device;
  `DataParallel` and `ModelParallel` layouts for data, variables (an
  explicit `variable._layout` first), tensors; the stored blocks that
  follow (a seed generator's state stays whole); a value assigned outside
  the scope keeps its blocks;
- `LayoutMap`: the tuple shortcut, duplicate and wrong values refused, an
  exact key before a regex, an ambiguous path refused, `len`, `del`,
  `pop` (exact keys only) and insertion order; on a real model too;
- datasets: one process passes the dataset on unchanged; two processes
  each take their part of every global batch (as Keras' `rebatch` and
  `shard` would, keeping the length); a batch that does not divide, an
  unbatched dataset or a list are refused; the process count reaches
  Keras' `num_model_replicas`/`data_shard_id` arithmetic and its check of
  the process count against the model replicas. These use a recorded
  two-process cluster (`processes._state`): no server starts;
- `keras.distribution.initialize()` reads the `KERAS_DISTRIBUTION_*`
  variables, arguments first;
- end to end: `DataParallel()` and `ModelParallel` (regex keys, on a
  (4, 2) mesh) built and fit inside `scope()`, and `"<layer>/output"`
  layouts as hints (`("batch", None)` as Keras tests, and `(None,
  "model")`), equal one device (1e-5).

Already covered elsewhere, so not repeated: the guide's `DataParallel` and
`ModelParallel` fits, the optimizers on 2x2 and 1x4 meshes, inconsistent
`initialize()` arguments, one-process `initialize()`, `num_processes()`
and `process_id()`, `get_device_count()` and `distribute_tensor`,
unknown distributions and bad layouts (tests/test_distribution.py); keys
that match nothing (tests/test_layout_report.py); batch statistics
(tests/test_distribution_batch_norm.py); `initialize()` from Keras'
environment variables across real processes and the dataset cut there
(tests/multi_worker/test_distribution.py).

Left out as JAX-internal:

- the JAX types: `_to_backend_device` giving a `jax.Device`,
  `_to_backend_mesh` a `jax.sharding.Mesh`, `_to_backend_layout` a
  `NamedSharding`, and `variable._value.sharding.spec`/`is_fully_replicated`
  (here the mesh and layout stay Keras objects, and `kr.shard_shapes` says
  what each device holds, which the tests below check instead);
- `jax.distributed.initialize`: a lone coordinator address with
  `num_processes=2` (JAX's coordinator service; on TensorFlow every process
  listens on its own address, so each is needed: refused, tested in
  tests/test_distribution.py) and the mocked call's arguments;
- `distribute_tensor` under `jax.jit` and with a `jax_layout.Format`, and
  `distribute_data_input` building a global `jax.Array` from process-local
  data (`addressable_shards`): here a tensor is never stored in blocks, and
  each step cuts the batch into the replicas' slices, checked below by the
  shape a layer sees inside the step;
- `jax.debug.inspect_array_sharding` of an activation: jit's output
  shardings. The hint is checked instead as Keras asking for it and the
  numbers it leaves.

Different here by design (the behaviour Keras checks does not apply):

- compute is data-parallel over every device of the mesh, whatever its
  axes, so a step gives each device 1/N of the batch (JAX: 1/size of the
  batch axis), and every process takes its part of each global batch even
  when a model replica spans processes (Keras: processes of one replica get
  the same data, its `DataShardingIntegrationTest`, and with one model
  replica every process the whole batch);
- a base `Distribution` cannot be set (it names no replicator); nested
  scopes are tested with `DataParallel` and `ModelParallel`;
- under `DataParallel` a variable's explicit `_layout` is what
  `get_variable_layout` returns, but its storage stays whole on every
  device: only `ModelParallel` stores blocks;
- the TF trainer's replica threads do not see Keras' thread-local
  distribution, so a layer asks for its output hint outside steps only
  (when Keras builds the model); a hint changes no value either way.
"""

import contextlib
import functools
import logging
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.distribution import distribution_lib

import keras_replicator as kr
from keras_replicator._src.cluster import config as cluster_lib
from keras_replicator._src.distribution import processes
from tests import helpers

NUM_DEVICES = 8


@pytest.fixture(autouse=True)
def no_distribution():
    keras.distribution.set_distribution(None)
    yield
    keras.distribution.set_distribution(None)


def _devices(count=NUM_DEVICES):
    return keras.distribution.list_devices()[:count]


def _mesh(shape=(4, 2), axes=("batch", "model")):
    return keras.distribution.DeviceMesh(
        shape, list(axes), _devices(int(np.prod(shape)))
    )


def _model_parallel(layouts, shape=(4, 2), axes=("batch", "model")):
    layout_map = keras.distribution.LayoutMap(_mesh(shape, axes))
    for key, axes_ in layouts.items():
        layout_map[key] = axes_
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name=axes[0]
    )


def _whole_everywhere(variable):
    shape = tuple(variable.shape)
    return kr.shard_shapes(variable) == {d: shape for d in _devices()}


# --- Meshes and layouts ------------------------------------------------------


def test_a_mesh_keeps_its_shape_axes_and_device_grid():
    devices = _devices()
    kind = devices[0].split(":")[0]
    assert len(keras.distribution.list_devices(kind)) == NUM_DEVICES
    assert distribution_lib.get_device_count(kind) == NUM_DEVICES
    mesh = keras.distribution.DeviceMesh((4, 2), ["batch", "model"], devices)
    assert mesh.shape == (4, 2)
    assert mesh.axis_names == ["batch", "model"]
    assert mesh.devices.shape == (4, 2)
    # Row-major: device 3 is batch 1, model 1.
    assert mesh.devices[1, 1] == devices[3]


def test_a_mesh_refuses_empty_mismatched_or_wrongly_sized_arguments():
    devices = _devices(4)
    with pytest.raises(ValueError, match="cannot be empty"):
        keras.distribution.DeviceMesh((4,), "", devices)
    with pytest.raises(ValueError, match="should have same size"):
        keras.distribution.DeviceMesh((4, 2), ["batch"], devices)
    with pytest.raises(ValueError, match="does not match the number"):
        keras.distribution.DeviceMesh((4, 2), ["batch", "model"], devices)


def test_a_layout_checks_its_axes_against_its_mesh_now_or_when_given_one():
    mesh = _mesh()
    layout = keras.distribution.TensorLayout(("batch", None), mesh)
    assert layout.device_mesh is mesh
    assert layout.axes == ("batch", None)
    with pytest.raises(ValueError, match="Invalid axis names"):
        keras.distribution.TensorLayout(("batch", "unknown", None), mesh)

    later = keras.distribution.TensorLayout((None, "model"))
    assert later.device_mesh is None
    # No mesh, no backend layout (the TensorFlow hook says so as JAX's).
    with pytest.raises(ValueError, match="device mesh is not set"):
        later.backend_layout  # noqa: B018
    later.device_mesh = mesh
    assert later.device_mesh is mesh
    assert later.axes == (None, "model")

    wrong = keras.distribution.TensorLayout(("batch", "unknown", None))
    with pytest.raises(ValueError, match="Invalid axis names"):
        wrong.device_mesh = mesh


def test_nested_scopes_restore_the_outer_distribution_and_its_replicator():
    outer = keras.distribution.DataParallel(devices=_devices(4))
    inner = _model_parallel({".*kernel": (None, "model")})
    assert keras.distribution.distribution() is None
    with outer.scope():
        outer_strategy = tf.distribute.get_strategy()
        assert keras.distribution.distribution() is outer
        assert outer_strategy.num_replicas_in_sync == 4
        with inner.scope():
            assert keras.distribution.distribution() is inner
            assert tf.distribute.get_strategy().num_replicas_in_sync == 8
        assert keras.distribution.distribution() is outer
        assert tf.distribute.get_strategy() is outer_strategy
    assert keras.distribution.distribution() is None
    assert not tf.distribute.has_strategy()
    # One replicator per distribution object, each time it is entered.
    with outer.scope():
        assert tf.distribute.get_strategy() is outer_strategy


# --- DataParallel and ModelParallel layouts ----------------------------------


def test_data_parallel_from_a_mesh_from_devices_or_from_every_device():
    mesh = _mesh((NUM_DEVICES,), ("data",))
    assert distribution_lib.Distribution(mesh).device_mesh is mesh
    from_mesh = keras.distribution.DataParallel(device_mesh=mesh)
    assert from_mesh.device_mesh is mesh
    assert from_mesh.batch_dim_name == "data"
    assert from_mesh.num_processes == 1
    assert not from_mesh._is_multi_process
    assert from_mesh.num_model_replicas == NUM_DEVICES
    for distribution in (
        keras.distribution.DataParallel(devices=_devices()),
        keras.distribution.DataParallel(),
    ):
        assert distribution.device_mesh.axis_names == ["batch"]
        assert distribution.batch_dim_name == "batch"
        assert list(distribution.device_mesh.devices) == _devices()


def test_data_parallel_lays_out_data_by_batch_and_variables_whole():
    mesh = _mesh((NUM_DEVICES,), ("data",))
    distribution = keras.distribution.DataParallel(device_mesh=mesh)
    data = distribution.get_data_layout((4, 2, 2))
    assert data.device_mesh is mesh
    assert data.axes == ("data", None, None)
    assert distribution.get_tensor_layout("path/to/tensor") is None
    with distribution.scope():
        variable = keras.Variable([1.0, 2.0, 3.0])
    layout = distribution.get_variable_layout(variable)
    assert layout.device_mesh is mesh
    assert layout.axes == (None,)
    assert _whole_everywhere(variable)
    np.testing.assert_array_equal(variable.numpy(), [1.0, 2.0, 3.0])
    # A layout the variable carries comes first.
    explicit = keras.distribution.TensorLayout(
        ["x"], _mesh((NUM_DEVICES,), ("x",))
    )
    variable._layout = explicit
    assert distribution.get_variable_layout(variable) is explicit
    # Its storage: whole on every device, as only ModelParallel stores
    # blocks (JAX would split it along "x").
    with distribution.scope():
        carried = keras.Variable(np.ones(8, "float32"), layout=explicit)
    assert _whole_everywhere(carried)
    dataset = tf.data.Dataset.range(8)
    assert distribution.distribute_dataset(dataset) is dataset


def test_model_parallel_lays_out_and_stores_variables_data_and_tensors():
    distribution = _model_parallel(
        {
            ".*kernel": (None, "model"),
            ".*bias": ("model",),
            "/model/layer/tensor": ("data", None),
        },
        shape=(2, 4),
        axes=("data", "model"),
    )
    mesh = distribution.device_mesh
    assert distribution.num_model_replicas == 2
    data = distribution.get_data_layout((4, 2, 2))
    assert data.device_mesh is mesh
    assert data.axes == ("data", None, None)
    tensor = distribution.get_tensor_layout("/model/layer/tensor")
    assert tensor.axes == ("data", None)
    assert tensor.device_mesh is mesh
    assert distribution.get_tensor_layout("/model/layer/other") is None

    kernel_value = np.arange(32, dtype="float32").reshape(8, 4)
    with distribution.scope():
        kernel = keras.Variable(kernel_value, name="kernel")
        bias = keras.Variable(np.arange(4, dtype="float32"), name="bias")
        seed = keras.random.SeedGenerator(1)
        explicit = keras.Variable(
            kernel_value,
            name="kernel",
            layout=keras.distribution.TensorLayout(("model", None), mesh),
        )
    expected = {"kernel": (None, "model"), "bias": ("model",)}
    for variable, block in ((kernel, (8, 1)), (bias, (1,))):
        layout = distribution.get_variable_layout(variable)
        assert layout.device_mesh is mesh
        assert layout.axes == expected[variable.name]
        assert set(kr.shard_shapes(variable).values()) == {block}
    # Device r holds column block r % 4 (the model axis), whole rows.
    for replica in range(NUM_DEVICES):
        np.testing.assert_array_equal(
            kernel._value.values[replica].numpy(),
            kernel_value[:, replica % 4 : replica % 4 + 1],
        )
    np.testing.assert_array_equal(kernel.numpy(), kernel_value)
    # A variable no key matches (a seed generator's state) stays whole.
    assert distribution.get_variable_layout(seed.state).axes == (None,)
    assert _whole_everywhere(seed.state)
    # An explicit layout beats the map, in what each device stores too.
    assert distribution.get_variable_layout(explicit).axes == ("model", None)
    assert set(kr.shard_shapes(explicit).values()) == {(2, 4)}
    dataset = tf.data.Dataset.range(8)
    assert distribution.distribute_dataset(dataset) is dataset


def test_a_value_assigned_outside_the_scope_keeps_the_blocks():
    distribution = _model_parallel(
        {".*dense.*kernel": (None, "model"), ".*dense.*bias": ("model",)}
    )
    with distribution.scope():
        layer = keras.layers.Dense(8)
        layer.build((16, 16))
    rng = np.random.default_rng(0)
    kernel = rng.normal(size=(16, 8)).astype("float32")
    bias = rng.normal(size=(8,)).astype("float32")
    # As when loading weights: outside the scope, no distribution set.
    assert keras.distribution.distribution() is None
    layer.kernel.assign(kernel)
    layer.bias.assign(bias)
    assert set(kr.shard_shapes(layer.kernel).values()) == {(16, 4)}
    assert set(kr.shard_shapes(layer.bias).values()) == {(4,)}
    for replica in range(NUM_DEVICES):
        column = replica % 2
        np.testing.assert_array_equal(
            layer.kernel._value.values[replica].numpy(),
            kernel[:, column * 4 : (column + 1) * 4],
        )
        np.testing.assert_array_equal(
            layer.bias._value.values[replica].numpy(),
            bias[column * 4 : (column + 1) * 4],
        )
    np.testing.assert_array_equal(layer.kernel.numpy(), kernel)


# --- LayoutMap ---------------------------------------------------------------


def test_layout_map_stores_layouts_and_fills_in_its_mesh():
    mesh = _mesh()
    layout_map = keras.distribution.LayoutMap(mesh)
    sharded_2d = keras.distribution.TensorLayout([None, "model"])
    sharded_1d = keras.distribution.TensorLayout(["model"])
    layout_map["dense/kernel"] = sharded_2d
    layout_map["dense/bias"] = sharded_1d
    layout_map["conv/bias"] = ("model",)  # a tuple: a TensorLayout
    assert len(layout_map) == 3
    assert list(layout_map) == ["dense/kernel", "dense/bias", "conv/bias"]
    assert list(layout_map.values())[:2] == [sharded_2d, sharded_1d]
    for key, axes in (
        ("dense/kernel", (None, "model")),
        ("dense/bias", ("model",)),
        ("conv/bias", ("model",)),
    ):
        assert layout_map[key].axes == axes
        assert layout_map[key].device_mesh is mesh
    with pytest.raises(ValueError, match="dense/kernel already exist"):
        layout_map["dense/kernel"] = sharded_2d
    with pytest.raises(ValueError, match="should be a TensorLayout"):
        layout_map["conv/kernel"] = ["model", None]

    assert layout_map.pop("dense/kernel") is sharded_2d
    with pytest.raises(KeyError):
        layout_map.pop(".*bias")  # an exact key, never a regex
    del layout_map["dense/bias"]
    assert list(layout_map) == ["conv/bias"]


def test_layout_map_lookup_takes_an_exact_key_then_one_regex():
    layout_map = keras.distribution.LayoutMap(_mesh())
    layout_map["dense/kernel"] = (None, "model")
    layout_map["dense/bias"] = ("model",)
    layout_map[".*dense.*kernel"] = (None, None)
    layout_map[".*dense.*bias"] = (None,)
    layout_map[".*bias"] = ("model",)
    assert layout_map["dense/kernel"].axes == (None, "model")
    assert layout_map["dense/bias"].axes == ("model",)
    assert layout_map["dense_2/kernel"].axes == (None, None)
    with pytest.raises(ValueError, match="'dense_2/bias' matches multiple"):
        layout_map["dense_2/bias"]  # noqa: B018
    assert layout_map["conv2d/kernel"] is None
    assert layout_map["conv2d/bias"].axes == ("model",)


def _two_dense(units=16):
    inputs = keras.Input((12,))
    hidden = keras.layers.Dense(units, activation="relu", name="d1")(inputs)
    return keras.Model(inputs, keras.layers.Dense(4, name="d2")(hidden))


def test_an_exact_variable_path_wins_over_a_regex_in_a_model():
    keras.distribution.set_distribution(
        _model_parallel(
            {"d1/kernel": (None, "model"), ".*kernel": ("model", None)}
        )
    )
    model = _two_dense()
    # d1/kernel (12, 16): its own key splits the columns; d2/kernel
    # (16, 4) takes the regex: its rows.
    assert set(kr.shard_shapes(model.get_layer("d1").kernel).values()) == {
        (12, 8)
    }
    assert set(kr.shard_shapes(model.get_layer("d2").kernel).values()) == {
        (8, 4)
    }


def test_a_variable_path_two_keys_match_is_refused_when_built():
    keras.distribution.set_distribution(
        _model_parallel({".*d1.*bias": ("model",), ".*bias": (None,)})
    )
    with pytest.raises(ValueError, match="'d1/bias' matches multiple") as info:
        _two_dense()
    assert "'.*d1.*bias', '.*bias'" in str(info.value)


# --- Datasets over processes -------------------------------------------------


@pytest.fixture
def processes_of(monkeypatch):
    """Records this process as `process_id` of `count` (no server starts).

    What `keras.distribution.initialize()` records after joining them, so
    `num_processes()`, `process_id()` and the dataset cut see them.
    """

    def record(process_id, count=2):
        hosts = [f"localhost:{port}" for port in range(1, count + 1)]
        joined = processes.Processes(
            cluster=cluster_lib.make_tf_config(hosts, process_id),
            replicas_per_worker=NUM_DEVICES // count,
            device_type="cpu",
        )
        monkeypatch.setattr(processes, "_state", [joined])

    return record


def _mesh_distribution(shape, **kwargs):
    # Named devices: a mesh over processes is never made current here.
    devices = [f"cpu:{i}" for i in range(int(np.prod(shape)))]
    mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"], devices)
    return keras.distribution.ModelParallel(
        layout_map=keras.distribution.LayoutMap(mesh),
        batch_dim_name="batch",
        **kwargs,
    )


def test_each_of_two_processes_takes_its_part_of_every_global_batch(
    processes_of,
):
    dataset = tf.data.Dataset.range(16).batch(8)
    # Keras' rebatch(4) then shard(2) gives these batches too.
    expected = {0: [[0, 1, 2, 3], [8, 9, 10, 11]], 1: [[4, 5, 6, 7]]}
    expected[1].append([12, 13, 14, 15])
    for process_id in (0, 1):
        processes_of(process_id)
        distribution = _mesh_distribution((4, 2))
        assert distribution.num_processes == 2
        part = distribution.distribute_dataset(dataset)
        batches = [b.tolist() for b in part.as_numpy_iterator()]
        assert batches == expected[process_id]
        # The length is kept (Keras' own cut loses it).
        assert int(part.cardinality()) == 2


def test_processes_cut_each_batch_even_when_one_replica_spans_them(
    processes_of,
):
    # Keras gives every process the whole batch when the mesh has one
    # model replica; here compute is data-parallel over every device.
    processes_of(1)
    distribution = _mesh_distribution((1, 8))
    assert distribution.num_model_replicas == 1
    part = distribution.distribute_dataset(tf.data.Dataset.range(8).batch(8))
    assert [b.tolist() for b in part.as_numpy_iterator()] == [[4, 5, 6, 7]]


def test_a_batch_that_does_not_divide_is_split_as_a_replicator_splits_it(
    processes_of,
):
    # 1797 examples at batch 64 end with 5 rows. A replicator gives each of
    # its devices ceil(rows / devices) rows until they run out; each
    # process takes its devices' rows, possibly none.
    dataset = tf.data.Dataset.range(133).batch(64)
    for count, per_process, expected in (
        # 64 rows on 2 x 4 devices: 8 each; 5 rows: 1 each, the last 3
        # devices none.
        (2, 4, {0: [32, 32, 4], 1: [32, 32, 1]}),
        # 64 on 3 x 1 devices: 22, 22, 20; 5: 2, 2, 1.
        (3, 1, {0: [22, 22, 2], 1: [22, 22, 2], 2: [20, 20, 1]}),
        # 5 rows on 4 x 2 devices: 1 each; the last process gets none.
        (
            4,
            2,
            {0: [16, 16, 2], 1: [16, 16, 2], 2: [16, 16, 1], 3: [16, 16, 0]},
        ),
    ):
        rows = []
        for process_id in range(count):
            processes_of(process_id, count=count)
            distribution = keras.distribution.DataParallel(
                devices=[f"cpu:{i}" for i in range(count * per_process)]
            )
            part = distribution.distribute_dataset(dataset)
            batches = [b.tolist() for b in part.as_numpy_iterator()]
            assert [len(b) for b in batches] == expected[process_id]
            assert int(part.cardinality()) == 3
            rows.append(batches)
        # Every row once, in order: the processes' parts make each batch.
        for step in range(3):
            joined = sum((r[step] for r in rows), [])
            assert joined == list(range(64 * step, min(64 * step + 64, 133)))


def test_datasets_two_processes_cannot_cut_are_refused(processes_of):
    processes_of(0)
    distribution = _mesh_distribution((4, 2))
    with pytest.raises(ValueError, match="batch size .* is unknown"):
        distribution.distribute_dataset(tf.data.Dataset.range(16))
    # A batch whose tensors disagree on its size: one line naming them.
    mismatched = tf.data.Dataset.zip(
        (
            tf.data.Dataset.range(16).batch(8, drop_remainder=True),
            tf.data.Dataset.range(16).batch(4, drop_remainder=True),
        )
    )
    with pytest.raises(ValueError, match=r"batch sizes=\[4, 8\]") as error:
        distribution.distribute_dataset(mismatched)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="not supported for auto-sharding"):
        distribution.distribute_dataset([1, 2, 3])
    # Unless the user cuts it: then it passes unchanged.
    own = _mesh_distribution((4, 2), auto_shard_dataset=False)
    dataset = tf.data.Dataset.range(16).batch(7)
    assert own.distribute_dataset(dataset) is dataset


def test_the_process_count_reaches_keras_model_replica_arithmetic(
    processes_of,
):
    processes_of(0, count=4)
    data_parallel = keras.distribution.DataParallel(
        devices=[f"cpu:{i}" for i in range(NUM_DEVICES)]
    )
    assert data_parallel.num_processes == 4
    assert data_parallel.num_model_replicas == NUM_DEVICES
    model_parallel = _mesh_distribution((2, 4))
    assert model_parallel.num_model_replicas == 2
    shard_ids = []
    for process_id in range(4):
        processes_of(process_id, count=4)
        shard_ids.append(_mesh_distribution((2, 4)).data_shard_id)
    # Two processes per model replica share its data shard id.
    assert shard_ids == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="must be divisible by"):
        _mesh_distribution((3, 2))


def test_initialize_reads_keras_environment_variables_arguments_first(
    monkeypatch,
):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.setenv("KERAS_DISTRIBUTION_JOB_ADDRESSES", "a:1,b:2")
    monkeypatch.setenv("KERAS_DISTRIBUTION_NUM_PROCESSES", "2")
    monkeypatch.setenv("KERAS_DISTRIBUTION_PROCESS_ID", "2")
    with pytest.raises(ValueError, match="process_id=2, num_processes=2"):
        keras.distribution.initialize()
    # Arguments override the variables: one process, nothing to join.
    keras.distribution.initialize("localhost:1", 1, 0)
    monkeypatch.setenv("KERAS_DISTRIBUTION_JOB_ADDRESSES", "localhost:1")
    monkeypatch.setenv("KERAS_DISTRIBUTION_NUM_PROCESSES", "1")
    monkeypatch.setenv("KERAS_DISTRIBUTION_PROCESS_ID", "0")
    keras.distribution.initialize()
    for name in ("JOB_ADDRESSES", "NUM_PROCESSES", "PROCESS_ID"):
        monkeypatch.delenv(f"KERAS_DISTRIBUTION_{name}")
    keras.distribution.initialize()
    assert processes.current() is None
    assert distribution_lib.distribution_lib.num_processes() == 1
    assert keras.distribution.list_devices() == _devices()


# --- End to end: fit inside scope() equals one device ------------------------


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 12)).astype("float32")
    y = rng.normal(size=(64, 4)).astype("float32")
    return x, y


class _BatchShapes(keras.layers.Layer):
    """Records the shape it sees inside each replica step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.in_step = set()

    def call(self, x):
        if (
            tf.distribute.has_strategy()
            and tf.distribute.get_replica_context() is not None
        ):
            self.in_step.add(tuple(x.shape))
        return x


def _fit(scope=None):
    """Builds (auto-named Dense layers) and fits: model, losses, capture."""
    keras.utils.set_random_seed(5)
    capture = _BatchShapes()
    with scope or contextlib.nullcontext():
        inputs = keras.Input((12,))
        hidden = keras.layers.Dense(16, activation="relu")(inputs)
        hidden = capture(hidden)
        outputs = keras.layers.Dense(4)(hidden)
        model = keras.Model(inputs, outputs)
        model.compile(keras.optimizers.Adam(0.01), "mse")
        x, y = _data()
        history = model.fit(
            x, y, batch_size=16, epochs=2, shuffle=False, verbose=0
        )
    return model, history.history["loss"], capture


@functools.cache
def _one_device():
    keras.distribution.set_distribution(None)
    model, losses, _ = _fit()
    return model.get_weights(), losses


def test_data_parallel_over_every_device_built_in_scope_is_one_device():
    weights, losses = _one_device()
    distribution = keras.distribution.DataParallel()
    model, got, capture = _fit(distribution.scope())
    assert model.distribute_strategy.num_replicas_in_sync == NUM_DEVICES
    assert all(_whole_everywhere(w) for w in model.weights)
    # Each device computes its 1/8 of the global batch of 16.
    assert capture.in_step == {(2, 16)}
    helpers.assert_close(got, losses, "losses")
    helpers.assert_weights_close(model.get_weights(), weights)


# Keras' end-to-end ModelParallel test with and without its output key
# ("batch", None): one run with it (the fit without a hint is the guide's,
# tests/test_distribution.py), one with a key that splits the model axis.
@pytest.mark.parametrize(
    "output_layout",
    [("batch", None), (None, "model")],
    ids=["batch_output", "model_output"],
)
def test_model_parallel_built_in_scope_is_one_device(
    output_layout, monkeypatch, caplog
):
    weights, losses = _one_device()
    layouts = {
        ".*dense.*kernel": (None, "model"),
        ".*dense.*bias": ("model",),
        ".*dense.*output": output_layout,
    }
    distribution = _model_parallel(layouts)
    asked = []

    def get_tensor_layout(path):
        layout = type(distribution).get_tensor_layout(distribution, path)
        asked.append((path, layout))
        return layout

    monkeypatch.setattr(distribution, "get_tensor_layout", get_tensor_layout)
    with caplog.at_level(logging.WARNING, logger="keras_replicator"):
        model, got, capture = _fit(distribution.scope())
    kernels = [w for w in model.weights if "kernel" in w.path]
    biases = [w for w in model.weights if "bias" in w.path]
    assert [set(kr.shard_shapes(w).values()) for w in kernels] == [
        {(12, 8)},
        {(16, 2)},
    ]
    assert [set(kr.shard_shapes(w).values()) for w in biases] == [
        {(8,)},
        {(2,)},
    ]
    # Compute is data-parallel over all 8 devices, whatever the mesh axes.
    assert capture.in_step == {(2, 16)}
    hinted = {
        path
        for path, layout in asked
        if layout is not None and re.fullmatch(".*dense.*output", path)
    }
    # Keras asked for both Dense layers' output layout and got it.
    assert len(hinted) == 2, asked
    # An output key names activations: not "a key that matched no variable".
    assert not [r for r in caplog.records if "no variable" in r.message]
    helpers.assert_close(got, losses, "losses")
    helpers.assert_weights_close(model.get_weights(), weights)
