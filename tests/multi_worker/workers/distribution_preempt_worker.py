"""Worker of test_distribution_resume.py: ModelParallel fit, backed up.

argv: <backup dir>. `keras.distribution.initialize()`, `ModelParallel` on
a (batch 2 across processes) x (model 2 inside a process) mesh (another
with `PREEMPT_MESH`, such as `1,4` over 4 processes of one device), then the
plain `BackupAndRestore` fit of `preempt_reference`'s data
(`distribution_reference.preempt_dataset`). With `PREEMPT_MARK` and
`PREEMPT_MARK_STEP` it writes its pid to the mark after that step and
then sleeps `PREEMPT_SLOW` seconds per step, so the test can send SIGTERM
mid-epoch. With `PREEMPT_REFIT`, a second fit with the same backup folder
follows, while the chief deletes the first one's backup slowly, for longer
than a collective timeout made short (and each backup's writer starts 1 s
late, so each fit usually ends with one in flight).
Reports its final weights and the (epoch, batch) of every step it trained
(and trained again).
"""

import os
import sys
import time

import keras

import keras_replicator  # noqa: F401
from tests.multi_worker import distribution_reference as reference
from tests.multi_worker import harness
from tests.multi_worker import preempt_reference as ref

keras.distribution.initialize()
mesh = tuple(int(n) for n in os.environ.get("PREEMPT_MESH", "2,2").split(","))
keras.distribution.set_distribution(reference.preempt_distribution(mesh))
mark = os.environ.get("PREEMPT_MARK")
mark_step = int(os.environ.get("PREEMPT_MARK_STEP", "0"))
slow = float(os.environ.get("PREEMPT_SLOW", "0.3"))


def _at_step(step):
    if mark and step == mark_step:
        with open(mark.format(index=harness.task_index()), "w") as f:
            f.write(str(os.getpid()))
    if mark and step >= mark_step:
        time.sleep(slow)


if os.environ.get("PREEMPT_REFIT"):
    from keras_replicator._src.sharding import checkpoint_commit

    # Every writer starts late: each fit usually ends with a backup in
    # flight (the one before the last, which is not made), which every
    # process then abandons together.
    checkpoint_commit.yield_to_training = lambda: time.sleep(1)
if os.environ.get("PREEMPT_REFIT") and harness.task_index() == 0:
    from keras.src.utils import file_utils

    rmtree = file_utils.rmtree

    def slow_rmtree(path):
        # The chief deletes the backup at the fit's end: slowly, so that
        # another process would find it if it did not wait, and for
        # longer than the (short) collective timeout set below.
        time.sleep(6)
        rmtree(path)

    file_utils.rmtree = slow_rmtree

model = reference.build_preempt()
if os.environ.get("PREEMPT_REFIT"):
    import tensorflow as tf

    # The others wait out the chief's deletion, work on files, which is
    # bounded by at least 600 s, not by this bound of collectives.
    tf.distribute.get_strategy()._collective_timeout_seconds = 4
probe = ref.Probe(_at_step)
backup = keras.callbacks.BackupAndRestore(sys.argv[1])
try:
    model.fit(
        reference.preempt_dataset(),
        shuffle=False,
        epochs=ref.EPOCHS,
        callbacks=[backup, probe],
        verbose=0,
    )
except SystemExit:
    harness.write_result({"trained": probe.trained, "preempted": True})
    raise
again = None
if os.environ.get("PREEMPT_REFIT"):
    again = ref.Probe(None)
    model.fit(
        reference.preempt_dataset(),
        shuffle=False,
        epochs=ref.EPOCHS,
        callbacks=[keras.callbacks.BackupAndRestore(sys.argv[1]), again],
        verbose=0,
    )
harness.write_result(
    {
        "weights": [w.tolist() for w in model.get_weights()],
        "trained": probe.trained,
        "trained_again": again and again.trained,
    }
)
