"""A worker dies mid-fit: bounded, named failure; resume from backup.

Also drives the workers through `keras-replicator launch`, as a user would.
"""

import time

import numpy as np
import pytest

from tests.multi_worker import fault_reference
from tests.multi_worker import harness

WORKER = harness.REPO_ROOT / "tests/multi_worker/workers/fault_worker.py"
# The replicator's default bound, asserted with room for a busy machine.
TIMEOUT_SECONDS = 60


def run_launcher(tmp, out_dir, env=None):
    """`keras-replicator launch --workers 2 -- python fault_worker.py`."""
    start = time.monotonic()
    proc, results = harness.run_launcher(
        WORKER, args=[str(tmp / "init.npz"), str(out_dir)], env=env
    )
    return proc, results, time.monotonic() - start


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    model = fault_reference.build()
    np.savez(tmp / "init.npz", *model.get_weights())
    fault_reference.train(model)
    return tmp, model.get_weights()


@pytest.mark.multi_worker
@pytest.mark.timeout(300)
def test_survivor_names_the_lost_task_within_the_timeout(reference):
    tmp, _ = reference
    out = tmp / "survivor"
    out.mkdir()
    results = harness.run_workers(
        WORKER,
        args=[str(tmp / "init.npz"), str(out)],
        env={"KR_TEST_DIE_AT_EPOCH": "2", "KR_TEST_DIE_TASK": "1"},
        check=False,
        # Let the survivor find out on its own.
        kill_on_failure=False,
        timeout=TIMEOUT_SECONDS + 120,
    )
    survivor, lost = results
    assert lost.returncode == -9, harness.describe(results)
    assert survivor.returncode not in (0, None), harness.describe(results)
    error = survivor.result["error"]
    assert "task:1" in error, error
    died_at = float((out / "died_at").read_text())
    assert survivor.result["failed_at"] - died_at < TIMEOUT_SECONDS


def _survivor_error(tmp, name, env, timeout, kill_on_failure):
    """Runs the fault workers with `env`; the survivor's error and delay."""
    out = tmp / name
    out.mkdir()
    results = harness.run_workers(
        WORKER,
        args=[str(tmp / "init.npz"), str(out)],
        env={"KR_TEST_DIE_AT_EPOCH": "2", "KR_TEST_DIE_TASK": "1", **env},
        check=False,
        kill_on_failure=kill_on_failure,
        timeout=timeout,
    )
    survivor = results[0]
    assert survivor.returncode not in (0, None), harness.describe(results)
    died_at = float((out / "died_at").read_text())
    return survivor.result["error"], survivor.result["failed_at"] - died_at


@pytest.mark.multi_worker
@pytest.mark.timeout(300)
def test_collective_timeout_ends_a_stuck_peer(reference):
    # The peer stays alive (its heartbeats go on) but never joins the next
    # all-reduce: only collective_timeout_seconds ends the wait.
    tmp, _ = reference
    error, delay = _survivor_error(
        tmp,
        "stuck",
        {"KR_TEST_HANG": "1", "KR_TEST_COLLECTIVE_TIMEOUT": "5"},
        timeout=120,
        # The stuck peer never exits: end it once the survivor has.
        kill_on_failure=True,
    )
    assert "DeadlineExceeded" in error and "timed out" in error, error
    # From the peer's stop: the survivor may have entered the all-reduce
    # (and started its 5 s) up to a step before it.
    assert 4 <= delay < 5 + 10, (delay, error)


THREADS_SCRIPT = """
import keras_replicator as kr
replicator = kr.MultiWorkerReplicator()
import keras, numpy as np
from tests.multi_worker import harness

def threads():
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith("Threads:")).split()[1])

with replicator.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
x = np.zeros((3200, 4), "float32")
y = np.zeros((3200, 2), "float32")
model.fit(x[:320], y[:320], batch_size=16, verbose=0)
before = threads()
model.fit(x, y, batch_size=16, verbose=0)  # 200 steps, 400+ collectives
harness.write_result({"before": before, "after": threads()})
"""


@pytest.mark.multi_worker
@pytest.mark.timeout(300)
def test_collectives_do_not_leave_a_thread_each():
    # A per-collective timeout makes TensorFlow start a thread per
    # collective that sleeps out the timeout: 400+ threads here with
    # collective_timeout_seconds=60. By default none is set.
    results = harness.run_workers(THREADS_SCRIPT, replicas_per_worker=1)
    for got in results:
        assert got.result["after"] - got.result["before"] < 50, got.result


@pytest.mark.multi_worker
@pytest.mark.timeout(600)
def test_launcher_fails_fast_and_restart_resumes_from_backup(reference):
    tmp, expected = reference
    out = tmp / "resume"
    out.mkdir()
    proc, _, _ = run_launcher(
        tmp, out, env={"KR_TEST_DIE_AT_EPOCH": "2", "KR_TEST_DIE_TASK": "1"}
    )
    ended_at = time.time()
    assert proc.returncode != 0, proc.stdout[-4000:]
    assert "[launch] worker 1 exited with code 137" in proc.stdout
    assert ended_at - float((out / "died_at").read_text()) < TIMEOUT_SECONDS
    assert (out / "backup" / "latest.weights.h5").exists()

    (out / "died_at").unlink()
    proc, results, _ = run_launcher(tmp, out)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "[worker 0]" in proc.stdout and "[worker 1]" in proc.stdout
    for got in results:
        for i, (a, e) in enumerate(zip(got["weights"], expected, strict=True)):
            np.testing.assert_allclose(
                np.asarray(a), e, atol=1e-5, rtol=0, err_msg=f"weight {i}"
            )
