"""The hang watchdog with real worker processes, as a user runs them.

Workers run `workers/preempt_worker.py`, a plain `BackupAndRestore` fit,
under `keras-replicator launch --workers 2 --max-restarts 1`:

- worker 1 blocks in Python at step 10 (a callback that never returns;
  its heartbeats go on) with `KERAS_REPLICATOR_HANG_SECONDS=10`: the stall
  warning names it as behind, it prints its stack with its task id and
  exits 76, the launcher restarts the group, which resumes from the
  backup and ends with one device's weights;
- the same run with the watchdog off still hangs 20 s after the block
  (so the first test can fail), and the launcher, killed then, leaves no
  worker;
- no false alarm: worker 0 takes 9 s to trace its first step and its
  first validation step, 9 s more to write its first backup and 9 s more
  to write a `save_weights` of the user's own, each time with worker 1
  waiting for it, under a 6 s timeout;
- in a real Jupyter kernel, a `LocalReplicator` fit stuck in a callback
  ends with a `RuntimeError` and the kernel trains again after it.

A callback that holds the GIL (`workers/gil_block_worker.py`: the C
library's `sleep` through `ctypes.PyDLL`) stops every Python thread, the
watchdog's too, with `KERAS_REPLICATOR_HANG_SECONDS=10`:

- one process (`LocalReplicator(2)` under `launch --workers 1
  --max-restarts 1`): the backstop prints the stuck thread's stack and
  exits 76 within 3 timeouts; the restarted run resumes from its backup
  and ends with one device's weights;
- on 2 workers, blocked in worker 1: worker 0's watchdog ends the group,
  which restarts and ends with one device's weights.
"""

import os
import time

import pytest

from keras_replicator._src.core import env as env_names
from tests.multi_worker import harness
from tests.multi_worker import preempt_reference as ref

pytestmark = pytest.mark.multi_worker

WORKER = harness.REPO_ROOT / "tests/multi_worker/workers/preempt_worker.py"
GIL_WORKER = (
    harness.REPO_ROOT / "tests/multi_worker/workers" / "gil_block_worker.py"
)
HANG_SECONDS = "10"
GIL_HANG_SECONDS = 10
# No false alarm: each untimed part (a trace, a save) sleeps 1.5 times the
# timeout; the timed steps of this tiny model take milliseconds.
UNTIMED_HANG_SECONDS = 6
UNTIMED_SLEEP = 9
BLOCKED_STEP = 10


@pytest.fixture(scope="module")
def one_device():
    return ref.reference_weights()


def _blocked_once(tmp_path, hang_seconds):
    return {
        env_names.HANG_SECONDS: hang_seconds,
        "PREEMPT_MARK_STEP": str(BLOCKED_STEP),
        "PREEMPT_HANG_ONCE": str(tmp_path / "blocked"),
        # Each worker writes its pid at the step; no slow steps after it.
        "PREEMPT_MARK": str(tmp_path / "pid{index}"),
        "PREEMPT_SLOW": "0",
    }


@pytest.mark.timeout(300)
def test_a_blocked_worker_is_ended_and_the_restarted_group_resumes(
    one_device, tmp_path
):
    proc, results = harness.run_launcher(
        WORKER,
        [str(tmp_path / "backup")],
        num_workers=2,
        replicas_per_worker=1,
        env=_blocked_once(tmp_path, HANG_SECONDS),
        # Well within 4 minutes, with two start-ups on 2 shared cores.
        timeout=240,
        max_restarts=1,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-8000:]
    assert (tmp_path / "blocked").exists()
    # The stall warning, from the coordination service's view of both.
    assert (
        f"Workers that have not finished step {BLOCKED_STEP}: worker:1" in out
    ), out[-8000:]
    # The blocked worker's header and its stack, where it waits.
    assert (
        f"[worker 1] [keras-replicator watchdog] task worker:1 step "
        f"{BLOCKED_STEP}: no progress for" in out
    ), out[-8000:]
    assert "in _block_forever" in out
    assert "exiting with code 76" in out
    assert "was ended by the hang watchdog (exit code 76" in out
    assert "starting all workers again on new ports (restart 1 of 1)" in out
    for result in results:
        # The restarted group resumed at the epoch-end backup of epoch 1.
        assert result["trained"][0] == [1, 0]
        ref.assert_weights(result, one_device)


def _gil_blocked_once(tmp_path, worker):
    return {
        env_names.HANG_SECONDS: str(GIL_HANG_SECONDS),
        "GIL_BLOCK_ONCE": str(tmp_path / "blocked"),
        "GIL_BLOCK_STEP": str(BLOCKED_STEP),
        "GIL_BLOCK_WORKER": str(worker),
    }


@pytest.mark.timeout(300)
def test_one_process_stuck_holding_the_gil_is_ended_and_restarted(
    one_device, tmp_path
):
    proc, results = harness.run_launcher(
        GIL_WORKER,
        [str(tmp_path / "backup"), "local"],
        num_workers=1,
        replicas_per_worker=2,
        env=_gil_blocked_once(tmp_path, 0),
        timeout=240,
        max_restarts=1,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-8000:]
    blocked_at = float((tmp_path / "blocked").read_text())
    # The watchdog's thread never ran; the backstop's C threads did: the
    # stacks (the stuck thread in the callback), then exit code 76.
    assert "keras-replicator watchdog" not in out, out[-8000:]
    assert "[worker 0] Timeout (0:00:" in out, out[-8000:]
    assert "in _at_step" in out
    assert "was ended by the hang watchdog (exit code 76" in out
    assert "starting all workers again on new ports (restart 1 of 1)" in out
    # Ended (and started again) within 3 timeouts of the block: the
    # backstop prints 20 s after the last step here, exits 3 s later.
    ended_within = results[0]["started"] - blocked_at
    assert ended_within < 3 * GIL_HANG_SECONDS, ended_within
    # Resumed at the epoch-end backup of epoch 1; one device's weights.
    assert results[0]["trained"][0] == [1, 0]
    ref.assert_weights(results[0], one_device)


@pytest.mark.timeout(300)
def test_a_worker_stuck_holding_the_gil_ends_in_a_restart(one_device, tmp_path):
    proc, results = harness.run_launcher(
        GIL_WORKER,
        [str(tmp_path / "backup"), "multi"],
        num_workers=2,
        replicas_per_worker=1,
        env=_gil_blocked_once(tmp_path, 1),
        timeout=240,
        max_restarts=1,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-8000:]
    assert (tmp_path / "blocked").exists()
    # Worker 0, waiting for it in a collective, speaks first.
    assert "[worker 0] [keras-replicator watchdog] task worker:0" in out
    assert "was ended by the hang watchdog (exit code 76" in out
    assert "starting all workers again on new ports (restart 1 of 1)" in out
    for result in results:
        assert result["trained"][0] == [1, 0]
        ref.assert_weights(result, one_device)


@pytest.mark.timeout(300)
def test_with_the_watchdog_off_the_same_run_hangs(tmp_path):
    run = harness.Background(
        harness.launch_command(
            WORKER, [str(tmp_path / "backup")], 2, 1, max_restarts=1
        ),
        tmp_path,
        "off",
        {
            **os.environ,
            "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
            "PYTHONPATH": str(harness.REPO_ROOT),
            **_blocked_once(tmp_path, "0"),
        },
    )
    try:
        # Worker 1 blocks at the step after its pid mark.
        harness.wait_for_pid_file(tmp_path / "pid1", run, timeout=200)
        deadline = time.monotonic() + 60
        while not (tmp_path / "blocked").exists():
            assert run.proc.poll() is None, run.output()[-8000:]
            assert time.monotonic() < deadline, run.output()[-8000:]
            time.sleep(0.1)
        # The watchdog above ends the same run about 10 s after the block;
        # this one still runs twice as long after it.
        time.sleep(2 * float(HANG_SECONDS))
        out = run.output()
        assert run.proc.poll() is None, out[-8000:]
        assert "keras-replicator watchdog" not in out
    finally:
        run.kill()
    # Killing the launcher (SIGKILL to its group) ended its workers too.
    pids = [int((tmp_path / f"pid{i}").read_text()) for i in (0, 1)]
    assert harness.wait_until_gone(pids) == []


@pytest.mark.timeout(400)
def test_no_false_alarm_for_slow_tracing_validation_and_saves(
    one_device, tmp_path
):
    results = harness.run_workers(
        WORKER,
        num_workers=2,
        replicas_per_worker=1,
        args=[str(tmp_path / "backup")],
        env={
            env_names.HANG_SECONDS: str(UNTIMED_HANG_SECONDS),
            # Worker 0 only, so worker 1 waits for it in a collective.
            "PREEMPT_SLOW_TRACE": str(UNTIMED_SLEEP),
            "PREEMPT_SLOW_SAVE": str(UNTIMED_SLEEP),
            # The chief's write of the user's own save, which worker 1
            # waits for in `save_weights`.
            "PREEMPT_SLOW_OWN_SAVE": str(UNTIMED_SLEEP),
            "PREEMPT_VALIDATE": "1",
            "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
        },
        timeout=300,
    )
    # Both traces (fit's first step, validation's) and the save were slow.
    assert results[0].output.count(f"slow trace: {UNTIMED_SLEEP} s") == 2
    assert results[0].output.count(f"slow save: {UNTIMED_SLEEP} s") == 1
    assert results[0].output.count(f"slow own save: {UNTIMED_SLEEP} s") == 1
    for result in results:
        assert "keras-replicator watchdog" not in result.output, result.output
        ref.assert_weights(result.result, one_device)


STUCK_CELL = """
import threading
import keras
import numpy as np
import keras_replicator as kr

replicator = kr.LocalReplicator(2, hang_seconds=5)
with replicator.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
x = np.ones((64, 4), "float32")

class Stuck(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 3:
            threading.Event().wait()

model.fit(x, x[:, :1], batch_size=8, callbacks=[Stuck()], verbose=0)
"""


@pytest.mark.timeout(240)
def test_in_a_notebook_kernel_the_stuck_fit_raises_and_the_kernel_lives(
    tmp_path,
):
    unset = ("TF_CONFIG", env_names.HANG_SECONDS)
    with harness.jupyter_kernel(tmp_path, unset) as (_, client):
        reply, output = harness.execute_cell(client, STUCK_CELL, timeout=150)
        assert reply["status"] == "error", output
        assert reply["ename"] == "RuntimeError", output
        assert "hang watchdog stopped this fit" in reply["evalue"]
        assert "step 4: no progress for" in output, output
        assert "interrupting the fit loop" in output, output
        reply, output = harness.execute_cell(
            client,
            "model.fit(x, x[:, :1], batch_size=8, verbose=0)\n"
            "print('trained again')",
            timeout=60,
        )
        assert reply["status"] == "ok", output
        assert "trained again" in output
