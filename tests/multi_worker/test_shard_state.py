"""Sharded optimizer state on 2 workers x 2 replicas equals one device."""

import keras
import pytest

import keras_replicator as kr
from tests import helpers
from tests import test_shard_state as cases
from tests.multi_worker import harness

WORKER = harness.REPO_ROOT / "tests/multi_worker/workers/shard_state_worker.py"


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("shard_state")


@pytest.fixture(scope="module")
def workers(out_dir):
    return harness.run_workers(
        WORKER,
        num_workers=2,
        replicas_per_worker=2,
        args=[str(out_dir)],
        timeout=900,
    )


@pytest.mark.multi_worker
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", sorted(cases.MULTI_WORKER_CASES))
def test_sharded_matches_one_device(workers, name):
    optimizer, options = cases.MULTI_WORKER_CASES[name]
    epochs = 1 if name == "adam" else 2
    reference = cases._train(
        None, cases.OPTIMIZERS[optimizer], epochs=epochs, **dict(options)
    )
    for w in workers:
        assert list(w.result[name]["slot_shape"]) == [14]
        helpers.assert_weights_close(
            w.result[name]["weights"], reference.get_weights()
        )


@pytest.mark.multi_worker
@pytest.mark.timeout(1200)
def test_saved_state_is_full(workers):
    reference = cases._train(None, cases.OPTIMIZERS["adam"], epochs=1)
    for w in workers:
        helpers.assert_weights_close(
            w.result["adam"]["optimizer"],
            [v.numpy() for v in reference.optimizer.variables],
        )


@pytest.mark.multi_worker
@pytest.mark.timeout(1200)
def test_backup_restores_unsharded_on_two_local_replicas(workers, out_dir):
    reference = cases._train(None, cases.OPTIMIZERS["adam"], epochs=2)
    backup = keras.callbacks.BackupAndRestore(
        str(out_dir / "backup"), delete_checkpoint=False
    )
    model = cases._train(
        kr.LocalReplicator(2),
        cases.OPTIMIZERS["adam"],
        epochs=2,
        callbacks=[backup],
    )
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())
