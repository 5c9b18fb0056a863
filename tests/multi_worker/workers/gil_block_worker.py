"""Worker of the backstop tests: a fit whose callback holds the GIL.

argv: <backup dir> <replicator: "local" or "multi">. A plain
`BackupAndRestore` fit (the preemption tests' model and data). At step
`GIL_BLOCK_STEP` (default 10) of its first attempt (no `GIL_BLOCK_ONCE`
file yet), the worker of index `GIL_BLOCK_WORKER` (default 0) writes that
file (the time it blocks) and calls the C library's `sleep` through
`ctypes.PyDLL`, which keeps the GIL for the whole call: no Python thread,
the hang watchdog's included, runs until it returns.

It reports its final weights, the (epoch, batch) of every step it trained
and the time the process started.
"""

import sys
import time

STARTED = time.time()

import os  # noqa: E402

import keras_replicator as kr  # noqa: E402

if sys.argv[2] == "local":
    replicator = kr.LocalReplicator(2)
else:
    replicator = kr.MultiWorkerReplicator()

import ctypes  # noqa: E402

import keras  # noqa: E402

from tests.multi_worker import harness  # noqa: E402
from tests.multi_worker import preempt_reference as ref  # noqa: E402

once = os.environ["GIL_BLOCK_ONCE"]
block_step = int(os.environ.get("GIL_BLOCK_STEP", "10"))
block_worker = int(os.environ.get("GIL_BLOCK_WORKER", "0"))
index = harness.task_index()


def _at_step(step):
    if step != block_step or index != block_worker or os.path.exists(once):
        return
    with open(once, "w") as f:
        f.write(repr(time.time()))
    # PyDLL: the call keeps the GIL (CDLL would release it).
    ctypes.PyDLL(None).sleep(3600)


model = ref.build(replicator)
probe = ref.Probe(_at_step)
model.fit(
    **ref.fit_inputs("arrays", replicator),
    epochs=ref.EPOCHS,
    callbacks=[keras.callbacks.BackupAndRestore(sys.argv[1]), probe],
    verbose=0,
)
harness.write_result(
    {
        "weights": [w.tolist() for w in model.get_weights()],
        "trained": probe.trained,
        "started": STARTED,
    }
)
