"""Cross-replica BN and MetricReduction over 2 workers x 2 replicas."""

import keras
import numpy as np
import pytest

from tests.multi_worker import callbacks_reference as worker
from tests.multi_worker import harness

WORKER = harness.REPO_ROOT / "tests/multi_worker/workers/callbacks_worker.py"


@pytest.fixture(scope="module")
def results():
    return harness.run_workers(
        WORKER, num_workers=2, replicas_per_worker=2, timeout=240
    )


@pytest.mark.multi_worker
@pytest.mark.timeout(300)
def test_bn_moving_stats_match_single_device_uneven_split(results):
    x = worker.global_bn_batch()
    reference = keras.layers.BatchNormalization(momentum=0.5)
    reference.build(x.shape)
    reference(x, training=True)
    for r in results:
        for name in ("moving_mean", "moving_variance"):
            want = getattr(reference, name).numpy()
            for value in r.result["bn"][name]:
                np.testing.assert_allclose(value, want, atol=1e-5)


@pytest.mark.multi_worker
@pytest.mark.timeout(300)
def test_epoch_accuracy_is_exact_over_union_of_uneven_shards(results):
    x, y = worker.classification_data()
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(3, activation="softmax")]
    )
    model.set_weights(worker.initial_weights())
    exact = float(np.mean(np.argmax(model.predict(x, verbose=0), 1) == y))
    histories = [r.result["fit"]["history"] for r in results]
    for history in histories:
        assert history["accuracy"][0] == pytest.approx(exact, abs=1e-6)
        # The last batch log is the running value over the whole epoch.
        last = results[0].result["fit"]["batches"][-1]
        assert last["accuracy"] == pytest.approx(exact, abs=1e-6)
    # Identical on both workers, including the value a callback added,
    # averaged by each worker's example count.
    assert histories[0] == histories[1]
    weighted = np.dot(worker.WORKER_VALUES, worker.SHARDS) / sum(worker.SHARDS)
    assert histories[0]["worker_value"][0] == pytest.approx(weighted)
    assert (
        results[0].result["fit"]["batches"]
        == (results[1].result["fit"]["batches"])
    )
