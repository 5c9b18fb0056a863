"""Sharded checkpoints over 2 processes (one device each).

Every process calls `kr.save_checkpoint` with the same directory. Each
writes only the blocks it holds (process 1 writes no replicated variable),
and the checkpoint loads back in both processes on the same mesh, and here
(one process, 4 CPU devices) on one device, under `DataParallel` and on a
2x2 mesh, with the trained weights and optimizer state.
"""

import json

import keras
import numpy as np
import pytest

import keras_replicator as kr
from tests.multi_worker import harness

WORKER = """
import os, sys
import keras, numpy as np, tensorflow as tf
import keras_replicator as kr
from tests.multi_worker import harness

out = sys.argv[1]
keras.distribution.initialize()
devices = keras.distribution.list_devices()
mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), devices)
layout_map = keras.distribution.LayoutMap(mesh)
layout_map[".*kernel"] = (None, "model")
keras.distribution.set_distribution(
    keras.distribution.ModelParallel(layout_map=layout_map,
                                     batch_dim_name="batch"))


def build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)),
                              keras.layers.Dense(8, name="h"),
                              keras.layers.Dense(4, name="o")])
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


def state(model):
    # Every process reads (a sharded read gathers).
    return [v.numpy().tolist()
            for v in [*model.weights, *model.optimizer.variables]]


model = build()
x = np.random.default_rng(0).normal(size=(32, 6)).astype("float32")
data = tf.data.Dataset.from_tensor_slices((x, x[:, :4])).batch(8)
model.fit(data, epochs=1, verbose=0)
ckpt = os.path.join(out, "ckpt")
kr.save_checkpoint(model, ckpt, metadata={"epoch": 1}).wait()
trained = state(model)
fresh = build()
metadata = kr.load_checkpoint(fresh, ckpt)
variables = [*model.weights, *model.optimizer.variables]
harness.write_result({"trained": trained, "loaded": state(fresh),
                      "metadata": metadata,
                      "model_weights": len(model.weights),
                      "shard_shapes": [list(kr.shard_shapes(v).values())
                                       for v in variables]})
"""


def _build():
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, name="h"),
            keras.layers.Dense(4, name="o"),
        ]
    )
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


def _mesh(shape):
    devices = keras.distribution.list_devices()[: int(np.prod(shape))]
    layout_map = keras.distribution.LayoutMap(
        keras.distribution.DeviceMesh(shape, ("batch", "model"), devices)
    )
    layout_map[".*kernel"] = (None, "model")
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )


def _assert_files_hold_own_blocks(index, folder, trained, report):
    """Each `process-<k>.bin` holds the blocks process k holds, and no more.

    Read byte for byte: each block in a file has the shape
    `kr.shard_shapes` gives process k's device (one device per process, in
    mesh order) and the values of that box of the trained variable. A
    replicated variable is in process 0's file only. The blocks tile each
    file with nothing else in it.
    """
    count = report["model_weights"]
    written = {}
    for key, entry in index["variables"].items():
        kind, _, i = key.partition("/")
        position = int(i) + (count if kind == "optimizer" else 0)
        full = np.asarray(trained[position], dtype=entry["dtype"])
        per_device = [tuple(s) for s in report["shard_shapes"][position]]
        files = [block["file"].rpartition("/")[2] for block in entry["blocks"]]
        if entry["layout"] is None:
            assert files == ["process-0.bin"], key
        else:
            assert sorted(files) == ["process-0.bin", "process-1.bin"], key
        for block in entry["blocks"]:
            name = block["file"].rpartition("/")[2]
            process = int(name[len("process-") : -len(".bin")])
            shape = tuple(block["shape"])
            expected_shape = (
                per_device[process] if entry["layout"] else full.shape
            )
            assert shape == expected_shape, (key, process, shape, per_device)
            with open(folder / name, "rb") as f:
                f.seek(block["offset"])
                raw = f.read(block["nbytes"])
            value = np.frombuffer(raw, dtype=entry["dtype"]).reshape(shape)
            box = tuple(
                slice(b, b + n)
                for b, n in zip(block["begin"], shape, strict=True)
            )
            np.testing.assert_array_equal(value, full[box], err_msg=key)
            written.setdefault(name, []).append(
                (block["offset"], block["nbytes"])
            )
    for name, spans in written.items():
        spans.sort()
        ends = [0] + [offset + n for offset, n in spans]
        assert [offset for offset, _ in spans] == ends[:-1], name
        assert (folder / name).stat().st_size == ends[-1], name


@pytest.mark.multi_worker
@pytest.mark.timeout(420)
@pytest.mark.parametrize("transport", ["grpc", "mpi"])
def test_each_process_writes_its_blocks_and_any_mesh_loads_them(
    tmp_path, transport
):
    results = harness.run_workers(
        WORKER,
        num_workers=2,
        replicas_per_worker=1,
        timeout=300,
        args=[str(tmp_path)],
        transport=transport,
    )
    chief, other = (r.result for r in results)
    trained = [np.asarray(w) for w in chief["trained"]]
    for report in (chief, other):
        assert report["metadata"] == {"epoch": 1}
        for a, b in zip(trained, report["trained"], strict=True):
            np.testing.assert_array_equal(a, np.asarray(b))
        for a, b in zip(trained, report["loaded"], strict=True):
            np.testing.assert_array_equal(a, np.asarray(b))

    index = json.loads((tmp_path / "ckpt/index.json").read_text())
    assert index["processes"] == 2
    folder = tmp_path / "ckpt" / index["checkpoint"]
    _assert_files_hold_own_blocks(index, folder, trained, chief)

    devices = keras.distribution.list_devices()
    for distribution in (
        None,
        keras.distribution.DataParallel(devices=devices[:4]),
        _mesh((2, 2)),
    ):
        keras.distribution.set_distribution(distribution)
        try:
            model = _build()
            assert kr.load_checkpoint(model, tmp_path / "ckpt") == {"epoch": 1}
            loaded = [
                v.numpy() for v in [*model.weights, *model.optimizer.variables]
            ]
        finally:
            keras.distribution.set_distribution(None)
        for a, b in zip(trained, loaded, strict=True):
            np.testing.assert_array_equal(a, b)


SLOW_PEER = """
import os, sys, time
import keras, numpy as np
import keras_replicator as kr
from keras_replicator._src.sharding import checkpoint_files
from tests.multi_worker import harness

out = sys.argv[1]
keras.distribution.initialize()
devices = keras.distribution.list_devices()
mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), devices)
layout_map = keras.distribution.LayoutMap(mesh)
layout_map[".*kernel"] = (None, "model")
keras.distribution.set_distribution(
    keras.distribution.ModelParallel(layout_map=layout_map,
                                     batch_dim_name="batch"))
model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8)])
model.compile("adam", "mse")
index = int(os.environ["TF_CONFIG"].split('"index": ')[1][0])
if index == 1:
    # This process's disk is slow: its part takes 6 s to write.
    write_part = checkpoint_files.write_part

    def slow(*args):
        time.sleep(6)
        write_part(*args)

    checkpoint_files.write_part = slow
handle = kr.save_checkpoint(model, os.path.join(out, "ckpt"))
# Meanwhile this process's own work goes on: the longest pause between
# two 10 ms sleeps, while the other process is still writing.
gaps, last = [], time.monotonic()
while not handle.done():
    time.sleep(0.01)
    now = time.monotonic()
    gaps.append(now - last)
    last = now
handle.wait()
harness.write_result({"index": index, "longest_pause": max(gaps)})
"""


@pytest.mark.multi_worker
@pytest.mark.timeout(300)
def test_waiting_for_a_slow_peer_does_not_stop_this_process(tmp_path):
    # The coordination service's barrier holds Python's GIL while it
    # waits; the writer thread must not use it, or process 0's training
    # would stop until process 1 has written.
    results = harness.run_workers(
        SLOW_PEER,
        num_workers=2,
        replicas_per_worker=1,
        timeout=200,
        args=[str(tmp_path)],
    )
    chief = next(r.result for r in results if r.result["index"] == 0)
    assert chief["longest_pause"] < 3, chief
    index = json.loads((tmp_path / "ckpt/index.json").read_text())
    assert index["processes"] == 2
