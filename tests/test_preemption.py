"""Preemption in one process: save at the step, exit 75, resume exactly.

The signal is sent from inside the fit (a callback `os.kill`s its own
process), so it always lands at the same step; the fit must stop at that
step, write a loadable backup there and raise `SystemExit(75)`. A new fit
with a new model, as a restarted script would make, must train only the
remaining steps and end with an uninterrupted run's weights, for shuffled
arrays, a reshuffled `tf.data` dataset and `replicator.distribute`.
Real processes (SIGKILL mid-backup, simulated Slurm, the launcher) are in
`tests/multi_worker/test_preemption.py`.
"""

import json
import logging
import os
import signal
import sys

import keras
import pytest

import keras_replicator as kr
from keras_replicator._src.cluster import launch
from keras_replicator._src.core import env
from keras_replicator._src.training import preemption
from tests.helpers import assert_weights_close
from tests.multi_worker import preempt_reference as ref

STOP_AT = 11  # step 3 of the second epoch


def _fit(
    kind,
    backup_dir,
    stop_at=None,
    sig=signal.SIGTERM,
    backup=True,
    replicas=2,
    extra_callbacks=(),
    **fit_kwargs,
):
    replicator = kr.LocalReplicator(replicas)
    model = ref.build(replicator)

    def at_step(step):
        if step == stop_at:
            os.kill(os.getpid(), sig)

    probe = ref.Probe(at_step)
    callbacks = [probe, *extra_callbacks]
    if backup:
        callbacks.insert(0, keras.callbacks.BackupAndRestore(backup_dir))
    model.fit(
        **{**ref.fit_inputs(kind, replicator), **fit_kwargs},
        epochs=ref.EPOCHS,
        callbacks=callbacks,
        verbose=0,
    )
    return model.get_weights(), probe.trained


def _preempted(*args, **kwargs):
    with pytest.raises(SystemExit) as stopped:
        _fit(*args, **kwargs)
    preemption.cancel_exit_deadline()
    return stopped.value.code


def _metadata(backup_dir):
    with open(os.path.join(backup_dir, "training_metadata.json")) as f:
        return json.load(f)


def _digests(caplog):
    """The backups' debug log, in order: (what happened, digest) pairs."""
    return [
        tuple(r.getMessage().split(", ", 1))
        for r in caplog.records
        if r.name == "keras_replicator" and r.getMessage().startswith("backup ")
    ]


@pytest.fixture(scope="module")
def references():
    return {kind: _fit(kind, None, backup=False)[0] for kind in ref.DATA_KINDS}


@pytest.mark.parametrize("kind", ref.DATA_KINDS)
def test_sigterm_saves_at_the_step_and_resume_is_exact(
    kind, references, tmp_path, caplog
):
    backup_dir = str(tmp_path / "backup")
    handler = signal.getsignal(signal.SIGTERM)
    caplog.set_level(logging.DEBUG, logger="keras_replicator")
    assert _preempted(kind, backup_dir, stop_at=STOP_AT) == 75
    assert signal.getsignal(signal.SIGTERM) is handler
    ours = _metadata(backup_dir)["keras_replicator"]
    assert (ours["epoch"], ours["steps_done"]) == (1, 3)

    weights, trained = _fit(kind, backup_dir)
    # The debug log: what the last save carried is what the restore read,
    # 11 optimizer steps.
    lines = _digests(caplog)
    restored = next(
        i for i, (what, _) in enumerate(lines) if "restored" in what
    )
    assert lines[restored - 1][0].startswith("backup saved to")
    assert lines[restored - 1][1] == lines[restored][1]
    assert lines[restored][1].startswith(
        "after step 3 of epoch 2: {'iterations': 11,"
    )
    # Only the steps not done yet, numbered as in an uninterrupted run.
    assert trained[0] == (1, 3)
    assert len(trained) == ref.TOTAL_STEPS - STOP_AT
    assert_weights_close(weights, references[kind])
    assert not os.path.exists(backup_dir)  # Keras deletes it at the end


def test_distribute_data_trains_one_optimizer_step_per_batch(references):
    # Keras knows the number of steps, so it never runs its train function
    # on the exhausted iterator: that call raced the end-of-data error and
    # sometimes counted an optimizer step without data (9 per epoch of 8).
    replicator = kr.LocalReplicator(2)
    model = ref.build(replicator)
    model.fit(
        **ref.fit_inputs("distribute", replicator),
        epochs=ref.EPOCHS,
        verbose=0,
    )
    assert int(model.optimizer.iterations.numpy()) == ref.TOTAL_STEPS
    assert_weights_close(model.get_weights(), references["distribute"])
    # One device, fed by the same sharder: the same batches, the same
    # weights.
    one = kr.LocalReplicator(1)
    single = ref.build(one)
    single.fit(
        **ref.fit_inputs("distribute", one), epochs=ref.EPOCHS, verbose=0
    )
    assert_weights_close(single.get_weights(), references["distribute"])


def test_configured_signal_and_an_epoch_end_backup(references, tmp_path):
    backup_dir = str(tmp_path / "backup")
    # The last step of the first epoch: the backup says "epoch 2, step 0".
    assert (
        _preempted("dataset", backup_dir, stop_at=8, sig=signal.SIGUSR1) == 75
    )
    ours = _metadata(backup_dir)["keras_replicator"]
    assert (ours["epoch"], ours["steps_done"]) == (0, 8)
    weights, trained = _fit("dataset", backup_dir)
    assert trained[0] == (1, 0)
    assert_weights_close(weights, references["dataset"])


class _SigtermAtTheLastEpochEnd(keras.callbacks.Callback):
    """SIGTERM after the last step's check: in the last epoch's end."""

    def on_epoch_end(self, epoch, logs=None):
        if epoch == ref.EPOCHS - 1:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_signal_after_the_last_step_backs_up_the_end_and_leaves(
    references, tmp_path
):
    # Stock Keras would re-deliver the signal after fit (the script dies
    # before its own final save) with the backup already deleted.
    backup_dir = str(tmp_path / "backup")
    with pytest.raises(SystemExit) as stopped:
        _fit(
            "arrays", backup_dir, extra_callbacks=[_SigtermAtTheLastEpochEnd()]
        )
    preemption.cancel_exit_deadline()
    assert stopped.value.code == 75
    assert _metadata(backup_dir)["epoch"] == ref.EPOCHS
    # The restarted script's fit trains nothing and returns.
    weights, trained = _fit("arrays", backup_dir)
    assert trained == []
    assert_weights_close(weights, references["arrays"])
    assert not os.path.exists(backup_dir)


@pytest.mark.parametrize("kind", ["arrays", "distribute"])
def test_a_backup_resumes_on_another_replica_count(
    kind, references, tmp_path, capfd
):
    # 2 replicas to 4; the multi-worker directions are in
    # tests/multi_worker/test_resume_topology.py.
    backup_dir = str(tmp_path / "backup")
    assert _preempted(kind, backup_dir, stop_at=STOP_AT) == 75
    topology = _metadata(backup_dir)["keras_replicator"]["topology"]
    assert topology == {
        "replicator": "LocalReplicator",
        "workers": 1,
        "replicas": 2,
    }
    weights, trained = _fit(kind, backup_dir, replicas=4)
    assert trained[0] == (1, 3)
    assert len(trained) == ref.TOTAL_STEPS - STOP_AT
    # The uninterrupted run on 2 replicas (one data pipeline's order).
    assert_weights_close(weights, references[kind])
    assert (
        "resuming a backup written on LocalReplicator (2 replicas) on "
        "LocalReplicator (4 replicas), with the same global batch"
    ) in capfd.readouterr().err


def test_a_mid_epoch_resume_with_other_batches_says_it_cannot_be_exact(
    tmp_path,
):
    backup_dir = str(tmp_path / "backup")
    assert _preempted("arrays", backup_dir, stop_at=STOP_AT) == 75
    # Twice the global batch: 4 batches per epoch instead of 8.
    with pytest.raises(ValueError, match="cannot resume exactly") as info:
        _fit("arrays", backup_dir, batch_size=2 * ref.GLOBAL_BATCH)
    message = str(info.value)
    assert "written after step 3 of epoch 2" in message
    assert "its epochs had 8 batches and have 4 here" in message
    assert f"Received: backup_dir={backup_dir!r}" in message


def test_data_sharded_per_worker_cannot_resume_mid_epoch_elsewhere(tmp_path):
    backup_dir = str(tmp_path / "backup")
    assert _preempted("distribute", backup_dir, stop_at=STOP_AT) == 75
    # As 2 workers write it: `replicator.distribute(..., shuffle_seed=1)`
    # shuffles within each worker's shard, so a step's examples depend on
    # the number of workers.
    path = os.path.join(backup_dir, "training_metadata.json")
    metadata = _metadata(backup_dir)
    ours = metadata["keras_replicator"]
    ours["topology"] = {**ours["topology"], "workers": 2, "replicas": 4}
    ours["order_by_workers"] = True
    with open(path, "w") as f:
        json.dump(metadata, f)
    with pytest.raises(ValueError, match="on another number of workers"):
        _fit("distribute", backup_dir)
    # An epoch-end backup starts its next epoch afresh on any topology.
    ours["steps_done"] = 0
    with open(path, "w") as f:
        json.dump(metadata, f)
    _fit("distribute", backup_dir)


def test_without_backup_the_fit_still_stops_at_the_step(tmp_path):
    assert _preempted("arrays", None, stop_at=5, backup=False) == 75


def test_signals_not_configured_are_left_alone(monkeypatch):
    monkeypatch.setenv(env.PREEMPTION_SIGNALS, "SIGUSR1")
    replicator = kr.LocalReplicator(2)
    model = ref.build(replicator)
    seen = []

    def handler(signum, frame):
        seen.append(signum)

    previous = signal.signal(signal.SIGUSR2, handler)
    try:
        probe = ref.Probe(
            lambda step: step == 2 and os.kill(os.getpid(), signal.SIGUSR2)
        )
        model.fit(
            **ref.fit_inputs("arrays", replicator),
            epochs=1,
            callbacks=[probe],
            verbose=0,
        )
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert seen == [signal.SIGUSR2]
    assert len(probe.trained) == ref.STEPS_PER_EPOCH


def test_preemption_settings_are_validated(monkeypatch):
    monkeypatch.setenv(env.PREEMPTION_SIGNALS, "SIGTERM, usr1")
    assert preemption.signals_from_env() == (signal.SIGTERM, signal.SIGUSR1)
    monkeypatch.setenv(env.PREEMPTION_SIGNALS, "")
    assert preemption.signals_from_env() == ()
    for bad in ("SIGKILL", "SIGNOPE"):
        monkeypatch.setenv(env.PREEMPTION_SIGNALS, bad)
        with pytest.raises(ValueError, match=f"Received: '{bad}'"):
            preemption.signals_from_env()
    monkeypatch.setenv(env.PREEMPTION_CHECK_SECONDS, "0")
    with pytest.raises(ValueError, match="Received: '0'"):
        preemption.check_seconds_from_env()


def _fails_twice(directory):
    """A worker command whose worker 1 fails its first two launches."""
    program = (
        "import json, os, sys\n"
        f"d = {str(directory)!r}\n"
        "if json.loads(os.environ['TF_CONFIG'])['task']['index'] == 1:\n"
        "    n = len(os.listdir(d))\n"
        "    open(os.path.join(d, str(n)), 'w').close()\n"
        "    sys.exit(3 if n < 2 else 0)\n"
    )
    return [sys.executable, "-c", program]


def test_launch_restarts_a_failed_group_up_to_max_restarts(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert launch.launch(_fails_twice(tmp_path / "a"), 2, max_restarts=1) == 3
    assert launch.launch(_fails_twice(tmp_path / "b"), 2, max_restarts=2) == 0
    out = capsys.readouterr().out
    assert "starting all workers again on new ports (restart 1 of 1)" in out
    assert "(restart 2 of 2)" in out
    with pytest.raises(ValueError, match="Received: max_restarts=-1"):
        launch.launch(["true"], workers=1, max_restarts=-1)


_GLUE = """
import keras, numpy as np
import keras_replicator as kr
from keras_replicator._src.training import preemption


class Say(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 2:
            preemption.say("a message mid-epoch")


with kr.LocalReplicator(1).scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
model.fit(np.ones((64, 4)), np.ones((64, 1)), batch_size=8, epochs=1,
          callbacks=[Say()])
"""


def test_a_message_during_fit_is_not_glued_onto_the_progress_bar(tmp_path):
    # stdout and stderr in one pipe, as `keras-replicator launch` reads
    # them: the bar's open line is ended before the message.
    import subprocess

    result = subprocess.run(
        [sys.executable, "-c", _GLUE],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=240,
        cwd=tmp_path,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    out = result.stdout.decode(errors="replace")
    assert result.returncode == 0, out[-3000:]
    (line,) = [x for x in out.split("\n") if "a message mid-epoch" in x]
    assert line == "[keras-replicator] a message mid-epoch", repr(line)
