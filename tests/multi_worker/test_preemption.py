"""Preemption and restarts with real processes, as a platform does them.

`keras-replicator launch` restarts a group whose worker was SIGKILLed; a
SIGTERM to one worker or to the launcher stops every worker at the same
step with a backup there and exit code 75, also when the signal comes after
the last step's check (the backup is then of the end); the same command
resumes. One
`LocalReplicator(2)` process killed while writing its backup leaves the
previous one, resumes from it, stops at the step on SIGTERM and resumes
again; a simulated Slurm job gets SIGUSR1 and is requeued. Every run must
end with the weights of an uninterrupted run (computed here in-process on
as many replicas). Workers run `workers/preempt_worker.py`, a plain
`BackupAndRestore` fit; each subprocess has a bounded timeout.
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
    return harness.launch_command(
        WORKER, [str(backup)], max_restarts=max_restarts
    )


def _start(command, tmp, name, env):
    return harness.Background(
        command, tmp, name, {**os.environ, **BASE_ENV, **env}
    )


def _assert_gone(pids):
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.multi_worker
@pytest.mark.timeout(400)
def test_max_restarts_restarts_the_group_after_a_sigkill(references, tmp_path):
    run = _start(
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
        ref.assert_weights(result, references[4])


@pytest.mark.multi_worker
@pytest.mark.timeout(500)
def test_sigterm_to_a_worker_then_to_the_launcher_resumes_exactly(
    references, tmp_path
):
    backup = tmp_path / "backup"
    # 1. SIGTERM to worker 1 only, in the second epoch. After the mark
    # every step takes at least 0.6 s, so that the stop, which the workers
    # agree on about once a second, lands a few steps after the signal
    # however fast the machine runs the steps.
    slow = {"PREEMPT_SLOW": "0.6"}
    first = _start(
        _launcher(backup),
        tmp_path,
        "first",
        {
            **slow,
            "PREEMPT_MARK": str(tmp_path / "a{index}"),
            "PREEMPT_MARK_STEP": "10",
        },
    )
    pid1 = harness.wait_for_pid_file(tmp_path / "a1", first)
    pid0 = harness.wait_for_pid_file(tmp_path / "a0", first)
    os.kill(pid1, signal.SIGTERM)
    assert first.wait(timeout=60) == PREEMPTED, first.output()[-4000:]
    _assert_gone([pid0, pid1])
    # The launcher names the worker that got the signal, whichever worker
    # exits first.
    assert "[launch] worker 1 received SIGTERM" in first.output(), (
        first.output()[-4000:]
    )
    saved = ref.backup_step(backup)
    # After the signal and before the second run's mark (step 18), so
    # that the second run resumes there and reaches its mark. (At 0.3 s a
    # step, a quiet CI machine saved at 16, 6 steps after the signal.)
    assert 10 <= saved < 18, saved

    # 2. The same command resumes there; SIGTERM to the launcher.
    second = _start(
        _launcher(backup),
        tmp_path,
        "second",
        {
            **slow,
            "PREEMPT_MARK": str(tmp_path / "b{index}"),
            "PREEMPT_MARK_STEP": "18",
        },
    )
    pids = [
        harness.wait_for_pid_file(tmp_path / f"b{i}", second) for i in (0, 1)
    ]
    second.proc.send_signal(signal.SIGTERM)
    assert second.wait(timeout=60) == PREEMPTED, second.output()[-4000:]
    _assert_gone(pids)
    assert "received SIGTERM; forwarding it to every worker" in second.output()
    # The resume said where it resumed, and from which backup (the chief).
    resumed = [
        line
        for line in second.output().splitlines()
        if "[keras-replicator] restored the backup" in line
    ]
    assert len(resumed) == 1, second.output()[-4000:]
    epoch, step = divmod(saved, ref.STEPS_PER_EPOCH)
    where = f"after step {step} of epoch {epoch + 1}"
    if step == 0:
        where = f"at the start of epoch {epoch + 1}"
    assert f"{backup} ({where}" in resumed[0], resumed[0]
    for index in (0, 1):
        trained = second.result(index)["trained"]
        assert ref.step_of(trained[0]) == saved, trained
    resaved = ref.backup_step(backup)
    assert 18 <= resaved < 3 * ref.STEPS_PER_EPOCH, resaved
    assert ref.step_of(trained[-1]) + 1 in (resaved, resaved + 1)

    # 3. The same command trains only the rest. Worker 1 gets SIGTERM
    # after the last step's check: every worker backs up the end and
    # leaves with 75 (instead of dying after fit with the backup gone).
    third = _start(
        _launcher(backup), tmp_path, "third", {"PREEMPT_TERM_AT_END": "1"}
    )
    assert third.wait(timeout=240) == PREEMPTED, third.output()[-4000:]
    assert "stopped at the end of epoch 3" in third.output()
    for index in (0, 1):
        trained = third.result(index)["trained"]
        assert ref.step_of(trained[0]) == resaved
        assert len(trained) == ref.TOTAL_STEPS - resaved
    assert ref.backup_step(backup) == ref.TOTAL_STEPS

    # 4. The same command: nothing left to train, the uninterrupted weights.
    fourth = _start(_launcher(backup), tmp_path, "fourth", {})
    assert fourth.wait(timeout=240) == 0, fourth.output()[-4000:]
    for index in (0, 1):
        result = fourth.result(index)
        assert result["trained"] == []
        ref.assert_weights(result, references[4])


@pytest.mark.multi_worker
@pytest.mark.timeout(400)
def test_killed_while_writing_a_backup_resumes_from_the_previous_one(
    references, tmp_path
):
    backup = tmp_path / "backup"
    command = [sys.executable, str(WORKER), str(backup)]
    local = {"PREEMPT_REPLICATOR": "local", "PREEMPT_SAVE_FREQ": "3"}
    # 1. Killed while writing its third backup (step 9): step 6 stays.
    first = _start(
        command, tmp_path, "first", {**local, "PREEMPT_DIE_ON_SAVE": "3"}
    )
    assert first.wait(timeout=180) == -signal.SIGKILL, first.output()[-4000:]
    assert ref.backup_step(backup) == 6
    assert (tmp_path / "backup.partial").is_dir()  # the unfinished write

    # 2. Resumes from step 6; SIGTERM to the one process at step 13.
    second = _start(
        command,
        tmp_path,
        "second",
        {
            **local,
            "PREEMPT_MARK": str(tmp_path / "m"),
            "PREEMPT_MARK_STEP": "13",
            # One step's room for the signal to arrive after the mark.
            "PREEMPT_SLOW": "0.6",
        },
    )
    os.kill(harness.wait_for_pid_file(tmp_path / "m", second), signal.SIGTERM)
    assert second.wait(timeout=60) == PREEMPTED, second.output()[-4000:]
    trained = second.result()["trained"]
    assert ref.step_of(trained[0]) == 6
    assert ref.backup_step(backup) in (13, 14)

    # 3. The rest, to the weights of an uninterrupted run.
    third = _start(command, tmp_path, "third", local)
    assert third.wait(timeout=180) == 0, third.output()[-4000:]
    result = third.result()
    assert ref.step_of(result["trained"][0]) == ref.step_of(trained[-1]) + 1
    ref.assert_weights(result, references[2])


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
    first = _start(
        command,
        tmp_path,
        "first",
        {
            **slurm,
            "PREEMPT_MARK": str(tmp_path / "m"),
            "PREEMPT_MARK_STEP": "5",
            "PREEMPT_SLOW": "0.6",
        },
    )
    os.kill(harness.wait_for_pid_file(tmp_path / "m", first), signal.SIGUSR1)
    assert first.wait(timeout=60) == PREEMPTED, first.output()[-4000:]
    assert "preempted (SIGUSR1)" in first.output()
    saved = ref.backup_step(backup)
    assert saved in (5, 6)

    # `scontrol requeue`: the same job again, SLURM_RESTART_COUNT set.
    requeued = _start(
        command, tmp_path, "requeued", {**slurm, "SLURM_RESTART_COUNT": "1"}
    )
    assert requeued.wait(timeout=180) == 0, requeued.output()[-4000:]
    result = requeued.result()
    assert ref.step_of(result["trained"][0]) == saved
    ref.assert_weights(result, references[2])
