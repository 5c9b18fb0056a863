"""kr.launch from a real Jupyter kernel: a function defined in a cell.

The kernel defines `train()` in a cell (so it lives in `__main__` and must
be sent by value), runs `kr.launch(train, workers=2)` twice, and compares
both workers' weights with one device. Then it starts a run that never
ends, the test interrupts the kernel, and no worker process may be left.
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

def sleeper(folder):
    with open(os.path.join(folder, str(os.getpid())), "w") as f:
        f.write("up")
    time.sleep(600)
"""

LAUNCH = """
results = kr.launch(train, 3, workers=2)
reference = one_device(3)
print("RESULT", json.dumps({
    "count": len(results),
    "backends": [r["backend"] for r in results],
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
        for run in range(2):
            reply, output = _execute(client, LAUNCH, timeout=150)
            assert reply["status"] == "ok", output
            r = _result(output)
            assert r["count"] == 2, output
            assert r["backends"] == ["MultiWorkerReplicator"] * 2
            assert r["between"] <= 1e-5, (run, r)
            assert r["to_one_device"] <= 1e-5, (run, r)
            # The workers' output streamed into the cell, prefixed.
            assert "[worker 1] replicas in sync: 2" in output
            # Progress on the chief only.
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
