"""The chief-only hook: Keras attributes it relies on, and reversibility."""

import inspect
import os

import keras
from keras.src.callbacks import callback_list

from keras_replicator._src.callbacks import chief_only


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


def test_install_is_reversible():
    was = chief_only.installed()
    chief_only.uninstall()
    keras_init = callback_list.CallbackList.__init__
    chief_only.install()
    chief_only.install()
    assert callback_list.CallbackList.__init__ is not keras_init
    chief_only.uninstall()
    assert callback_list.CallbackList.__init__ is keras_init
    if was:
        chief_only.install()
