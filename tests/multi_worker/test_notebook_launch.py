"""kr.launch from a real Jupyter kernel: a function defined in a cell.

The kernel defines `train()` in a cell (so it lives in `__main__` and must
be sent by value), runs `kr.launch(train, workers=2)`, then a function that
uses `keras.distribution` alone (`initialize()`, `ModelParallel` on a
(batch 2 across the workers) x (model 2 inside each) mesh) with
`kr.launch(train_distributed, workers=2, replicas_per_worker=2)`, and
compares both workers' weights with one device each time. Then it starts
a run that never ends, the test interrupts the kernel, and no worker
process may be left.
"""

import json
import os
import time

import pytest

from tests.multi_worker import harness

pytestmark = pytest.mark.multi_worker

DEFINE = """
import json, os, time
import numpy as np
import keras_replicator as kr

def train(epochs):
    import keras
    import tensorflow as tf
    replicator = kr.auto()  # a MultiWorkerReplicator in each worker
    print("replicas in sync:", replicator.num_replicas_in_sync)
    x = np.linspace(0, 1, 96, dtype="float32").reshape(48, 2)
    y = np.stack([x.sum(1), x[:, 0] - x[:, 1]], 1)
    examples = tf.data.Dataset.from_tensor_slices((x, y))
    with replicator.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((2,)), keras.layers.Dense(8, activation="tanh"),
             keras.layers.Dense(2)])
        model.compile(keras.optimizers.SGD(0.2), "mse")
    model.fit(replicator.distribute(examples, 16), epochs=epochs, verbose=2)
    return {"backend": type(replicator).__name__,
            "weights": model.get_weights()}

def one_device(epochs):
    import keras
    x = np.linspace(0, 1, 96, dtype="float32").reshape(48, 2)
    y = np.stack([x.sum(1), x[:, 0] - x[:, 1]], 1)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(8, activation="tanh"),
         keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(0.2), "mse")
    model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return model.get_weights()

def train_distributed(epochs):
    # keras.distribution alone: initialize() finds kr.launch's cluster;
    # batch across the 2 workers, the hidden kernel split over each
    # worker's 2 devices.
    import keras
    import tensorflow as tf
    keras.distribution.initialize()
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((2, 2), ("batch", "model"), devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*hidden/kernel"] = (None, "model")
    keras.distribution.set_distribution(keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"))
    x = np.linspace(0, 1, 96, dtype="float32").reshape(48, 2)
    y = np.stack([x.sum(1), x[:, 0] - x[:, 1]], 1)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((2,)),
         keras.layers.Dense(8, activation="tanh", name="hidden"),
         keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(0.2), "mse")
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16),
              epochs=epochs, verbose=2)
    return {"backend": type(tf.distribute.get_strategy()).__name__,
            "devices": len(devices),
            "blocks": sorted({tuple(b) for b in kr.shard_shapes(
                model.get_layer("hidden").kernel).values()}),
            "weights": model.get_weights()}

def sleeper(folder):
    with open(os.path.join(folder, str(os.getpid())), "w") as f:
        f.write("up")
    time.sleep(600)
"""

LAUNCH = """
results = kr.launch(FN, 3, workers=2REPLICAS)
reference = one_device(3)
print("RESULT", json.dumps({
    "count": len(results),
    "backends": [r["backend"] for r in results],
    "devices": [r.get("devices") for r in results],
    "blocks": [r.get("blocks") for r in results],
    "between": max(float(np.abs(a - b).max()) for a, b in
                   zip(results[0]["weights"], results[1]["weights"])),
    "to_one_device": max(float(np.abs(a - b).max()) for a, b in
                         zip(results[0]["weights"], reference)),
}))
"""


_execute = harness.execute_cell


def _result(output):
    lines = [x for x in output.splitlines() if x.startswith("RESULT ")]
    assert lines, output
    return json.loads(lines[-1][len("RESULT ") :])


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(420)
def test_launch_from_a_kernel_runs_twice_and_interrupt_ends_workers(tmp_path):
    with harness.jupyter_kernel(tmp_path) as (manager, client):
        reply, output = _execute(client, DEFINE, timeout=60)
        assert reply["status"] == "ok", output
        # Twice: the replicator's function, then a keras.distribution one.
        runs = [
            ("train", "", "MultiWorkerReplicator", None, 1e-5),
            (
                "train_distributed",
                ", replicas_per_worker=2",
                "ProcessReplicator",
                4,
                1e-4,
            ),
        ]
        for fn, replicas, backend, devices, atol in runs:
            cell = LAUNCH.replace("FN", fn).replace("REPLICAS", replicas)
            reply, output = _execute(client, cell, timeout=150)
            assert reply["status"] == "ok", output
            r = _result(output)
            assert r["count"] == 2, output
            assert r["backends"] == [backend] * 2
            assert r["devices"] == [devices] * 2
            assert r["between"] <= 1e-5, (fn, r)
            assert r["to_one_device"] <= atol, (fn, r)
            # Progress on the chief only, streamed into the cell, prefixed.
            if fn == "train":
                assert "[worker 1] replicas in sync: 2" in output
            else:
                # The hidden kernel (2, 8): a (2, 4) block on each device.
                assert r["blocks"] == [[[2, 4]]] * 2, r
            assert "[worker 0] Epoch 3/3" in output
            assert "[worker 1] Epoch" not in output

        pids_dir = tmp_path / "pids"
        pids_dir.mkdir()
        msg_id = client.execute(
            f"kr.launch(sleeper, {str(pids_dir)!r}, workers=2)"
        )
        deadline = time.monotonic() + 120
        while len(list(pids_dir.iterdir())) < 2:
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.2)
        pids = [int(p.name) for p in pids_dir.iterdir()]
        assert all(_alive(pid) for pid in pids)
        manager.interrupt_kernel()
        reply = client.get_shell_msg(timeout=60)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = client.get_shell_msg(timeout=60)
        assert reply["content"]["status"] == "error"
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        assert not [pid for pid in pids if _alive(pid)]
