"""A 2-worker fit with `KERAS_REPLICATOR_TIMELINE` set by the test.

Run by tests/multi_worker/test_timeline.py under `keras-replicator launch`,
over gRPC or MPI: 2 epochs of 4 steps of a small MLP, with a
`BackupAndRestore` that saves after step 4 (the trace's one save).
"""

import sys

import keras
import numpy as np

import keras_replicator as kr
from tests.multi_worker import harness

out = sys.argv[1]
replicator = kr.MultiWorkerReplicator()
with replicator.scope():
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-3), "mse")
rng = np.random.default_rng(0)
x = rng.normal(size=(128, 16)).astype("float32")
y = rng.normal(size=(128, 1)).astype("float32")
backup = keras.callbacks.BackupAndRestore(out + "/backup", save_freq=4)
history = model.fit(
    x, y, batch_size=32, epochs=2, verbose=0, callbacks=[backup]
)
harness.write_result({"loss": [float(v) for v in history.history["loss"]]})
