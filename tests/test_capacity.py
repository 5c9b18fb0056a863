"""Per-device memory under ModelParallel: what a device holds, and the numbers.

Sharded variables are created block by block (`sharding/block_draw.py`):
a Keras random initializer's draw is made in chunks of rows, each cut to
the blocks at once, so the full value never exists; a constant fill makes
block-shaped tensors. These tests show the blocks hold one device's numbers
bit for bit, for every initializer and layout shape, and that the full
value was not drawn. The per-process memory itself is measured by
`benchmarks/capacity.py` (one device per process), not asserted here.
"""

import os

import keras
import numpy as np
import pytest

import keras_replicator as kr
from keras_replicator._src.sharding import block_draw
from keras_replicator._src.sharding import layout
from keras_replicator._src.sharding import sharded
from tests import helpers

_INITIALIZERS = [
    keras.initializers.RandomUniform(-0.3, 0.7, seed=3),
    keras.initializers.RandomNormal(0.1, 0.5, seed=4),
    keras.initializers.TruncatedNormal(0.0, 2.0, seed=5),
    keras.initializers.VarianceScaling(2.0, "fan_avg", "uniform", seed=6),
    keras.initializers.VarianceScaling(1.0, "fan_in", "truncated_normal"),
    keras.initializers.VarianceScaling(
        1.0, "fan_out", "untruncated_normal", seed=7
    ),
    "glorot_uniform",
    "he_normal",
    "lecun_uniform",
    "zeros",
    "ones",
    keras.initializers.Constant(0.25),
]


@pytest.fixture(autouse=True)
def no_distribution():
    keras.distribution.set_distribution(None)
    yield
    keras.distribution.set_distribution(None)


def _model_parallel(shape, axes):
    return helpers.model_parallel(shape, {".*kernel": axes})


def _kernel(initializer, shape):
    # Seeded twice the same way: an unseeded initializer draws from Keras'
    # global seed generator, which advances as on one device.
    keras.utils.set_random_seed(11)
    layer = keras.layers.Layer(name="d")
    return layer.add_weight(
        shape=shape,
        initializer=keras.initializers.get(initializer),
        name="kernel",
    )


@pytest.mark.parametrize(
    "mesh, axes, shape",
    [
        ((1, 4), (None, "model"), (12, 8)),
        ((1, 4), ("model", None), (8, 12)),
        # Rows of 10 elements: chunks start at even rows.
        ((1, 2), (None, "model"), (7, 10)),
        ((2, 2), ("batch", "model"), (6, 10)),
        ((1, 2), (None, "model", None), (5, 4, 3)),
    ],
)
def test_blocks_are_drawn_with_one_devices_numbers(
    mesh, axes, shape, monkeypatch
):
    # Chunks of 8 elements: every block takes several.
    monkeypatch.setattr(block_draw, "CHUNK_ELEMENTS", 8)
    drawn = []
    for kind in (block_draw.Draw, block_draw.Fill):
        blocks = kind.blocks

        def spy(self, placement, replicas, blocks=blocks):
            drawn.append(type(self).__name__)
            return blocks(self, placement, replicas)

        monkeypatch.setattr(kind, "blocks", spy)
    for initializer in _INITIALIZERS:
        expected = _kernel(initializer, shape).numpy()
        keras.distribution.set_distribution(_model_parallel(mesh, axes))
        kernel = _kernel(initializer, shape)
        keras.distribution.set_distribution(None)
        local = next(iter(kr.shard_shapes(kernel).values()))
        assert local != shape, (initializer, local)
        np.testing.assert_array_equal(kernel.numpy(), expected, initializer)
        for r in range(int(np.prod(mesh))):
            block = sharded.block_numpy(kernel, r)
            assert block.shape == local
    # Every initializer above skipped the full value.
    assert len(drawn) == len(_INITIALIZERS)


def test_other_initializers_cut_the_full_value_with_one_devices_numbers():
    for initializer in ("orthogonal", "identity"):
        expected = _kernel(initializer, (8, 8)).numpy()
        keras.distribution.set_distribution(
            _model_parallel((1, 4), (None, "model"))
        )
        kernel = _kernel(initializer, (8, 8))
        keras.distribution.set_distribution(None)
        assert kr.shard_shapes(kernel)["cpu:0"] == (8, 2)
        np.testing.assert_array_equal(kernel.numpy(), expected)


def test_load_weights_cuts_blocks_from_the_files_arrays(tmp_path, monkeypatch):
    def build():
        keras.utils.set_random_seed(2)
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(12, name="h")]
        )
        model.compile(keras.optimizers.Adam(), "mse")
        model.optimizer.build(model.trainable_variables)
        return model

    one = build()
    one.fit(np.ones((8, 8)), np.ones((8, 12)), verbose=0)
    one.save_weights(tmp_path / "one.weights.h5")
    assigned = []
    assign = sharded.assign

    def spy(variable, value):
        assigned.append((variable.path, type(value).__name__))
        return assign(variable, value)

    monkeypatch.setattr(sharded, "assign", spy)
    keras.distribution.set_distribution(
        _model_parallel((1, 4), (None, "model"))
    )
    try:
        model = build()
        assigned.clear()
        model.load_weights(tmp_path / "one.weights.h5")
    finally:
        keras.distribution.set_distribution(None)
    # The kernel and its two Adam slots, each from the file's array (an
    # h5py dataset before Keras 3.12, of which only the blocks are read).
    kernel = model.get_layer("h").kernel
    paths = [model.optimizer.variables[i].path for i in (2, 3)]
    assert sorted(p for p, _ in assigned) == sorted(paths + [kernel.path])
    assert {kind for _, kind in assigned} <= {"ndarray", "Dataset"}, assigned
    assert kr.shard_shapes(kernel)["cpu:0"] == (8, 3)
    for a, b in zip(one.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("max_shard_size", [None, 0.004])
def test_load_weights_maps_large_values_instead_of_reading_them(
    tmp_path, monkeypatch, dtype, max_shard_size
):
    """Values of 1 MB or more reach `assign` as read-only maps of the file.

    Keras 3.12+ reads each value whole into a NumPy array; under
    ModelParallel the file's value is mapped instead, so only the blocks
    are read. Also from Keras' sharded h5 files (`max_shard_size` in GB:
    4 MB here, so the two large values sit in different files).
    """
    if max_shard_size and keras.version() < "3.12":
        # Keras 3.10 itself refuses this file in this test ("the saved
        # optimizer has 2 variables"), with or without the map.
        pytest.skip(f"Keras {keras.version()} misreads sharded h5 files here")

    def build():
        keras.utils.set_random_seed(2)
        model = keras.Sequential(
            [
                keras.Input((512,)),
                keras.layers.Dense(1024, name="h", dtype=dtype),
                keras.layers.Dense(1024, name="o", dtype=dtype),
            ]
        )
        model.compile(keras.optimizers.Adam(), "mse")
        model.optimizer.build(model.trainable_variables)
        return model

    one = build()
    one.fit(np.ones((8, 512)), np.ones((8, 1024)), verbose=0)
    if max_shard_size:
        path = tmp_path / "one.weights.json"
        one.save_weights(path, max_shard_size=max_shard_size)
        assert len(list(tmp_path.glob("one_*.weights.h5"))) > 1
    else:
        path = tmp_path / "one.weights.h5"
        one.save_weights(path)
    assigned = {}
    assign = sharded.assign

    def spy(variable, value):
        assigned[variable.path] = type(value).__name__
        return assign(variable, value)

    monkeypatch.setattr(sharded, "assign", spy)
    keras.distribution.set_distribution(
        _model_parallel((1, 4), (None, "model"))
    )
    try:
        model = build()
        assigned.clear()
        model.load_weights(path)
        loaded = model.get_weights()
    finally:
        keras.distribution.set_distribution(None)
    # Each kernel (2 or 4 MB) and its 2 Adam slots: maps, not arrays.
    assert len(assigned) == 6 and set(assigned.values()) == {"memmap"}, assigned
    for a, b in zip(one.get_weights(), loaded, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    # Without a distribution, Keras reads as it does.
    plain = build()
    plain.load_weights(path)
    for a, b in zip(one.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_file_value_is_mapped_only_where_its_bytes_mean_it(tmp_path):
    """`mapped_dataset`: a map where the raw bytes are the array, else None."""
    import h5py

    big = np.arange(1 << 18, dtype=">f4").reshape(512, 512)  # 1 MB, big-endian
    path = tmp_path / "values.h5"
    with h5py.File(path, "w") as f:
        f["big_endian"] = big
        f["small"] = np.ones((4, 4), "float32")
        f.create_dataset("chunked", data=big.astype("<f4"), chunks=(64, 64))
        narrow = h5py.h5t.STD_I32LE.copy()
        narrow.set_precision(24)  # Read as int32 by h5py, converted.
        space = h5py.h5s.create_simple((512, 512))
        h5py.h5d.create(f.id, b"int24", narrow, space).write(
            h5py.h5s.ALL, h5py.h5s.ALL, np.ones((512, 512), "int32")
        )
    with h5py.File(path, "r") as f:
        mapped = sharded.mapped_dataset(f["big_endian"])
        assert isinstance(mapped, np.memmap)
        np.testing.assert_array_equal(mapped, big)
        assert sharded.mapped_dataset(f["small"]) is None  # Under 1 MB.
        assert sharded.mapped_dataset(f["chunked"]) is None
        assert sharded.mapped_dataset(f["int24"]) is None
        # Another file renamed into the path since it was opened.
        other = tmp_path / "other.h5"
        with h5py.File(other, "w") as g:
            g["big_endian"] = big
        os.replace(other, path)
        assert sharded.mapped_dataset(f["big_endian"]) is None


def _resident_kib(path):
    """This process's resident KiB of its mappings of the file `path`."""
    total, current = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if fields and "-" in fields[0] and len(fields) >= 5:
                current = line.rstrip().endswith(str(path))
            elif current and line.startswith("Rss:"):
                total += int(fields[1])
    return total


@pytest.mark.skipif(
    not os.path.exists("/proc/self/smaps"), reason="Linux's /proc only"
)
def test_a_block_of_a_mapped_file_leaves_none_of_its_pages_resident(
    tmp_path,
):
    # A table cut along its hidden size: every page holds part of each
    # block, so a plain slice makes the whole file resident.
    full = np.arange(4096 * 1024, dtype="float32").reshape(4096, 1024)
    path = tmp_path / "table.bin"
    full.tofile(path)
    mapped = np.memmap(path, dtype="float32", mode="r", shape=full.shape)
    placement = layout.Placement(
        path="table",
        full_shape=full.shape,
        mesh_shape=(1, 4),
        axis_names=("batch", "model"),
        dim_axes=(None, 1),
        devices=tuple(f"/cpu:{i}" for i in range(4)),
    )
    for replica in range(4):
        block = placement.block(mapped, replica)
        np.testing.assert_array_equal(
            block, full[:, replica * 256 : (replica + 1) * 256]
        )
        # A copy, so the map can close; and the file's 16 MiB are not held.
        assert not isinstance(block, np.memmap)
        assert _resident_kib(path) < 1024, _resident_kib(path)
    mapped[:, :256].copy()
    assert _resident_kib(path) > 8 * 1024  # What a plain slice holds.
