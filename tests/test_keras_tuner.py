"""keras-tuner's `RandomSearch` under a replicator gives one device's trials.

`distribution_strategy=kr.LocalReplicator(2)`, as keras-tuner's guide
passes a `MirroredStrategy`: the same hyperparameters, and each trial's
validation accuracy and loss equal one device's (1e-5). Under
`keras-replicator launch --workers 2` it is
tests/multi_worker/test_keras_tuner.py's.
"""

import numpy as np
import pytest

import keras_replicator as kr
from tests import keras_tuner_search

pytest.importorskip("keras_tuner")


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return keras_tuner_search.search(tmp_path_factory.mktemp("one"))


def assert_same_trials(trials, one_device):
    assert list(trials) == list(one_device)
    assert len(trials) == keras_tuner_search.MAX_TRIALS
    for trial_id, (hp, accuracy, loss) in trials.items():
        hp0, accuracy0, loss0 = one_device[trial_id]
        assert hp == hp0, trial_id
        np.testing.assert_allclose(accuracy, accuracy0, atol=1e-6)
        np.testing.assert_allclose(loss, loss0, rtol=1e-5)


def test_random_search_on_two_replicas_gives_one_devices_trials(
    one_device, tmp_path
):
    trials = keras_tuner_search.search(tmp_path, kr.LocalReplicator(2))
    assert_same_trials(trials, one_device)
