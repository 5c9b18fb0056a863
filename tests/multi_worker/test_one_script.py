"""One unmodified script (workers/one_script.py) on every backend.

`kr.auto()`, `replicator.distribute`, `fit` and `evaluate`, the same file:
a LocalReplicator (1 process), 2 workers (2 processes) and 2 workers + 1
parameter server (4 processes); the cluster runs come from `kr.launch`.
The synchronous runs must give one device's weights; every run must count
each test example exactly once in evaluate and run the same number of
steps.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.multi_worker import harness

pytestmark = pytest.mark.multi_worker

SCRIPT = harness.REPO_ROOT / "tests/multi_worker/workers/one_script.py"
# 1437 training digits // 64 (static shapes: full batches only) x 3 epochs.
STEPS = 1437 // 64 * 3


def _one_device_weights():
    import keras
    import tensorflow as tf

    from keras_replicator._src.cli import demo

    (x, y), _ = demo.load_digits_split()
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Flatten(),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(
        keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy"
    )
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        64, drop_remainder=True
    )
    model.fit(data, epochs=3, shuffle=False, verbose=0)
    return model.get_weights()


def _check(result, backend):
    assert result["backend"] == backend
    assert result["iterations"] == STEPS
    assert result["epochs_logged"] == 3
    # Exact evaluation: every test example once, as predict counts them.
    assert result["evaluate"]["accuracy"] == pytest.approx(
        result["predict_accuracy"], abs=1e-6
    )
    assert result["evaluate"]["accuracy"] > 0.85, result["evaluate"]


def _assert_one_device(result):
    for got, want in zip(result["weights"], _one_device_weights(), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.timeout(200)
def test_runs_on_a_local_replicator(tmp_path):
    env = dict(
        os.environ,
        PYTHONPATH=str(harness.REPO_ROOT),
        KERAS_REPLICATOR_CPU_REPLICAS="2",
        **{harness.RESULT_ENV: str(tmp_path / "result.json")},
    )
    env.pop("TF_CONFIG", None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        cwd=harness.REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    _check(result, "LocalReplicator")
    _assert_one_device(result)


def _run_script(path):
    """Runs the script as `__main__` in a `kr.launch` process; its result."""
    import runpy
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        os.environ[harness.RESULT_ENV] = result
        runpy.run_path(path, run_name="__main__")
        with open(result) as f:
            return json.load(f)


@pytest.mark.timeout(260)
def test_runs_on_two_workers():
    import keras_replicator as kr

    results = kr.launch(_run_script, str(SCRIPT), workers=2)
    assert len(results) == 2
    for result in results:
        _check(result, "MultiWorkerReplicator")
    # Element sharding: worker 0's 32 + worker 1's 32 examples of a step
    # are one device's batch of 64.
    _assert_one_device(results[0])
    assert results[0]["weights"] == results[1]["weights"]


@pytest.mark.timeout(300)
def test_runs_on_two_workers_and_a_parameter_server():
    import keras_replicator as kr

    # With parameter servers the script runs on the chief only: one result.
    (result,) = kr.launch(_run_script, str(SCRIPT), workers=2, ps=1)
    # Asynchronous: not one device's weights, but the same steps (an
    # epoch is one pass: 1437 // 64 steps) and exact evaluation.
    _check(result, "AsyncReplicator")
