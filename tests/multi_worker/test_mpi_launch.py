"""`keras-replicator launch --transport mpi`: preemption, resume, restarts.

One `mpiexec -n 2` starts the ranks (one replica each, collectives over
mpi4py); a SIGTERM to the launcher reaches every rank through mpiexec's
process group: each stops at the same step with a backup there, the
launcher exits 75, and the same command resumes and ends with the weights
of an uninterrupted run on 2 replicas. With `--max-restarts`, a SIGKILLed
rank fails mpiexec and the group starts again from its backup. Workers run
`workers/preempt_worker.py`; each subprocess has a bounded timeout.
"""

import os
import signal
import sys

import pytest

import keras_replicator as kr
from keras_replicator._src.core import env as env_names
from tests.multi_worker import harness
from tests.multi_worker import preempt_reference as ref

WORKER = harness.REPO_ROOT / "tests/multi_worker/workers/preempt_worker.py"
PREEMPTED = 75
pytestmark = pytest.mark.filterwarnings("ignore:Your input ran out of data")


def _launcher(backup):
    return [
        *harness.command_line(),
        "launch",
        "--workers",
        "2",
        "--transport",
        "mpi",
        "--",
        sys.executable,
        str(WORKER),
        str(backup),
    ]


def _start(tmp, name, env):
    return harness.Background(
        _launcher(tmp / "backup"),
        tmp,
        name,
        harness.mpiexec_env(
            {env_names.PREEMPTION_CHECK_SECONDS: "0.05", **env}
        ),
    )


@pytest.mark.multi_worker
@pytest.mark.timeout(400)
def test_sigterm_to_the_mpi_launcher_saves_every_rank_and_resumes(tmp_path):
    first = _start(
        tmp_path,
        "first",
        {
            "PREEMPT_SLOW": "0.6",
            "PREEMPT_MARK": str(tmp_path / "a{index}"),
            "PREEMPT_MARK_STEP": "10",
        },
    )
    pids = [
        harness.wait_for_pid_file(tmp_path / f"a{i}", first) for i in (0, 1)
    ]
    first.proc.send_signal(signal.SIGTERM)
    assert first.wait(timeout=90) == PREEMPTED, first.output()[-4000:]
    out = first.output()
    assert "keras-replicator transport: mpi, as" in out
    assert "received SIGTERM; forwarding it to every worker" in out
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    saved = ref.backup_step(tmp_path / "backup")
    assert 10 <= saved < ref.TOTAL_STEPS, saved
    ends = {ref.step_of(first.result(i)["trained"][-1]) for i in (0, 1)}
    assert len(ends) == 1, ends  # every rank stopped at one step

    second = _start(tmp_path, "second", {})
    assert second.wait(timeout=240) == 0, second.output()[-4000:]
    reference = ref.build(kr.LocalReplicator(2))
    reference.fit(
        **ref.fit_inputs("arrays", None), epochs=ref.EPOCHS, verbose=0
    )
    for index in (0, 1):
        result = second.result(index)
        assert ref.step_of(result["trained"][0]) == saved
        ref.assert_weights(result, reference.get_weights())


@pytest.mark.multi_worker
@pytest.mark.timeout(400)
def test_mpi_launch_max_restarts_restarts_after_a_sigkill(tmp_path):
    command = _launcher(tmp_path / "backup")
    command.insert(command.index("--"), "--max-restarts=1")
    run = harness.Background(
        command,
        tmp_path,
        "restart",
        harness.mpiexec_env(
            {
                env_names.PREEMPTION_CHECK_SECONDS: "0.05",
                "PREEMPT_MARK_STEP": "10",
                "PREEMPT_KILL_ONCE": str(tmp_path / "k"),
            }
        ),
    )
    assert run.wait(timeout=300) == 0, run.output()[-4000:]
    assert "(restart 1 of 1)" in run.output()
    reference = ref.build(kr.LocalReplicator(2))
    reference.fit(
        **ref.fit_inputs("arrays", None), epochs=ref.EPOCHS, verbose=0
    )
    for index in (0, 1):
        result = run.result(index)
        # The restarted group resumed at the epoch-end backup of epoch 1.
        assert result["trained"][0] == [1, 0]
        ref.assert_weights(result, reference.get_weights())
