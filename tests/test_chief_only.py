"""The chief-only hook: Keras attributes it relies on, and reversibility."""

import inspect
import os

import keras
import numpy as np
import pytest
from keras.src.callbacks import callback_list

import keras_replicator as kr
from keras_replicator._src.patches import chief_only
from keras_replicator._src.patches import registry


def test_callback_list_init_signature_is_what_the_hook_wraps():
    params = inspect.signature(callback_list.CallbackList.__init__).parameters
    assert list(params)[:5] == [
        "self",
        "callbacks",
        "add_history",
        "add_progbar",
        "model",
    ]


def test_callbacks_keep_their_paths_where_the_hook_moves_them(tmp_path):
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "b"))
    for name in chief_only.BACKUP_ATTRIBUTES:
        assert os.fspath(getattr(backup, name)).startswith(str(tmp_path / "b"))
    made = {
        keras.callbacks.ModelCheckpoint: (str(tmp_path / "c.keras"),),
        keras.callbacks.CSVLogger: (str(tmp_path / "l.csv"),),
        keras.callbacks.TensorBoard: (str(tmp_path / "tb"),),
    }
    for cls, names in chief_only.PATH_ATTRIBUTES:
        callback = cls(*made[cls])
        for name in names:
            assert getattr(callback, name) == made[cls][0]


def test_redirect_moves_paths_and_cleanup_restores_them(tmp_path):
    csv = keras.callbacks.CSVLogger(str(tmp_path / "log.csv"))
    bar = keras.callbacks.ProgbarLogger()
    out = chief_only.redirect([csv, bar], worker_index=1)
    assert bar not in out
    assert csv.filename != str(tmp_path / "log.csv")
    tmp = os.path.dirname(os.path.dirname(csv.filename))
    assert os.path.isdir(tmp)
    out[-1].on_train_begin()
    out[-1].on_test_end()  # validation inside fit: not the end
    assert os.path.isdir(tmp)
    out[-1].on_train_end()
    assert csv.filename == str(tmp_path / "log.csv")
    assert not os.path.exists(tmp)


def test_install_is_reversible(restore_patches):
    registry = restore_patches
    registry.uninstall_all()
    keras_init = callback_list.CallbackList.__init__
    registry.install(["chief_only"])
    registry.install(["chief_only"])
    assert callback_list.CallbackList.__init__ is not keras_init
    registry.uninstall(["chief_only"])
    assert callback_list.CallbackList.__init__ is keras_init


class _NonChief(kr.LocalReplicator):
    """One process playing a non-chief worker, for the hook's sake."""

    is_chief = False
    worker_index = 1


class _Raise(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        raise RuntimeError("boom")


class _NestedPredict(keras.callbacks.Callback):
    """Calls predict with one of fit's own callbacks in the middle of fit."""

    def __init__(self, shared, x):
        super().__init__()
        self.shared, self.x, self.seen = shared, x, []

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append(self.shared.filename)
        self.model.predict(self.x, callbacks=[self.shared], verbose=0)
        self.seen.append(self.shared.filename)


@pytest.fixture
def non_chief_model():
    registry.install(["chief_only"])
    with _NonChief(num_replicas=1).scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    x = np.ones((8, 3), "float32")
    return model, x


def test_paths_come_back_after_a_fit_that_raised(tmp_path, non_chief_model):
    model, x = non_chief_model
    path = str(tmp_path / "log.csv")
    csv = keras.callbacks.CSVLogger(path)
    # A script that catches the error: the call's CallbackList is freed.
    try:
        model.fit(x, x[:, :1], callbacks=[csv, _Raise()], verbose=0)
    except RuntimeError:
        pass
    assert csv.filename == path
    # A notebook keeps the last traceback (and the call's frame) alive; the
    # next call restores the paths before moving them again.
    kept = None
    try:
        model.fit(x, x[:, :1], callbacks=[csv, _Raise()], verbose=0)
    except RuntimeError as e:
        kept = e
    assert csv.filename != path
    model.fit(x, x[:, :1], callbacks=[csv], verbose=0)
    assert csv.filename == path, kept
    assert not (tmp_path / "log.csv").exists()  # a non-chief never wrote it


def test_a_nested_call_keeps_the_running_calls_paths(tmp_path, non_chief_model):
    model, x = non_chief_model
    path = str(tmp_path / "log.csv")
    csv = keras.callbacks.CSVLogger(path)
    nested = _NestedPredict(csv, x)
    model.fit(x, x[:, :1], epochs=2, callbacks=[csv, nested], verbose=0)
    moved = nested.seen[0]
    assert moved != path
    # predict moved it again and put back fit's temporary path, not the real
    # one, while fit ran.
    assert nested.seen == [moved, moved, moved, moved]
    assert csv.filename == path


def test_a_users_own_callback_list_is_not_taken_for_abandoned(
    tmp_path, non_chief_model
):
    model, x = non_chief_model
    path = str(tmp_path / "log.csv")
    csv = keras.callbacks.CSVLogger(path)

    def make_list():  # its frame ends; the list lives on in a custom loop
        return keras.callbacks.CallbackList([csv], model=model)

    callbacks = make_list()
    moved = csv.filename
    assert moved != path
    model.predict(x, verbose=0)  # another call: must not finish the list
    assert csv.filename == moved
    callbacks.on_train_begin()
    callbacks.on_train_end()
    assert csv.filename == path
