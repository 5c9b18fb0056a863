"""Saves and reads of a sharded model over 2 processes (one device each).

A JAX-style script: every process calls `save_weights` and `model.save`
with the same path. The chief writes, the other process only joins the
gathers (no h5py lock error, no file of its own), and the files load on
one device, under `DataParallel` and on another mesh. A read by the chief
alone (`if chief: model.get_weights()`) ends in a clear error within the
collective timeout instead of waiting forever.
"""

import keras
import numpy as np
import pytest

from tests.multi_worker import harness

WORKER = """
import json, os, sys, time
import keras, numpy as np, tensorflow as tf
import keras_replicator as kr
from tests.multi_worker import harness

out, read_done = sys.argv[1], sys.argv[2]
keras.distribution.initialize()
devices = keras.distribution.list_devices()
mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), devices)
layout_map = keras.distribution.LayoutMap(mesh)
layout_map[".*kernel"] = (None, "model")
keras.distribution.set_distribution(
    keras.distribution.ModelParallel(layout_map=layout_map,
                                     batch_dim_name="batch"))
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, name="h"),
                          keras.layers.Dense(4, name="o")])
model.compile(keras.optimizers.Adam(0.01), "mse")
x = np.random.default_rng(0).normal(size=(32, 6)).astype("float32")
data = tf.data.Dataset.from_tensor_slices((x, x[:, :4])).batch(8)
model.fit(data, epochs=1, verbose=0)
# Every process, the same paths.
model.save_weights(os.path.join(out, "model.weights.h5"))
model.save(os.path.join(out, "model.keras"))
report = {
    "weights": [w.tolist() for w in model.get_weights()],
    "blocks": list(kr.shard_shapes(model.get_layer("h").kernel).values()),
}
strategy = tf.distribute.get_strategy()
# The bound of a read; a test makes it short (the default is the
# replicator's collective timeout, else 60 s).
strategy._collective_timeout_seconds = 5
if strategy.is_chief:
    started = time.monotonic()
    try:
        model.get_weights()
    except RuntimeError as error:
        report["alone"] = str(error)
    report["alone_seconds"] = time.monotonic() - started
    open(read_done, "w").close()
else:
    # Alive, elsewhere, until the chief's lone read has ended: only the
    # read's own bound can end it. Bounded, should the chief never write.
    deadline = time.monotonic() + 120
    while not os.path.exists(read_done) and time.monotonic() < deadline:
        time.sleep(0.1)
harness.write_result(report)
"""


@pytest.mark.multi_worker
@pytest.mark.timeout(420)
@pytest.mark.parametrize("transport", ["grpc", "mpi"])
def test_every_process_saves_the_chief_writes_and_a_lone_read_fails(
    tmp_path, transport
):
    saved = tmp_path / "saved"
    saved.mkdir()
    results = harness.run_workers(
        WORKER,
        num_workers=2,
        replicas_per_worker=1,
        timeout=300,
        args=[str(saved), str(tmp_path / "read_done")],
        transport=transport,
    )
    chief, other = (r.result for r in results)
    # One device each, holding half of the hidden kernel (6, 8).
    assert chief["blocks"] == other["blocks"] == [[6, 4], [6, 4]]
    assert "alone" not in other
    assert "every process must read it" in chief["alone"]
    assert "Received: variable path='sequential/h/kernel'" in chief["alone"]
    # Ended by its 5 s bound: the other process waited for it (120 s).
    assert chief["alone_seconds"] < 20
    trained = [np.asarray(w) for w in chief["weights"]]
    for a, b in zip(trained, other["weights"], strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    # Only the chief wrote: no lock error, no other file.
    assert sorted(p.name for p in saved.iterdir()) == [
        "model.keras",
        "model.weights.h5",
    ]
    for r in results:
        assert "unable to lock file" not in r.output

    def build():
        keras.utils.set_random_seed(1)
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8, name="h"),
                keras.layers.Dense(4, name="o"),
            ]
        )
        model.compile(keras.optimizers.Adam(0.01), "mse")
        model.optimizer.build(model.trainable_variables)
        return model

    def mesh(shape):
        devices = keras.distribution.list_devices()[: int(np.prod(shape))]
        layout_map = keras.distribution.LayoutMap(
            keras.distribution.DeviceMesh(shape, ("batch", "model"), devices)
        )
        layout_map[".*kernel"] = (None, "model")
        return keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )

    devices = keras.distribution.list_devices()
    for distribution in (
        None,
        keras.distribution.DataParallel(devices=devices[:4]),
        mesh((2, 2)),
    ):
        keras.distribution.set_distribution(distribution)
        try:
            model = build()
            model.load_weights(saved / "model.weights.h5")
            loaded = model.get_weights()
        finally:
            keras.distribution.set_distribution(None)
        for a, b in zip(trained, loaded, strict=True):
            np.testing.assert_array_equal(a, b)
    whole = keras.models.load_model(saved / "model.keras")
    for a, b in zip(trained, whole.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
