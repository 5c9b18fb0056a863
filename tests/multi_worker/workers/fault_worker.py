"""Worker of test_faults.py: fit with BackupAndRestore; may die mid-fit.

argv: <initial weights .npz> <output dir>. With KR_TEST_DIE_AT_EPOCH=E, task
KR_TEST_DIE_TASK (default 1) kills itself with SIGKILL when epoch E begins,
or with KR_TEST_HANG=1 stays alive but stuck (sleeps). KR_TEST_TIMEOUT and
KR_TEST_COLLECTIVE_TIMEOUT set the replicator's two timeouts.
"""

import os
import signal
import sys
import time

import keras_replicator as kr

collective_timeout = os.environ.get("KR_TEST_COLLECTIVE_TIMEOUT")
replicator = kr.MultiWorkerReplicator(
    timeout_seconds=float(os.environ.get("KR_TEST_TIMEOUT", "60")),
    collective_timeout_seconds=collective_timeout and float(collective_timeout),
)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tests.multi_worker import fault_reference  # noqa: E402
from tests.multi_worker import harness  # noqa: E402

init_path, out_dir = sys.argv[1], sys.argv[2]
die_at = int(os.environ.get("KR_TEST_DIE_AT_EPOCH", "-1"))
die_task = int(os.environ.get("KR_TEST_DIE_TASK", "1"))


def maybe_die(epoch, logs=None):
    if epoch == die_at and harness.task_index() == die_task:
        print(f"task {die_task} dies at epoch {epoch}", flush=True)
        with open(os.path.join(out_dir, "died_at"), "w") as f:
            f.write(str(time.time()))
        if os.environ.get("KR_TEST_HANG"):
            time.sleep(3600)  # alive (heartbeats go on) but never steps
        os.kill(os.getpid(), signal.SIGKILL)


with replicator.scope():
    model = fault_reference.build()
model.set_weights(list(np.load(init_path).values()))
try:
    fault_reference.train(
        model,
        callbacks=[
            keras.callbacks.BackupAndRestore(os.path.join(out_dir, "backup")),
            keras.callbacks.LambdaCallback(on_epoch_begin=maybe_die),
        ],
    )
except Exception as e:  # noqa: BLE001
    harness.write_result(
        {"error": f"{type(e).__name__}: {e}", "failed_at": time.time()}
    )
    raise
harness.write_result({"weights": model.get_weights()})
