"""MultiWorkerReplicator basics over real worker processes."""

import pytest

from tests.multi_worker import harness

WORKER = """
import tensorflow as tf

import keras_replicator as kr
from tests.multi_worker import harness

first = kr.MultiWorkerReplicator()
one = first.reduce("SUM", first.run(lambda: tf.constant(1.0)), axis=None)
# A second replicator in the same process, with another replica count: its
# own collective keys keep the groups apart.
second = kr.MultiWorkerReplicator(replicas_per_worker=1)
other = second.reduce("SUM", second.run(lambda: tf.constant(1.0)), axis=None)
harness.write_result(
    {
        "sum": float(one),
        "sum_second": float(other),
        "num_replicas": first.num_replicas_in_sync,
        "replicas_per_worker": first.replicas_per_worker,
        "num_workers": first.num_workers,
        "worker_index": first.worker_index,
        "is_chief": first.is_chief,
    }
)
"""


@pytest.mark.multi_worker
@pytest.mark.timeout(300)
def test_replicas_span_workers_and_replicators_coexist():
    results = harness.run_workers(WORKER, num_workers=2, replicas_per_worker=2)
    got = [r.result for r in results]
    assert [g["sum"] for g in got] == [4.0, 4.0]
    assert [g["sum_second"] for g in got] == [2.0, 2.0]
    assert [g["num_replicas"] for g in got] == [4, 4]
    assert [g["replicas_per_worker"] for g in got] == [2, 2]
    assert [g["num_workers"] for g in got] == [2, 2]
    assert [g["worker_index"] for g in got] == [0, 1]
    assert [g["is_chief"] for g in got] == [True, False]
