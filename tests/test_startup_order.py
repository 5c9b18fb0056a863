"""Start-up order traps: TensorFlow ran an op before the replicator.

Each case needs a fresh process (TensorFlow's runtime starts once), so each
runs as a subprocess: one for the two traps, one for the import-time fix.
"""

import json
import os
import subprocess
import sys

import numpy as np

from tests.multi_worker import harness

TRAPS = """
import json, os
import tensorflow as tf
tf.constant(1.0) + 1  # e.g. a one-device reference, before anything else
import keras_replicator as kr
out = {}
try:
    kr.LocalReplicator(4)
except RuntimeError as e:
    out["local"] = str(e)
os.environ["TF_CONFIG"] = json.dumps({
    "cluster": {"worker": ["127.0.0.1:1"]},
    "task": {"type": "worker", "index": 0}})
try:
    kr.MultiWorkerReplicator()
except RuntimeError as e:
    out["multi_worker"] = str(e)
print("RESULT", json.dumps(out))
"""

IMPORT_FIRST = """
import json
import keras_replicator as kr  # first: splits the CPU before TF starts
import keras, numpy as np, tensorflow as tf

x = np.arange(32, dtype="float32").reshape(16, 2) / 32
y = x.sum(1, keepdims=True)

def train(strategy):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return [w.tolist() for w in model.get_weights()]

reference = train(tf.distribute.get_strategy())  # TF runs ops first
replicated = train(kr.LocalReplicator(4))        # and 4 replicas still work
print("RESULT", json.dumps({"reference": reference, "replicated": replicated}))
"""


def _run(script):
    env = dict(
        os.environ,
        TF_CPP_MIN_LOG_LEVEL="3",
        PYTHONPATH=str(harness.REPO_ROOT),
    )
    env.pop("TF_CONFIG", None)
    env.pop("KERAS_REPLICATOR_SPLIT_CPU", None)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[-1][len("RESULT ") :])


def test_each_trap_names_its_cause_and_fix():
    out = _run(TRAPS)
    local = out["local"]
    assert "TensorFlow ran an op before" in local  # cause
    assert "put `import keras_replicator`" in local  # fix
    assert "configure_cpu_replicas(4)" in local
    assert "restart the program or kernel" in local
    assert "Received: num_replicas=4, logical CPU devices=1" in local
    multi = out["multi_worker"]
    assert "must be created before TensorFlow runs its first op" in multi
    assert "already ran TensorFlow code" in multi  # cause
    assert "Fix: create the replicator" in multi
    assert "Received: TensorFlow already started on task worker:0" in multi


def test_importing_keras_replicator_first_is_enough_for_cpu_replicas():
    out = _run(IMPORT_FIRST)
    # 4 replicas, created after TensorFlow ran, train like one device.
    for got, want in zip(out["replicated"], out["reference"], strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
