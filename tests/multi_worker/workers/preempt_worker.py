"""Worker of the preemption tests: a plain `BackupAndRestore` fit.

argv: <backup dir>. The script is what a user writes (a replicator, a
model, `fit(..., callbacks=[keras.callbacks.BackupAndRestore(dir)])`); the
environment adds test instrumentation:

- `PREEMPT_REPLICATOR`: "multi" (`MultiWorkerReplicator()`, the default),
  "local" (`LocalReplicator(2)`) or "auto" (`kr.auto()`).
- `PREEMPT_DATA`: "arrays" (shuffled NumPy arrays, the default),
  "dataset" (a seeded, reshuffled `tf.data` dataset) or "distribute"
  (`replicator.distribute` with a shuffle seed).
- `PREEMPT_SAVE_FREQ`: `BackupAndRestore(save_freq=...)` as an int.
- `PREEMPT_MARK` / `PREEMPT_MARK_STEP`: after that many train steps of the
  whole run (counted from the first epoch), the worker writes its pid to
  `PREEMPT_MARK` ("{index}" is its task index) and from then on sleeps
  `PREEMPT_SLOW` seconds per step, so a test can signal it mid-epoch.
- `PREEMPT_KILL_ONCE`: a path; worker 1 kills itself with SIGKILL at the
  mark step if the path does not exist yet (and creates it).
- `PREEMPT_DIE_ON_SAVE`: N; worker 0's N-th weights save writes its file,
  then the process kills itself with SIGKILL (killed mid-backup).

At the end it reports its final weights and the (epoch, batch) of every
step it trained.
"""

import os
import signal
import sys
import time

import keras_replicator as kr

KIND = os.environ.get("PREEMPT_REPLICATOR", "multi")
# Create the replicator first: it splits the CPU before TF starts.
if KIND == "local":
    replicator = kr.LocalReplicator(2)
elif KIND == "auto":
    replicator = kr.auto()
else:
    replicator = kr.MultiWorkerReplicator()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.multi_worker import harness  # noqa: E402

STEPS_PER_EPOCH = 8
EPOCHS = 3
GLOBAL_BATCH = 8

backup_dir = sys.argv[1]
data = os.environ.get("PREEMPT_DATA", "arrays")
mark = os.environ.get("PREEMPT_MARK")
mark_step = int(os.environ.get("PREEMPT_MARK_STEP", "0"))
slow = float(os.environ.get("PREEMPT_SLOW", "0.3"))
kill_once = os.environ.get("PREEMPT_KILL_ONCE")
die_on_save = int(os.environ.get("PREEMPT_DIE_ON_SAVE", "0"))
index = harness.task_index()

keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.normal(size=(STEPS_PER_EPOCH * GLOBAL_BATCH, 5)).astype("float32")
y = (x @ rng.normal(size=(5, 1))).astype("float32")

with replicator.scope():
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(4, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(keras.optimizers.Adam(0.05), "mse")

if data == "arrays":
    inputs = {"x": x, "y": y, "batch_size": GLOBAL_BATCH, "shuffle": True}
elif data == "dataset":
    dataset = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(len(x), seed=1, reshuffle_each_iteration=True)
        .batch(GLOBAL_BATCH)
    )
    inputs = {"x": dataset}
else:
    inputs = {
        "x": replicator.distribute(
            tf.data.Dataset.from_tensor_slices((x, y)),
            GLOBAL_BATCH,
            shuffle_seed=1,
        )
    }

saves = []
_save_weights = model.save_weights


def _save_then_maybe_die(*args, **kwargs):
    _save_weights(*args, **kwargs)
    saves.append(1)
    if index == 0 and len(saves) == die_on_save:
        os.kill(os.getpid(), signal.SIGKILL)


model.save_weights = _save_then_maybe_die

trained = []
current_epoch = []


def _on_batch_end(batch, logs):
    epoch = current_epoch[-1]
    trained.append((epoch, batch))
    step = epoch * STEPS_PER_EPOCH + batch + 1
    if step == mark_step and kill_once and index == 1:
        if not os.path.exists(kill_once):
            open(kill_once, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
    if mark and step == mark_step:
        with open(mark.format(index=index), "w") as f:
            f.write(str(os.getpid()))
    if mark and step >= mark_step:
        time.sleep(slow)


save_freq = os.environ.get("PREEMPT_SAVE_FREQ")
backup = keras.callbacks.BackupAndRestore(
    backup_dir, save_freq=int(save_freq) if save_freq else "epoch"
)
probe = keras.callbacks.LambdaCallback(
    on_epoch_begin=lambda epoch, logs: current_epoch.append(epoch),
    on_train_batch_end=_on_batch_end,
)
model.fit(**inputs, epochs=EPOCHS, callbacks=[backup, probe], verbose=0)
harness.write_result(
    {"weights": [w.tolist() for w in model.get_weights()], "trained": trained}
)
