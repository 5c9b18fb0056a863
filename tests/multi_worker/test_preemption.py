"""Preemption and restarts with real processes, as a platform does them.

`keras-replicator launch` restarts a group whose worker was SIGKILLed; a
SIGTERM to one worker or to the launcher stops every worker at the same
step with a backup there and exit code 75; the same command resumes. One
`LocalReplicator(2)` process killed while writing its backup leaves the
previous one, resumes from it, stops at the step on SIGTERM and resumes
again; a simulated Slurm job gets SIGUSR1 and is requeued. Every run must
end with the weights of an uninterrupted run (computed here in-process on
as many replicas). Workers run `workers/preempt_worker.py`, a plain
`BackupAndRestore` fit; each subprocess has a bounded timeout.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import keras_replicator as kr
from keras_replicator._src.core import env as env_names
from tests.multi_worker import harness
from tests.multi_worker import preempt_reference as ref

WORKER = harness.REPO_ROOT / "tests/multi_worker/workers/preempt_worker.py"
PREEMPTED = 75
# Checks about every 50 ms of steps, so a signal lands within a few steps
# even though the instrumented steps slow down after the mark.
BASE_ENV = {
    env_names.PREEMPTION_CHECK_SECONDS: "0.05",
    "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
    "PYTHONPATH": str(harness.REPO_ROOT),
}
# `replicator.distribute` data has no known cardinality: Keras warns at the
# end of the first epoch.
pytestmark = pytest.mark.filterwarnings("ignore:Your input ran out of data")


def _reference(replicas):
    model = ref.build(kr.LocalReplicator(replicas))
    model.fit(**ref.fit_inputs("arrays", None), epochs=ref.EPOCHS, verbose=0)
    return model.get_weights()


@pytest.fixture(scope="module")
def references():
    # 2 workers x 2 replicas, and one process of 2 replicas.
    return {4: _reference(4), 2: _reference(2)}


def _launcher(backup, max_restarts=0):
    script = Path(sys.executable).parent / "keras-replicator"
    command = (
        [str(script)]
        if script.exists()
        else [sys.executable, "-m", "keras_replicator._src.cluster.cli"]
    )
    return [
        *command,
        "launch",
        "--workers",
        "2",
        "--replicas-per-worker",
        "2",
        "--max-restarts",
        str(max_restarts),
        "--",
        sys.executable,
        str(WORKER),
        str(backup),
    ]


class _Run:
    """One start of a command, its output in a file, its results."""

    def __init__(self, command, tmp, name, env):
        self.tmp, self.name = tmp, name
        self.log = tmp / f"{name}.log"
        full_env = {
            **os.environ,
            **BASE_ENV,
            harness.RESULT_ENV: str(tmp / f"{name}_{{index}}.json"),
            **env,
        }
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                command,
                env=full_env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=harness.REPO_ROOT,
                start_new_session=True,
            )

    def wait(self, timeout):
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.kill()

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def output(self):
        return self.log.read_text(errors="replace")

    def result(self, index=0):
        path = self.tmp / f"{self.name}_{index}.json"
        return json.loads(path.read_text()) if path.exists() else None


def _wait_for(path, run, timeout=180):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert run.proc.poll() is None, run.output()[-4000:]
        assert time.monotonic() < deadline, run.output()[-4000:]
        time.sleep(0.1)
    time.sleep(0.1)  # the pid is written
    return int(path.read_text())


def _backup_step(backup):
    """The step of the whole training a backup was written at (1-based)."""
    metadata = json.loads((backup / "training_metadata.json").read_text())
    ours = metadata["keras_replicator"]
    return ours["epoch"] * ref.STEPS_PER_EPOCH + ours["steps_done"]


def _assert_gone(pids):
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _assert_weights(result, expected):
    assert result is not None and "weights" in result, result
    for i, (a, e) in enumerate(zip(result["weights"], expected, strict=True)):
        np.testing.assert_allclose(
            np.array(a), e, atol=1e-5, rtol=0, err_msg=f"weight {i}"
        )


def _step_of(epoch_batch):
    epoch, batch = epoch_batch
    return epoch * ref.STEPS_PER_EPOCH + batch


@pytest.mark.multi_worker
@pytest.mark.timeout(400)
def test_max_restarts_restarts_the_group_after_a_sigkill(references, tmp_path):
    run = _Run(
        _launcher(tmp_path / "backup", max_restarts=2),
        tmp_path,
        "restart",
        {"PREEMPT_MARK_STEP": "10", "PREEMPT_KILL_ONCE": str(tmp_path / "k")},
    )
    assert run.wait(timeout=300) == 0, run.output()[-4000:]
    out = run.output()
    assert "worker 1 exited with code 137" in out
    assert "starting all workers again on new ports (restart 1 of 2)" in out
    for index in (0, 1):
        result = run.result(index)
        # The restarted group resumed at the epoch-end backup of epoch 1.
        assert result["trained"][0] == [1, 0]
        _assert_weights(result, references[4])


@pytest.mark.multi_worker
@pytest.mark.timeout(500)
def test_sigterm_to_a_worker_then_to_the_launcher_resumes_exactly(
    references, tmp_path
):
    backup = tmp_path / "backup"
    # 1. SIGTERM to worker 1 only, in the second epoch.
    first = _Run(
        _launcher(backup),
        tmp_path,
        "first",
        {"PREEMPT_MARK": str(tmp_path / "a{index}"), "PREEMPT_MARK_STEP": "10"},
    )
    pid1 = _wait_for(tmp_path / "a1", first)
    pid0 = _wait_for(tmp_path / "a0", first)
    os.kill(pid1, signal.SIGTERM)
    assert first.wait(timeout=60) == PREEMPTED, first.output()[-4000:]
    _assert_gone([pid0, pid1])
    assert "worker 1 was preempted" in first.output() or (
        "worker 0 was preempted" in first.output()
    )
    saved = _backup_step(backup)
    assert 10 <= saved <= 14 and saved % ref.STEPS_PER_EPOCH, saved

    # 2. The same command resumes there; SIGTERM to the launcher.
    second = _Run(
        _launcher(backup),
        tmp_path,
        "second",
        {"PREEMPT_MARK": str(tmp_path / "b{index}"), "PREEMPT_MARK_STEP": "18"},
    )
    pids = [_wait_for(tmp_path / f"b{i}", second) for i in (0, 1)]
    second.proc.send_signal(signal.SIGTERM)
    assert second.wait(timeout=60) == PREEMPTED, second.output()[-4000:]
    _assert_gone(pids)
    assert "received SIGTERM; forwarding it to every worker" in second.output()
    for index in (0, 1):
        trained = second.result(index)["trained"]
        assert _step_of(trained[0]) == saved, trained
    resaved = _backup_step(backup)
    assert 18 <= resaved <= 22 and resaved % ref.STEPS_PER_EPOCH, resaved
    assert _step_of(trained[-1]) + 1 in (resaved, resaved + 1)

    # 3. The same command trains only the rest, to the uninterrupted weights.
    third = _Run(_launcher(backup), tmp_path, "third", {})
    assert third.wait(timeout=240) == 0, third.output()[-4000:]
    for index in (0, 1):
        result = third.result(index)
        assert _step_of(result["trained"][0]) == resaved
        assert len(result["trained"]) == ref.TOTAL_STEPS - resaved
        _assert_weights(result, references[4])


@pytest.mark.multi_worker
@pytest.mark.timeout(400)
def test_killed_while_writing_a_backup_resumes_from_the_previous_one(
    references, tmp_path
):
    backup = tmp_path / "backup"
    command = [sys.executable, str(WORKER), str(backup)]
    local = {"PREEMPT_REPLICATOR": "local", "PREEMPT_SAVE_FREQ": "3"}
    # 1. Killed while writing its third backup (step 9): step 6 stays.
    first = _Run(
        command, tmp_path, "first", {**local, "PREEMPT_DIE_ON_SAVE": "3"}
    )
    assert first.wait(timeout=180) == -signal.SIGKILL, first.output()[-4000:]
    assert _backup_step(backup) == 6
    assert (tmp_path / "backup.partial").is_dir()  # the unfinished write

    # 2. Resumes from step 6; SIGTERM to the one process at step 13.
    second = _Run(
        command,
        tmp_path,
        "second",
        {
            **local,
            "PREEMPT_MARK": str(tmp_path / "m"),
            "PREEMPT_MARK_STEP": "13",
        },
    )
    os.kill(_wait_for(tmp_path / "m", second), signal.SIGTERM)
    assert second.wait(timeout=60) == PREEMPTED, second.output()[-4000:]
    trained = second.result()["trained"]
    assert _step_of(trained[0]) == 6
    assert _backup_step(backup) in (13, 14)

    # 3. The rest, to the weights of an uninterrupted run.
    third = _Run(command, tmp_path, "third", local)
    assert third.wait(timeout=180) == 0, third.output()[-4000:]
    result = third.result()
    assert _step_of(result["trained"][0]) == _step_of(trained[-1]) + 1
    _assert_weights(result, references[2])


@pytest.mark.multi_worker
@pytest.mark.timeout(400)
def test_simulated_slurm_job_gets_sigusr1_and_is_requeued(references, tmp_path):
    backup = tmp_path / "backup"
    command = [sys.executable, str(WORKER), str(backup)]
    # What srun sets for one task of job 4242 (kr.auto() reads it).
    slurm = {
        "PREEMPT_REPLICATOR": "auto",
        "SLURM_JOB_ID": "4242",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_STEP_TASKS_PER_NODE": "1",
        env_names.PORT: str(harness.free_ports(1)[0]),
        env_names.CPU_REPLICAS: "2",
    }
    # `#SBATCH --signal=USR1@90`: the signal comes ahead of the end.
    first = _Run(
        command,
        tmp_path,
        "first",
        {
            **slurm,
            "PREEMPT_MARK": str(tmp_path / "m"),
            "PREEMPT_MARK_STEP": "5",
        },
    )
    os.kill(_wait_for(tmp_path / "m", first), signal.SIGUSR1)
    assert first.wait(timeout=60) == PREEMPTED, first.output()[-4000:]
    assert "preempted (SIGUSR1)" in first.output()
    saved = _backup_step(backup)
    assert saved in (5, 6)

    # `scontrol requeue`: the same job again, SLURM_RESTART_COUNT set.
    requeued = _Run(
        command, tmp_path, "requeued", {**slurm, "SLURM_RESTART_COUNT": "1"}
    )
    assert requeued.wait(timeout=180) == 0, requeued.output()[-4000:]
    result = requeued.result()
    assert _step_of(result["trained"][0]) == saved
    _assert_weights(result, references[2])
