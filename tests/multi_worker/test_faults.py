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
