"""A backup resumes on another topology with one device's numbers.

Each backup is written at a step by a SIGTERM (exit code 75), inside an
epoch, then resumed by the same plain `BackupAndRestore` fit on another
topology:

- 2 workers (`keras-replicator launch`, 1 replica each) resumed on
  `LocalReplicator(4)` in this process: more replicas, workers to local;
- `LocalReplicator(3)` in this process (its global batch of 8 splits
  3/3/2) resumed on 2 workers: fewer replicas, local to workers.

Both must train only the steps not done yet and end with the weights of
an uninterrupted fit on one device (1e-5). A real 2-worker backup of
`replicator.distribute(..., shuffle_seed=1)` data (each worker shuffles its
own shard, so a step's examples depend on the number of workers) resumed
in one process must raise the documented `ValueError` inside an epoch and
resume at an epoch end. Workers run `workers/preempt_worker.py`.
"""

import json
import os
import signal

import keras
import pytest

import keras_replicator as kr
from keras_replicator._src.core import env as env_names
from keras_replicator._src.training import preemption
from tests.helpers import assert_weights_close
from tests.multi_worker import harness
from tests.multi_worker import preempt_reference as ref

pytestmark = [
    pytest.mark.multi_worker,
    pytest.mark.filterwarnings("ignore:Your input ran out of data"),
]

WORKER = harness.REPO_ROOT / "tests/multi_worker/workers/preempt_worker.py"
BASE_ENV = {
    env_names.PREEMPTION_CHECK_SECONDS: "0.05",
    "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
    "PYTHONPATH": str(harness.REPO_ROOT),
}
STOP_AT = 11  # step 3 of the second epoch


@pytest.fixture(scope="module")
def one_device():
    return ref.reference_weights()


def _fit(replicator, backup, at_step=None, kind="arrays"):
    """The plain fit of the workers, here; its weights and steps trained."""
    model = ref.build(replicator)
    probe = ref.Probe(at_step)
    model.fit(
        **ref.fit_inputs(kind, replicator),
        epochs=ref.EPOCHS,
        callbacks=[keras.callbacks.BackupAndRestore(str(backup)), probe],
        verbose=0,
    )
    return model.get_weights(), probe.trained


def _topology(backup):
    metadata = json.loads((backup / "training_metadata.json").read_text())
    return metadata["keras_replicator"]["topology"]


def _launch(backup, tmp_path, name, env=None):
    return harness.Background(
        harness.launch_command(WORKER, [str(backup)], 2, 1),
        tmp_path,
        name,
        {**os.environ, **BASE_ENV, **(env or {})},
    )


@pytest.mark.timeout(400)
def test_two_workers_preempted_then_resumed_on_four_local_replicas(
    one_device, tmp_path, capfd
):
    backup = tmp_path / "backup"
    run = _launch(
        backup,
        tmp_path,
        "workers",
        {
            "PREEMPT_MARK": str(tmp_path / "m{index}"),
            "PREEMPT_MARK_STEP": str(STOP_AT),
            # Slow steps after the mark: the stop lands a few steps after
            # the signal however fast the machine runs them.
            "PREEMPT_SLOW": "0.6",
        },
    )
    for index in (0, 1):
        harness.wait_for_pid_file(tmp_path / f"m{index}", run)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(timeout=90) == preemption.EXIT_CODE, run.output()[-4000:]
    saved = ref.backup_step(backup)
    # After the signal, with steps left to train: usually mid second
    # epoch, sometimes at its end or in the third (a quiet machine once
    # stopped 6 steps after a mark), which resumes on the new topology
    # too. The workers stop at the next check they agreed on at the
    # previous one, from the step time then (`training/preemption.py`:
    # intervals double while steps are fast, 1, 2, 4, 8 steps). Steps are
    # fast until the mark and slow after it, so the check after the signal
    # can be several slow steps away.
    assert STOP_AT <= saved < ref.TOTAL_STEPS, saved
    assert _topology(backup) == {
        "replicator": "MultiWorkerReplicator",
        "workers": 2,
        "replicas": 2,
    }

    weights, trained = _fit(kr.LocalReplicator(4), backup)
    assert ref.step_of(trained[0]) == saved
    assert len(trained) == ref.TOTAL_STEPS - saved
    assert_weights_close(weights, one_device)
    assert (
        "resuming a backup written on MultiWorkerReplicator (2 workers, 2 "
        "replicas) on LocalReplicator (4 replicas)" in capfd.readouterr().err
    )


@pytest.mark.timeout(400)
def test_three_local_replicas_preempted_then_resumed_on_two_workers(
    one_device, tmp_path
):
    backup = tmp_path / "backup"

    def sigterm_at(step):
        if step == STOP_AT:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(SystemExit) as stopped:
        _fit(kr.LocalReplicator(3), backup, sigterm_at)
    preemption.cancel_exit_deadline()
    assert stopped.value.code == preemption.EXIT_CODE
    assert ref.backup_step(backup) == STOP_AT
    assert _topology(backup)["replicas"] == 3

    run = _launch(backup, tmp_path, "workers")
    assert run.wait(timeout=240) == 0, run.output()[-4000:]
    assert "resuming a backup written on LocalReplicator (3 replicas)" in (
        run.output()
    )
    for index in (0, 1):
        result = run.result(index)
        assert ref.step_of(result["trained"][0]) == STOP_AT
        assert len(result["trained"]) == ref.TOTAL_STEPS - STOP_AT
        ref.assert_weights(result, one_device)


@pytest.mark.timeout(400)
def test_a_two_worker_backup_of_distribute_data_resumed_in_one_process(
    tmp_path,
):
    backup = tmp_path / "backup"
    run = _launch(
        backup,
        tmp_path,
        "workers",
        {
            "PREEMPT_DATA": "distribute",
            "PREEMPT_MARK": str(tmp_path / "m{index}"),
            "PREEMPT_MARK_STEP": str(STOP_AT),
            # Slow steps after the mark: the stop lands a few steps after
            # the signal however fast the machine runs them.
            "PREEMPT_SLOW": "0.6",
        },
    )
    for index in (0, 1):
        harness.wait_for_pid_file(tmp_path / f"m{index}", run)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(timeout=90) == preemption.EXIT_CODE, run.output()[-4000:]
    saved = ref.backup_step(backup)
    assert STOP_AT <= saved < ref.TOTAL_STEPS, saved
    metadata = json.loads((backup / "training_metadata.json").read_text())
    ours = metadata["keras_replicator"]
    assert ours["topology"] == {
        "replicator": "MultiWorkerReplicator",
        "workers": 2,
        "replicas": 2,
    }
    assert ours["order_by_workers"] is True
    assert ours["num_batches"] == ref.STEPS_PER_EPOCH
    epoch, done = divmod(saved, ref.STEPS_PER_EPOCH)

    if done:
        # Inside the second epoch: finishing it on one worker would train
        # other examples than the 2 workers' shards still hold.
        with pytest.raises(ValueError) as info:
            _fit(kr.LocalReplicator(2), backup, kind="distribute")
        message = str(info.value)
        assert (
            f"written after step {done} of epoch {epoch + 1} on "
            "MultiWorkerReplicator (2 workers, 2 replicas), and on "
            "LocalReplicator (2 replicas) its data" in message
        )
        assert "on another number of workers" in message
        assert f"Received: backup_dir={str(backup)!r}" in message
        # Nothing was trained or written: the backup is still there.
        assert ref.backup_step(backup) == saved
    else:
        # At the second epoch's end: the third starts afresh here.
        _, trained = _fit(kr.LocalReplicator(2), backup, kind="distribute")
        assert trained[0] == (epoch, 0)
        assert len(trained) == ref.TOTAL_STEPS - saved
