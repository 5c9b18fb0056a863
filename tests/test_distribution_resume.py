"""A keras.distribution backup resumes under other layouts, in one process.

ModelParallel stores a sharded variable in blocks, one per device, and so
does its backup (`keras.callbacks.BackupAndRestore`, and the save our
preemption patch does on SIGTERM at a step): a sharded checkpoint
(`sharding/checkpoint.py`) that every other mesh, `DataParallel` and one
device read with one device's numbers.

One fit, preempted twice, each leg a new model as a restarted script makes:
a (1, 4) mesh `("batch", "model")` over 4 local devices, stopped by SIGTERM
at a step of the first epoch; resumed under `DataParallel` over the same 4
devices and stopped by SIGTERM in the second epoch; resumed under a (2, 2)
mesh to the end. Each stop exits with `preemption.EXIT_CODE` and backs up
at its step, each resume starts at the step the last one stopped at, the
legs' steps add up to the whole training, and the weights are those of an
uninterrupted fit on one device (1e-5). Resuming the first backup with
other batches (twice the global batch) mid-epoch raises the `ValueError`
that says it cannot be exact, as without a mesh. The first backup holds
the hidden kernel and its Adam slots as the 4 (5, 2) blocks the devices
hold, each once, and no whole file; the `DataParallel` leg's backup is a
whole `.weights.h5` again.
The same chain across two workers is in
`tests/multi_worker/test_distribution_resume.py`.
"""

import functools
import json
import os
import signal

import h5py
import keras
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator._src.training import preemption
from tests.helpers import assert_weights_close
from tests.multi_worker import distribution_reference as reference
from tests.multi_worker import preempt_reference as ref

pytestmark = pytest.mark.filterwarnings("ignore:Your input ran out of data")

FIRST_STOP = 5  # step 5 of the first epoch
SECOND_STOP = 11  # step 3 of the second epoch
HIDDEN = (5, 8)  # the hidden kernel, split by columns on the model axis


def _fit(distribution, backup, stop_at=None, data=None):
    """A new model fit under `distribution`; weights, steps, hidden kernel.

    SIGTERM is sent from inside the fit after step `stop_at` (1-based, of
    the whole training); the fit must then raise `SystemExit`.
    """

    def at_step(step):
        if step == stop_at:
            os.kill(os.getpid(), signal.SIGTERM)

    keras.distribution.set_distribution(distribution)
    try:
        model = reference.build_preempt()
        probe = ref.Probe(at_step)
        callbacks = [probe]
        if backup is not None:
            callbacks.insert(0, keras.callbacks.BackupAndRestore(str(backup)))
        kernel = model.get_layer("hidden").kernel
        fit = functools.partial(
            model.fit,
            reference.preempt_dataset() if data is None else data,
            shuffle=False,
            epochs=ref.EPOCHS,
            callbacks=callbacks,
            verbose=0,
        )
        if stop_at is None:
            fit()
            return model.get_weights(), probe.trained, kernel
        with pytest.raises(SystemExit) as stopped:
            fit()
        preemption.cancel_exit_deadline()
        assert stopped.value.code == preemption.EXIT_CODE
        return None, probe.trained, kernel
    finally:
        keras.distribution.set_distribution(None)


def _sharded_blocks(backup):
    """`{variable path: [block shapes]}` of a sharded backup's index."""
    index = json.loads((backup / "sharded/index.json").read_text())
    return {
        entry["path"]: [tuple(b["shape"]) for b in entry["blocks"]]
        for entry in index["variables"].values()
    }


def _stored_shapes(backup):
    """The shape of every array in the backup's weights file."""
    shapes = []

    def visit(name, item):
        if isinstance(item, h5py.Dataset):
            shapes.append(item.shape)

    with h5py.File(backup / "latest.weights.h5", "r") as stored:
        stored.visititems(visit)
    return shapes


@pytest.mark.timeout(240)
def test_a_backup_resumes_on_a_1x4_mesh_data_parallel_then_a_2x2_mesh(
    tmp_path,
):
    one_device, _, _ = _fit(None, None)
    devices = keras.distribution.list_devices()[:4]
    backup = tmp_path / "backup"

    # (1, 4): stopped at a step of the first epoch.
    _, first, kernel = _fit(
        reference.preempt_distribution((1, 4), devices), backup, FIRST_STOP
    )
    assert set(kr.shard_shapes(kernel).values()) == {(5, 2)}
    assert len(first) == FIRST_STOP
    assert ref.backup_step(backup) == FIRST_STOP
    # Blocks: the kernel and its two Adam slots, 4 blocks of (5, 2) each,
    # as the devices hold them; no whole file.
    hidden = [
        shapes
        for path, shapes in _sharded_blocks(backup).items()
        if "hidden" in path and "kernel" in path
    ]
    assert hidden == [[(5, 2)] * 4] * 3
    assert not (backup / "latest.weights.h5").exists()

    # Other batches (twice the global batch) cannot resume mid-epoch
    # exactly: refused, as without a mesh, and the backup is left.
    inputs = ref.fit_inputs("arrays", None)
    doubled = tf.data.Dataset.from_tensor_slices(
        (inputs["x"], inputs["y"])
    ).batch(2 * ref.GLOBAL_BATCH)
    with pytest.raises(ValueError, match="cannot resume exactly") as info:
        _fit(
            keras.distribution.DataParallel(devices=devices),
            backup,
            data=doubled,
        )
    assert "its epochs had 8 batches and have 4 here" in str(info.value)
    assert ref.backup_step(backup) == FIRST_STOP

    # DataParallel over the same devices: resumed there, stopped again.
    _, second, _ = _fit(
        keras.distribution.DataParallel(devices=devices), backup, SECOND_STOP
    )
    assert ref.step_of(second[0]) == FIRST_STOP
    assert len(second) == SECOND_STOP - FIRST_STOP
    assert ref.backup_step(backup) == SECOND_STOP
    # Nothing is sharded there: a whole file, and the blocks are gone.
    assert _stored_shapes(backup).count(HIDDEN) == 3
    assert not (backup / "sharded").exists()

    # (2, 2): the rest.
    weights, third, kernel = _fit(
        reference.preempt_distribution((2, 2), devices), backup
    )
    assert set(kr.shard_shapes(kernel).values()) == {(5, 4)}
    assert ref.step_of(third[0]) == SECOND_STOP
    assert len(first) + len(second) + len(third) == ref.TOTAL_STEPS
    assert_weights_close(weights, one_device)
