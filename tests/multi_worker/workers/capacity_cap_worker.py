"""Worker of test_capacity_cap.py: one script, with a memory cap per process.

argv: <mode> <backup dir>. `mode` is "one" (no distribution: one device),
"data" (`DataParallel` over every process's device) or "model"
(`ModelParallel` on a (1, N) mesh, every kernel `(None, "model")`). The
script is the same in each: a seeded MLP of `CAP_LAYERS` x
`Dense(CAP_WIDTH)`, Adam, `fit` of one epoch of 4 steps at global batch 8
with `BackupAndRestore(save_freq=2)`.

With `CAP_CGROUP` (a cgroup v1 memory folder) the process joins that group
before it imports anything else, so the group's limit holds from the start.
With `CAP_CRASH_AFTER` every process raises after that step (a crash after
a backup; the restart resumes from it). Reports the final weights, the
steps trained and the group's peak usage.
"""

import os
import resource
import sys

GROUP = os.environ.get("CAP_CGROUP")
if GROUP:
    with open(os.path.join(GROUP, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_replicator  # noqa: E402,F401
from tests.multi_worker import harness  # noqa: E402

MODE, BACKUP = sys.argv[1], sys.argv[2]
WIDTH = int(os.environ.get("CAP_WIDTH", "4096"))
LAYERS = int(os.environ.get("CAP_LAYERS", "6"))
CRASH_AFTER = int(os.environ.get("CAP_CRASH_AFTER", "0"))
STEPS, EPOCHS, BATCH = 4, 1, 8

if MODE != "one":
    keras.distribution.initialize()
    devices = keras.distribution.list_devices()
    if MODE == "data":
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=devices)
        )
    else:
        mesh = keras.distribution.DeviceMesh(
            (1, len(devices)), ("batch", "model"), devices
        )
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*kernel"] = (None, "model")
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(
                layout_map=layout_map, batch_dim_name="batch"
            )
        )


class Steps(keras.callbacks.Callback):
    """Counts the steps this run trained; crashes after `CAP_CRASH_AFTER`."""

    def __init__(self):
        super().__init__()
        self.trained = 0
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.trained += 1
        if CRASH_AFTER and self.epoch * STEPS + batch + 1 == CRASH_AFTER:
            raise RuntimeError(f"crash after step {CRASH_AFTER}")


def peak_mb():
    """The group's peak charge and this process's peak RSS, MB."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if not GROUP:
        return {"rss": rss}
    with open(os.path.join(GROUP, "memory.max_usage_in_bytes")) as f:
        return {"charged": int(f.read()) / 2**20, "rss": rss}


keras.utils.set_random_seed(0)
model = keras.Sequential(
    [keras.Input((WIDTH,))]
    + [keras.layers.Dense(WIDTH, name=f"d{i}") for i in range(LAYERS)]
)
model.compile(keras.optimizers.Adam(1e-4), "mse")
rng = np.random.default_rng(0)
x = rng.normal(size=(STEPS * BATCH, WIDTH)).astype("float32")
y = rng.normal(size=(STEPS * BATCH, WIDTH)).astype("float32")
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
steps = Steps()
try:
    model.fit(
        data,
        epochs=EPOCHS,
        shuffle=False,
        callbacks=[
            keras.callbacks.BackupAndRestore(BACKUP, save_freq=2),
            steps,
        ],
        verbose=0,
    )
except RuntimeError:
    harness.write_result({"trained": steps.trained, "peak_mb": peak_mb()})
    raise


def summary(variable):
    """A corner and the sum of |w| of one weight, read alone (one gather)."""
    value = variable.numpy()
    corner = value[:4, :16] if value.ndim == 2 else value[:16]
    return [corner.tolist(), float(np.abs(value).sum(dtype="float64"))]


# Every process reads each weight (a sharded read gathers), one at a time.
harness.write_result(
    {
        "trained": steps.trained,
        "peak_mb": peak_mb(),
        "weights": [summary(v) for v in model.weights],
        "kernel_blocks": list(
            keras_replicator.shard_shapes(model.weights[0]).values()
        ),
    }
)
