"""keras-tuner's `RandomSearch` under `keras-replicator launch --workers 2`.

Each worker runs the search with `distribution_strategy=kr.auto()` (a
`MultiWorkerReplicator` of 2 workers x 1 replica): the trials, their
hyperparameters and validation numbers, equal one device's on both.
"""

import pytest

from tests import keras_tuner_search
from tests.multi_worker import harness
from tests.test_keras_tuner import assert_same_trials

pytestmark = pytest.mark.multi_worker

WORKER = harness.REPO_ROOT / "tests/multi_worker/workers/keras_tuner_worker.py"


@pytest.mark.timeout(400)
def test_random_search_under_launch_gives_one_devices_trials(tmp_path):
    pytest.importorskip("keras_tuner")
    one_device = keras_tuner_search.search(tmp_path / "one")
    proc, results = harness.run_launcher(
        WORKER,
        [str(tmp_path)],
        num_workers=2,
        replicas_per_worker=1,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    for worker, trials in enumerate(results):
        assert trials is not None, f"worker {worker}: {proc.stdout[-3000:]}"
        trials = {k: tuple(v) for k, v in trials.items()}
        assert_same_trials(trials, one_device)
