"""The sharder over 2 workers x 2 CPU replicas: exactly-once, equal steps."""

import numpy as np
import pytest
import tensorflow as tf

from tests.multi_worker import harness
from tests.multi_worker import sharding_common as common

WORKER = harness.REPO_ROOT / "tests/multi_worker/workers/sharding_worker.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharding")
    common.write_records(str(tmp / "seven"), common.NUM_FILES)
    common.write_records(str(tmp / "one"), 1)
    model = common.model()
    init = tmp / "init.npz"
    np.savez(init, *model.get_weights())
    expected = {}
    for name in ("seven", "one"):
        x, y = zip(
            *common.records(str(tmp / name)).map(common.parse), strict=True
        )
        expected[name] = model.evaluate(
            tf.stack(x),
            tf.stack(y),
            batch_size=7000,
            verbose=0,
            return_dict=True,
        )
    results = harness.run_workers(
        WORKER,
        num_workers=2,
        replicas_per_worker=2,
        timeout=240,
        args=[str(init), str(tmp / "seven"), str(tmp / "one")],
    )
    return [r.result for r in results], expected


@pytest.mark.multi_worker
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "files"), [("seven", 7), ("one", 1)])
def test_eval_sees_every_record_once(run, name, files):
    results, expected = run
    n = files * common.RECORDS_PER_FILE
    assert sum(r[name]["count"] for r in results) == n
    assert sum(r[name]["sum"] for r in results) == n * (n - 1) // 2
    assert results[0][name]["steps"] == results[1][name]["steps"]
    for r in results:
        got = r[name]["evaluate"]
        for metric in ("accuracy", "loss"):
            assert got[metric] == pytest.approx(
                expected[name][metric], abs=1e-5
            ), metric


@pytest.mark.multi_worker
@pytest.mark.timeout(300)
def test_tfds_eval_sees_every_example_once(run):
    results, _ = run
    assert sum(r["tfds"]["count"] for r in results) == common.TFDS_EXAMPLES
    assert results[0]["tfds"]["steps"] == results[1]["tfds"]["steps"]


@pytest.mark.multi_worker
@pytest.mark.timeout(300)
def test_uneven_shards_train_equal_steps(run):
    results, _ = run
    # 4,000 and 3,000 records: both workers run 7,000 // 64 steps.
    assert [r["train_steps"] for r in results] == [7000 // 64] * 2
