"""BatchNormalization over 2 worker processes is one device's, no line added.

keras.io's convnet (tests/keras_io_convnet.py) fit by 2 workers of one
replica each, over gRPC and over MPI, with no callback: the first epoch's
loss and weights equal one device's (1e-5; the biases before a norm within
Adam's steps, as in tests/test_batch_statistics.py). With
`sync_batch_norm=False` each worker normalizes its own half: not one
device's.
"""

import keras
import pytest

from tests import keras_io_convnet
from tests.multi_worker import harness

pytestmark = pytest.mark.multi_worker

WORKER = (
    harness.REPO_ROOT / "tests/multi_worker/workers/batch_statistics_worker.py"
)


@pytest.fixture(scope="module")
def one_device():
    keras.distribution.set_distribution(None)
    return keras_io_convnet.train()


@pytest.fixture(scope="module")
def zero_gradients():
    return keras_io_convnet.zero_gradient_weights()


def _run(mode, transport):
    results = harness.run_workers(
        WORKER,
        num_workers=2,
        replicas_per_worker=1,
        timeout=300,
        args=[mode],
        transport=transport,
    )
    for r in results:
        assert r.result["transport"] == transport
    return [r.result for r in results]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("transport", ["grpc", "mpi"])
def test_keras_io_convnet_on_two_workers_is_one_devices(
    transport, one_device, zero_gradients
):
    for result in _run("sync", transport):
        keras_io_convnet.assert_one_devices(
            result["history"], result["weights"], one_device, zero_gradients
        )


@pytest.mark.timeout(400)
def test_sync_batch_norm_false_on_two_workers_is_per_worker(one_device):
    for result in _run("per_replica", "grpc"):
        assert keras_io_convnet.farthest(result["weights"], one_device) > 1e-3
