"""A ModelParallel backup resumes on another mesh with one device's numbers.

One fit, preempted twice: a (1, 4) mesh `("batch", "model")` in this
process stopped by SIGTERM at a step; resumed on 2 workers (`keras-replicator
launch`, 2 replicas each, a (2, 2) mesh: batch across the workers, model
inside each) and stopped there by SIGTERM inside an epoch; that backup
resumed to the end on 4 workers of one device each ((1, 4) mesh), under
`DataParallel(4)`, on one device, and in this process under the (1, 4)
mesh again. One process group covers both directions.

Backups are sharded checkpoints (every process writes the blocks it holds,
no gather), which each mesh reads with one device's numbers, so both end
with the weights of an uninterrupted fit on one device (1e-5).
Workers run `workers/distribution_preempt_worker.py`.
"""

import json
import os
import shutil
import signal

import keras
import numpy as np
import pytest

import keras_replicator as kr
from keras_replicator._src.core import env as env_names
from keras_replicator._src.training import preemption
from tests.helpers import assert_weights_close
from tests.multi_worker import distribution_reference as reference
from tests.multi_worker import harness
from tests.multi_worker import preempt_reference as ref

pytestmark = [
    pytest.mark.multi_worker,
    pytest.mark.filterwarnings("ignore:Your input ran out of data"),
]

WORKER = (
    harness.REPO_ROOT
    / "tests/multi_worker/workers/distribution_preempt_worker.py"
)
BASE_ENV = {
    env_names.PREEMPTION_CHECK_SECONDS: "0.05",
    "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
    "PYTHONPATH": str(harness.REPO_ROOT),
}
FIRST_STOP = 5  # step 5 of the first epoch
SECOND_MARK = 11  # step 3 of the second epoch


@pytest.fixture(scope="module")
def one_device():
    model = reference.build_preempt()
    model.fit(
        reference.preempt_dataset(), shuffle=False, epochs=ref.EPOCHS, verbose=0
    )
    return model.get_weights()


def _fit_on_one_host(backup, at_step=None, distribution="mesh"):
    """The workers' fit here; weights, steps trained.

    `distribution`: "mesh" (a (1, 4) mesh), "data_parallel" (4 devices),
    "one_device", or None (no distribution: Keras alone).
    """
    devices = keras.distribution.list_devices()[:4]
    keras.distribution.set_distribution(
        None
        if distribution is None
        else {
            "mesh": lambda: reference.preempt_distribution((1, 4), devices),
            "data_parallel": lambda: keras.distribution.DataParallel(
                devices=devices
            ),
            # One device as keras.distribution has it (the backup's exact
            # resume needs one of our strategies: see Limits).
            "one_device": lambda: keras.distribution.DataParallel(
                devices=devices[:1]
            ),
        }[distribution]()
    )
    try:
        model = reference.build_preempt()
        probe = ref.Probe(at_step)
        model.fit(
            reference.preempt_dataset(),
            shuffle=False,
            epochs=ref.EPOCHS,
            callbacks=[keras.callbacks.BackupAndRestore(str(backup)), probe],
            verbose=0,
        )
        return model.get_weights(), probe.trained
    finally:
        keras.distribution.set_distribution(None)


def _shard_shapes_on_two_by_two():
    """`kr.shard_shapes` of every checkpointed variable on the (2, 2) mesh.

    The workers' mesh, built here on 4 devices: keyed as the checkpoint's
    index keys them (`model/<i>`, `optimizer/<i>`), each a list of the
    blocks' shapes in device order.
    """
    devices = keras.distribution.list_devices()[:4]
    keras.distribution.set_distribution(
        reference.preempt_distribution((2, 2), devices)
    )
    try:
        model = reference.build_preempt()
        model.optimizer.build(model.trainable_variables)
        shapes = {
            f"model/{i}": list(kr.shard_shapes(v).values())
            for i, v in enumerate(model.weights)
        }
        shapes.update(
            {
                f"optimizer/{i}": list(kr.shard_shapes(v).values())
                for i, v in enumerate(model.optimizer.variables)
            }
        )
        return shapes
    finally:
        keras.distribution.set_distribution(None)


def _launch(backup, tmp_path, name, env=None):
    return harness.Background(
        harness.launch_command(WORKER, [str(backup)], 2, 2),
        tmp_path,
        name,
        {**os.environ, **BASE_ENV, **(env or {})},
    )


@pytest.mark.timeout(500)
def test_a_backup_reshards_between_one_host_and_two_workers(
    one_device, tmp_path, capfd
):
    backup = tmp_path / "backup"

    def sigterm_at(step):
        if step == FIRST_STOP:
            os.kill(os.getpid(), signal.SIGTERM)

    # One host, (1, 4): stopped at a step of the first epoch.
    with pytest.raises(SystemExit) as stopped:
        _fit_on_one_host(backup, sigterm_at)
    preemption.cancel_exit_deadline()
    assert stopped.value.code == preemption.EXIT_CODE
    assert ref.backup_step(backup) == FIRST_STOP

    # Two workers, (2, 2): resumed there, stopped in the second epoch.
    run = _launch(
        backup,
        tmp_path,
        "workers",
        {
            "PREEMPT_MARK": str(tmp_path / "m{index}"),
            "PREEMPT_MARK_STEP": str(SECOND_MARK),
            "PREEMPT_SLOW": "0.6",
        },
    )
    for index in (0, 1):
        harness.wait_for_pid_file(tmp_path / f"m{index}", run)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(timeout=90) == preemption.EXIT_CODE, run.output()[-4000:]
    for index in (0, 1):
        trained = run.result(index)["trained"]
        assert ref.step_of(trained[0]) == FIRST_STOP, trained
    saved = ref.backup_step(backup)
    # After the mark, with steps left (see test_resume_topology.py).
    assert SECOND_MARK <= saved < ref.TOTAL_STEPS, saved
    # Both workers wrote into one sharded checkpoint, each block once:
    # on the (2, 2) mesh worker 0 holds both column blocks of each split
    # variable (worker 1 holds copies), so its file has them all.
    index = json.loads((backup / "sharded/index.json").read_text())
    assert index["processes"] == 2
    shard_shapes = _shard_shapes_on_two_by_two()
    written = 0
    for key, entry in index["variables"].items():
        files = [b["file"].rpartition("/")[2] for b in entry["blocks"]]
        assert files == ["process-0.bin"] * len(files), entry["path"]
        if entry["layout"] is not None:
            assert len(files) == 2, entry
        # Each block is what kr.shard_shapes says a device holds.
        assert {tuple(b["shape"]) for b in entry["blocks"]} == {
            tuple(s) for s in shard_shapes[key]
        }, key
        written += sum(b["nbytes"] for b in entry["blocks"])
    # Process 0's file is its blocks and nothing else; process 1's is empty.
    folder = backup / "sharded" / index["checkpoint"]
    assert (folder / "process-0.bin").stat().st_size == written
    part = folder / "process-1.bin"
    assert not part.exists() or part.stat().st_size == 0
    assert not (backup / "latest.weights.h5").exists()

    # The workers' sharded backup resumes anywhere: 4 processes of one
    # device each on a (1, 4) mesh, DataParallel(4) and one device here
    # (each from a copy), and one host's (1, 4) mesh: the rest, with one
    # device's weights each time.
    for where in ("4x1", "data_parallel", "one_device"):
        copy = tmp_path / f"backup_{where}"
        shutil.copytree(backup, copy)
        if where == "4x1":
            run = harness.Background(
                harness.launch_command(WORKER, [str(copy)], 4, 1),
                tmp_path,
                "four",
                {**os.environ, **BASE_ENV, "PREEMPT_MESH": "1,4"},
            )
            assert run.wait(timeout=150) == 0, run.output()[-4000:]
            results = [run.result(i) for i in range(4)]
            weights = [np.asarray(w) for w in results[0]["weights"]]
            trained = results[0]["trained"]
        else:
            capfd.readouterr()
            weights, trained = _fit_on_one_host(copy, distribution=where)
            # The workers' replicator by the name the documentation uses.
            assert (
                "resuming a backup written on MultiWorkerReplicator (2 "
                "workers, 4 replicas) on LocalReplicator ("
            ) in capfd.readouterr().err
        assert ref.step_of(trained[0]) == saved, where
        assert_weights_close(weights, one_device)
    # With no distribution at all (a script run on one device to debug
    # it): restored, not deleted unread; only our strategies resume at the
    # step, so the epoch in progress starts again, and a line says so.
    copy = tmp_path / "backup_none"
    shutil.copytree(backup, copy)
    capfd.readouterr()
    _, trained = _fit_on_one_host(copy, distribution=None)
    assert trained[0] == (saved // ref.STEPS_PER_EPOCH, 0)
    said = capfd.readouterr().err
    assert f"restored the backup {copy}/sharded" in said
    assert "written on MultiWorkerReplicator (2 workers, 4 replicas)" in said
    weights, trained = _fit_on_one_host(backup)
    assert ref.step_of(trained[0]) == saved
    assert len(trained) == ref.TOTAL_STEPS - saved
    assert_weights_close(weights, one_device)


@pytest.mark.timeout(300)
def test_a_second_fit_starts_afresh_on_every_worker(tmp_path):
    """The chief deletes the backup at a fit's end; nobody reads it first.

    The chief deletes slowly (6 s): a worker that went straight on to the
    next fit would find the backup, restore it and train nothing, while
    the chief trained every step; and one that waited only as long as the
    collective timeout (4 s here) would fail. Each fit's last backup is
    not made (Keras deletes it next); the one before is usually still in
    flight at the end (its writer starts 1 s late), and is then abandoned
    by both processes together.
    """
    backup = tmp_path / "backup"
    run = _launch(backup, tmp_path, "refit", {"PREEMPT_REFIT": "1"})
    assert run.wait(timeout=150) == 0, run.output()[-4000:]
    for index in (0, 1):
        result = run.result(index)
        assert len(result["trained"]) == ref.TOTAL_STEPS
        assert result["trained_again"] == result["trained"], index
    assert not backup.exists()
    # Each fit's last backup was abandoned on both, and nothing failed.
    assert "was not written" not in run.output()
