"""Worker of the re-creation tests: keras.io's multi-worker guide pattern.

argv: <checkpoint dir>. The script is what the guide ("Multi-worker
distributed training with Keras") has a user write: `run_training()`
creates the strategy again each time (`kr.auto()` here), builds or
restores the model under its scope (`make_or_restore_model`) and fits
with a `ModelCheckpoint`. Round 0 builds, fits and evaluates; rounds 1 to
`RECREATE_ROUNDS` (default 3) each re-create the replicator, then, under
its scope, odd rounds `load_model` round 0's checkpoint and even rounds
build a new model, and fit with a `ModelCheckpoint`; the last round then
evaluates. Every fit is one epoch, unshuffled (`recreate_reference`).

Test instrumentation from the environment:

- `RECREATE_SLOW_WORKER` / `RECREATE_SLOW_SECONDS`: that worker waits
  that long before each re-creation, so the other one re-creates and
  starts building first.
- `RECREATE_BLOCK_WORKER` / `RECREATE_BLOCK_ROUND`: that worker blocks
  forever in Python right after that round's re-creation, so the other
  waits in the broadcast of its first variable.

It reports the final weights and the two evaluation losses.
"""

import os
import sys
import threading
import time

import keras_replicator as kr

# Create the first replicator before TensorFlow starts.
replicator = kr.auto()

import keras  # noqa: E402

from tests.multi_worker import harness  # noqa: E402
from tests.multi_worker import recreate_reference as ref  # noqa: E402

ROUNDS = int(os.environ.get("RECREATE_ROUNDS", "3"))
checkpoint_dir = sys.argv[1]
index = harness.task_index()
slow = index == int(os.environ.get("RECREATE_SLOW_WORKER", "-1"))
slow_seconds = float(os.environ.get("RECREATE_SLOW_SECONDS", "3"))
block = index == int(os.environ.get("RECREATE_BLOCK_WORKER", "-1"))
block_round = int(os.environ.get("RECREATE_BLOCK_ROUND", "-1"))


def make_or_restore_model(round_):
    if round_ % 2 == 0:
        return ref.get_compiled_model()
    # Round 0's checkpoint, complete on every worker: the chief wrote it
    # inside round 0's fit, before the evaluate every worker joined.
    return keras.models.load_model(os.path.join(checkpoint_dir, "ckpt-0.keras"))


def run_training(replicator, round_):
    with replicator.scope():
        model = make_or_restore_model(round_)
    checkpoint = keras.callbacks.ModelCheckpoint(
        os.path.join(checkpoint_dir, f"ckpt-{round_}.keras")
    )
    x, y = ref.data()
    model.fit(
        x,
        y,
        batch_size=ref.GLOBAL_BATCH,
        shuffle=False,
        callbacks=[checkpoint],
        verbose=0,
    )
    return model


model = run_training(replicator, 0)
losses = [ref.evaluate(model)]
for round_ in range(1, ROUNDS + 1):
    if slow:
        time.sleep(slow_seconds)
    replicator = kr.auto()
    if block and round_ == block_round:
        print(f"blocking in round {round_}", flush=True)
        threading.Event().wait()
    model = run_training(replicator, round_)
    print(f"round {round_} done", flush=True)
losses.append(ref.evaluate(model))
harness.write_result(
    {"weights": [w.tolist() for w in model.get_weights()], "losses": losses}
)
