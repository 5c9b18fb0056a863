"""Faults under `mpiexec -n 2` with the MPI transport.

A rank SIGKILLed mid-fit ends the whole job (hydra's mpiexec ends the other
rank, which would wait forever in its next MPI call) within a bounded time,
with no process left. Workers run `workers/preempt_worker.py`; each
subprocess has a bounded timeout.
"""

import os
import signal

import pytest

from keras_replicator._src.core import env as env_names
from tests.multi_worker import harness

WORKER = harness.REPO_ROOT / "tests/multi_worker/workers/preempt_worker.py"
pytestmark = pytest.mark.filterwarnings("ignore:Your input ran out of data")


@pytest.mark.multi_worker
@pytest.mark.timeout(300)
def test_a_killed_rank_ends_the_mpi_job_with_no_process_left(tmp_path):
    run = harness.Background(
        [*harness.mpiexec_command(2), str(WORKER), str(tmp_path / "backup")],
        tmp_path,
        "killed",
        harness.mpiexec_env(
            {
                env_names.PREEMPTION_CHECK_SECONDS: "0.05",
                "PREEMPT_SLOW": "0.3",
                "PREEMPT_MARK": str(tmp_path / "a{index}"),
                "PREEMPT_MARK_STEP": "10",
            }
        ),
    )
    pids = [harness.wait_for_pid_file(tmp_path / f"a{i}", run) for i in (0, 1)]
    os.kill(pids[1], signal.SIGKILL)
    code = run.wait(timeout=120)
    assert code != 0, run.output()[-4000:]
    assert "keras-replicator transport: mpi, as" in run.output()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.multi_worker
@pytest.mark.timeout(300)
def test_the_hang_watchdog_ends_an_mpi_job_blocked_in_mpi(tmp_path):
    # Rank 1 blocks forever in Python at step 10; rank 0 waits for it in
    # its next MPI collective, where its watchdog finds it.
    run = harness.Background(
        [*harness.mpiexec_command(2), str(WORKER), str(tmp_path / "backup")],
        tmp_path,
        "hang",
        harness.mpiexec_env(
            {
                env_names.HANG_SECONDS: "8",
                "PREEMPT_MARK_STEP": "10",
                "PREEMPT_HANG_ONCE": str(tmp_path / "blocked"),
            }
        ),
    )
    code = run.wait(timeout=180)
    out = run.output()
    assert code == 76, out[-8000:]
    assert (tmp_path / "blocked").exists()
    assert "exiting with code 76" in out
    assert "mpi_collectives" in out, out[-8000:]
