"""Worker of the preemption tests: a plain `BackupAndRestore` fit.

argv: <backup dir>. The script is what a user writes (a replicator, a
model, `fit(..., callbacks=[keras.callbacks.BackupAndRestore(dir)])`); the
environment adds test instrumentation:

- `PREEMPT_REPLICATOR`: "multi" (`MultiWorkerReplicator()`, the default),
  "local" (`LocalReplicator(2)`) or "auto" (`kr.auto()`).
- `PREEMPT_DATA`: one of `preempt_reference.DATA_KINDS` (default arrays).
- `PREEMPT_SAVE_FREQ`: `BackupAndRestore(save_freq=...)` as an int.
- `PREEMPT_MARK` / `PREEMPT_MARK_STEP`: after that step of the whole
  training, the worker writes its pid to `PREEMPT_MARK` ("{index}" is its
  task index) and from then on sleeps `PREEMPT_SLOW` seconds per step, so a
  test can signal it mid-epoch.
- `PREEMPT_KILL_ONCE`: a path; worker 1 kills itself with SIGKILL at the
  mark step if the path does not exist yet (and creates it).
- `PREEMPT_DIE_ON_SAVE`: N; worker 0's N-th weights save writes its file,
  then the process kills itself with SIGKILL (killed mid-backup).
- `PREEMPT_HANG_ONCE`: a path; worker 1 blocks forever in Python (a
  callback that never returns) at the mark step if the path does not
  exist yet (and creates it).
- `PREEMPT_HANG_PEER_FIRST`: "1": with `PREEMPT_HANG_ONCE`, worker 1's own
  hang watchdog waits three times `KERAS_REPLICATOR_HANG_SECONDS`, so that
  the watchdog that ends the job is worker 0's, blocked in its next
  collective (else the two race: both stop within a step of each other).
- `PREEMPT_SLOW_TRACE`: seconds; worker 0 sleeps that long while its train
  step, and its test step, are traced (the first step of fit and of
  validation).
- `PREEMPT_SLOW_SAVE`: seconds; worker 0's first backup save takes that
  much longer (after writing its file).
- `PREEMPT_SLOW_OWN_SAVE`: seconds; at the first epoch's end a callback
  saves the weights itself on every process (`model.save_weights`), and
  worker 0 (the chief, which writes the file) takes that much longer.
- `PREEMPT_VALIDATE`: "1" adds validation data to the fit.
- `PREEMPT_TERM_AT_END`: "1": worker 1 sends itself SIGTERM at the end of
  the last epoch, after the last step's check.

At the end it reports its final weights and the (epoch, batch) of every
step it trained (only the steps, when preempted).
"""

import os
import signal
import sys
import threading
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

from keras_replicator._src.core import env as env_names  # noqa: E402
from tests.multi_worker import harness  # noqa: E402
from tests.multi_worker import preempt_reference as ref  # noqa: E402

backup_dir = sys.argv[1]
mark = os.environ.get("PREEMPT_MARK")
mark_step = int(os.environ.get("PREEMPT_MARK_STEP", "0"))
slow = float(os.environ.get("PREEMPT_SLOW", "0.3"))
kill_once = os.environ.get("PREEMPT_KILL_ONCE")
die_on_save = int(os.environ.get("PREEMPT_DIE_ON_SAVE", "0"))
hang_once = os.environ.get("PREEMPT_HANG_ONCE")
slow_trace = float(os.environ.get("PREEMPT_SLOW_TRACE", "0"))
slow_save = float(os.environ.get("PREEMPT_SLOW_SAVE", "0"))
index = harness.task_index()
if hang_once and index == 1 and os.environ.get("PREEMPT_HANG_PEER_FIRST"):
    os.environ[env_names.HANG_SECONDS] = str(
        3 * float(os.environ[env_names.HANG_SECONDS])
    )

model = ref.build(replicator)
inputs = ref.fit_inputs(os.environ.get("PREEMPT_DATA", "arrays"), replicator)

saves = []
_save_weights = model.save_weights


def _save_then_maybe_die(*args, **kwargs):
    _save_weights(*args, **kwargs)
    saves.append(1)
    if index == 0 and len(saves) == die_on_save:
        os.kill(os.getpid(), signal.SIGKILL)
    if index == 0 and len(saves) == 1 and slow_save:
        print(f"slow save: {slow_save:g} s", flush=True)
        time.sleep(slow_save)


model.save_weights = _save_then_maybe_die


def _slow_when_traced(step):
    """`step`, sleeping `slow_trace` s the first time (it is traced)."""
    traced = []

    def step_fn(data):
        if index == 0 and not traced:
            traced.append(1)
            print(f"slow trace: {slow_trace:g} s", flush=True)
            time.sleep(slow_trace)
        return step(data)

    return step_fn


if slow_trace:
    model.train_step = _slow_when_traced(model.train_step)
    model.test_step = _slow_when_traced(model.test_step)


def _block_forever():
    """A callback that never returns; its heartbeats go on."""
    threading.Event().wait()


def _at_step(step):
    if step == mark_step and kill_once and index == 1:
        if not os.path.exists(kill_once):
            open(kill_once, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
    if mark and step == mark_step:
        with open(mark.format(index=index), "w") as f:
            f.write(str(os.getpid()))
    if mark and step >= mark_step:
        time.sleep(slow)
    if step == mark_step and hang_once and index == 1:
        if not os.path.exists(hang_once):
            open(hang_once, "w").close()
            _block_forever()


save_freq = os.environ.get("PREEMPT_SAVE_FREQ")
backup = keras.callbacks.BackupAndRestore(
    backup_dir, save_freq=int(save_freq) if save_freq else "epoch"
)
probe = ref.Probe(_at_step)
callbacks = [backup, probe]


class _TermAtEnd(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == ref.EPOCHS - 1 and index == 1:
            os.kill(os.getpid(), signal.SIGTERM)


class _OwnSave(keras.callbacks.Callback):
    """The user's own save at an epoch's end, the chief's write slow."""

    def on_epoch_end(self, epoch, logs=None):
        if epoch != 0:
            return
        from keras.src.saving import saving_lib

        save_state = saving_lib._save_state

        def slow_save_state(*args, **kwargs):
            # Once: `_save_state` calls itself for each layer.
            saving_lib._save_state = save_state
            print(f"slow own save: {slow_own_save:g} s", flush=True)
            time.sleep(slow_own_save)
            return save_state(*args, **kwargs)

        if index == 0:
            saving_lib._save_state = slow_save_state
        try:
            self.model.save_weights(backup_dir + ".own.weights.h5")
        finally:
            saving_lib._save_state = save_state


if os.environ.get("PREEMPT_TERM_AT_END") == "1":
    callbacks.append(_TermAtEnd())
slow_own_save = float(os.environ.get("PREEMPT_SLOW_OWN_SAVE", "0"))
if slow_own_save:
    callbacks.append(_OwnSave())
if os.environ.get("PREEMPT_VALIDATE") == "1":
    inputs["validation_data"] = (inputs["x"][:16], inputs["y"][:16])
try:
    model.fit(**inputs, epochs=ref.EPOCHS, callbacks=callbacks, verbose=0)
except SystemExit:
    # Preempted: what it trained before it stopped.
    harness.write_result({"trained": probe.trained, "preempted": True})
    raise
harness.write_result(
    {
        "weights": [w.tolist() for w in model.get_weights()],
        "trained": probe.trained,
    }
)
