"""A backup is never deleted unless it was restored, in one process.

Every pair of a setting that writes a backup (`ModelParallel` on a (1, 4)
mesh, whose backup is sharded; `DataParallel`; a `LocalReplicator`; one
device, with `keras_replicator` imported and nothing else) and one that
restores it (one device; a `LocalReplicator`; `ModelParallel` on a (2, 2)
mesh): the first fit trains one epoch and keeps its backup, a new model's
fit then resumes at the second epoch and ends with the weights of an
uninterrupted fit on one device (1e-5); only then is the backup deleted.
Before, one device started a sharded backup over at the first epoch,
without a word, and deleted it at the end. Also: a sharded backup written
inside an epoch restores on one device and says that the epoch starts
again; one that does not fit the model is refused by name, and kept; a
whole backup left in `<backup_dir>.previous` (a process killed between the
renames of a save) restores on one device; a whole backup written after a
sharded one, beside it, is the one restored; a sharded backup still being
written when the fit ends is abandoned if Keras deletes it next, and
finished if it stays. A backup written by 2
processes restoring on one device is in
`tests/multi_worker/test_distribution_resume.py`.
"""

import contextlib
import os
import shutil
import signal
import time

import keras
import pytest

import keras_replicator as kr
from keras_replicator._src.sharding import checkpoint
from keras_replicator._src.sharding import checkpoint_commit
from keras_replicator._src.sharding import checkpoint_files
from keras_replicator._src.training import preemption
from keras_replicator._src.training import resumption
from tests.helpers import assert_weights_close
from tests.multi_worker import distribution_reference as reference
from tests.multi_worker import preempt_reference as ref

pytestmark = pytest.mark.filterwarnings("ignore:Your input ran out of data")

SAVERS = ("model_parallel", "data_parallel", "replicator", "one_device")
PREVIOUS = resumption.PREVIOUS_SUFFIX


@pytest.fixture(autouse=True)
def no_distribution():
    keras.distribution.set_distribution(None)
    yield
    keras.distribution.set_distribution(None)


@contextlib.contextmanager
def _setting(name, mesh=(1, 4)):
    devices = keras.distribution.list_devices()[:4]
    if name == "replicator":
        with kr.LocalReplicator(num_replicas=2).scope():
            yield
        return
    if name == "model_parallel":
        distribution = reference.preempt_distribution(mesh, devices)
    elif name == "data_parallel":
        distribution = keras.distribution.DataParallel(devices=devices)
    else:
        yield
        return
    keras.distribution.set_distribution(distribution)
    try:
        yield
    finally:
        keras.distribution.set_distribution(None)


def _fit(
    name, backup, epochs, mesh=(1, 4), at_step=None, more=(), **backup_args
):
    """A new model's fit in setting `name`; its weights and steps trained."""
    with _setting(name, mesh):
        model = reference.build_preempt()
        probe = ref.Probe(at_step)
        model.fit(
            reference.preempt_dataset(),
            shuffle=False,
            epochs=epochs,
            callbacks=[
                keras.callbacks.BackupAndRestore(str(backup), **backup_args),
                probe,
                *more,
            ],
            verbose=0,
        )
        return model.get_weights(), probe.trained


@pytest.fixture(scope="module")
def one_device():
    """The weights of an uninterrupted fit of 2 epochs on one device."""
    model = reference.build_preempt()
    model.fit(reference.preempt_dataset(), shuffle=False, epochs=2, verbose=0)
    return model.get_weights()


@pytest.fixture(scope="module")
def three_epochs():
    """The same for 3 epochs."""
    model = reference.build_preempt()
    model.fit(reference.preempt_dataset(), shuffle=False, epochs=3, verbose=0)
    return model.get_weights()


# Whole backups under a replicator are restored under the others by the
# preemption patch's own tests; here the ones that went wrong and one more.
RESTORERS = {
    "model_parallel": ("one_device", "replicator", "model_parallel"),
    "data_parallel": ("one_device", "model_parallel"),
    "replicator": ("one_device", "model_parallel"),
    "one_device": ("one_device", "model_parallel"),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("saver", SAVERS)
def test_a_backup_resumes_under_every_setting_then_goes(
    saver, one_device, tmp_path, capfd
):
    saved = tmp_path / "saved"
    _fit(saver, saved, epochs=1, delete_checkpoint=False)
    assert (saved / "sharded").exists() == (saver == "model_parallel")
    for restorer in RESTORERS[saver]:
        backup = tmp_path / restorer
        shutil.copytree(saved, backup)
        capfd.readouterr()
        weights, trained = _fit(restorer, backup, epochs=2, mesh=(2, 2))
        said = capfd.readouterr().err
        where = f"{saver} -> {restorer}"
        assert trained[0] == (1, 0), where
        assert len(trained) == ref.STEPS_PER_EPOCH, where
        assert_weights_close(weights, one_device)
        # Deleted at the end, by Keras, once restored.
        assert not backup.exists(), where
        if saver == "model_parallel":
            assert f"restored the backup {backup}/sharded" in said, where


@pytest.mark.timeout(300)
def test_a_sharded_backup_from_inside_an_epoch_restores_on_one_device(
    tmp_path, capfd
):
    backup = tmp_path / "backup"

    def sigterm_at(step):
        if step == 5:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(SystemExit):
        _fit("model_parallel", backup, ref.EPOCHS, at_step=sigterm_at)
    preemption.cancel_exit_deadline()
    capfd.readouterr()
    with _setting("one_device"):
        model = reference.build_preempt()
        model.fit(
            reference.preempt_dataset(),
            shuffle=False,
            epochs=1,
            callbacks=[keras.callbacks.BackupAndRestore(str(backup))],
            verbose=0,
            steps_per_epoch=1,
        )
    said = capfd.readouterr().err
    assert f"restored the backup {backup}/sharded" in said
    assert "after step 5 of epoch 1" in said
    assert "this epoch starts again at its first batch" in said


def test_a_sharded_backup_that_does_not_fit_is_refused_and_kept(tmp_path):
    backup = tmp_path / "backup"
    _fit("model_parallel", backup, epochs=1, delete_checkpoint=False)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    model.compile("adam", "mse")
    with pytest.raises(ValueError, match="kr.load_checkpoint") as info:
        model.fit(
            reference.preempt_dataset(),
            shuffle=False,
            epochs=2,
            callbacks=[keras.callbacks.BackupAndRestore(str(backup))],
            verbose=0,
        )
    assert f"{backup}/sharded" in str(info.value)
    assert (backup / "sharded" / "index.json").exists()


def test_a_backup_left_in_previous_restores_on_one_device(one_device, tmp_path):
    backup = tmp_path / "backup"
    _fit("replicator", backup, epochs=1, delete_checkpoint=False)
    # A process killed between the two renames of its next save.
    os.rename(backup, f"{backup}{PREVIOUS}")
    weights, trained = _fit("one_device", backup, epochs=2)
    assert trained[0] == (1, 0)
    assert_weights_close(weights, one_device)
    assert not backup.exists()
    assert not os.path.exists(f"{backup}{PREVIOUS}")


def test_a_whole_backup_written_after_a_sharded_one_is_restored(
    three_epochs, tmp_path
):
    backup = tmp_path / "backup"
    _fit("model_parallel", backup, epochs=1, delete_checkpoint=False)
    # One device resumes the sharded backup and saves whole files beside
    # it, in place, as Keras does.
    _, trained = _fit("one_device", backup, epochs=2, delete_checkpoint=False)
    assert trained[0] == (1, 0)
    assert (backup / "sharded").exists()
    weights, trained = _fit("replicator", backup, epochs=3)
    assert trained[0] == (2, 0)
    assert_weights_close(weights, three_epochs)


class _OwnEnd(keras.callbacks.BackupAndRestore):
    """A subclass with an `on_train_end` of its own (which deletes too)."""

    def on_train_end(self, logs=None):
        shutil.rmtree(self.backup_dir, ignore_errors=True)


class _StopAfterTwo(keras.callbacks.Callback):
    """Stops the training at the second epoch's end (after its backup)."""

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            self.model.stop_training = True


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["deleted", "stopped", "kept", "own_end"])
def test_a_sharded_backup_in_flight_at_the_end_is_finished_only_if_kept(
    kind, one_device, tmp_path, monkeypatch, caplog
):
    committed = []
    commit = checkpoint_commit.commit

    def recording(directory, name, *args, **kwargs):
        committed.append(name)
        return commit(directory, name, *args, **kwargs)

    monkeypatch.setattr(checkpoint_commit, "commit", recording)
    abandoned = []
    abandon = checkpoint.CheckpointSave._abandon

    def counted_abandon(self):
        abandoned.append(self.name)
        abandon(self)

    monkeypatch.setattr(checkpoint.CheckpointSave, "_abandon", counted_abandon)
    # Every writer starts late: the fit ends while the last save waits.
    monkeypatch.setattr(
        checkpoint_commit, "yield_to_training", lambda: time.sleep(1)
    )
    if kind == "own_end":
        monkeypatch.setattr(keras.callbacks, "BackupAndRestore", _OwnEnd)
    begun = []
    save = checkpoint.save

    def counted_save(*args, **kwargs):
        handle = save(*args, **kwargs)
        begun.append(handle.name)
        return handle

    monkeypatch.setattr(checkpoint, "save", counted_save)
    backup = tmp_path / "backup"
    # "stopped": 3 epochs, stopped by a callback after the second.
    weights, _ = _fit(
        "model_parallel",
        backup,
        3 if kind == "stopped" else 2,
        more=[_StopAfterTwo()] if kind == "stopped" else [],
        delete_checkpoint=kind != "kept",
    )
    monkeypatch.undo()
    assert_weights_close(weights, one_device)
    # The first epoch's backup is written: the second save waits for it,
    # or, where there is none, the fit's end (no earlier backup to resume
    # from). The second, at the end of the training with Keras' own
    # `on_train_end` deleting it next, is not even begun; stopped early,
    # it is begun and abandoned; it is written when it stays or a
    # subclass's `on_train_end` runs.
    steps = ref.STEPS_PER_EPOCH
    expected = [f"ckpt-{steps}", f"ckpt-{2 * steps}"]
    assert begun == expected[: 1 if kind == "deleted" else 2]
    assert committed == expected[: 1 if kind in ("deleted", "stopped") else 2]
    # Only the save in flight: one abandonment (one barrier), not one for
    # every backup of the fit.
    assert abandoned == (expected[1:] if kind == "stopped" else [])
    assert backup.exists() == (kind == "kept")
    if kind == "kept":
        index = checkpoint_files.read_index(backup / "sharded")
        assert index["checkpoint"] == f"ckpt-{2 * steps}"
    assert "was not written" not in caplog.text


@pytest.mark.timeout(300)
def test_no_backup_at_the_last_step_when_keras_deletes_it(
    one_device, tmp_path, monkeypatch
):
    """`save_freq` in steps: the save at the training's last step is not
    made when Keras deletes the backup next, and is when it is kept."""
    begun = {}
    save = checkpoint.save

    for delete in (True, False):
        names = begun.setdefault(delete, [])

        def counted_save(*args, names=names, **kwargs):
            handle = save(*args, **kwargs)
            names.append(handle.name)
            return handle

        monkeypatch.setattr(checkpoint, "save", counted_save)
        weights, _ = _fit(
            "model_parallel",
            tmp_path / f"backup-{delete}",
            2,
            save_freq=2,
            delete_checkpoint=delete,
        )
        monkeypatch.undo()
        assert_weights_close(weights, one_device)
    last = f"ckpt-{2 * ref.STEPS_PER_EPOCH}"
    assert begun[False][-1] == last
    assert len(begun[False]) == ref.STEPS_PER_EPOCH
    assert begun[True] == begun[False][:-1]
