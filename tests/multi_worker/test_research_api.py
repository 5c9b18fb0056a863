"""Primitives and replicate + wrap_optimizer over 2 workers x 2 replicas."""

import numpy as np
import pytest

from tests import test_optimizer as reference
from tests.helpers import assert_weights_close
from tests.multi_worker import harness

WORKER = harness.REPO_ROOT / "tests/multi_worker/workers/research_worker.py"


@pytest.fixture(scope="module")
def workers():
    return harness.run_workers(
        WORKER, num_workers=2, replicas_per_worker=2, timeout=240
    )


@pytest.mark.multi_worker
@pytest.mark.timeout(300)
def test_primitives_span_workers(workers):
    for w in workers:
        local = w.result["primitives"]
        assert [r["id"] for r in local] == [2 * w.index, 2 * w.index + 1]
        for r in local:
            assert r["gather"] == [0, 1, 2, 3]
            assert r["broadcast"] == 21.0
            assert r["num"] == 4
            assert r["sum"] == {"a": [6.0, -6.0], "b": {"c": 14.0}}
            assert r["mean"] == {"a": [1.5, -1.5], "b": {"c": 3.5}}
            assert r["max"] == {"a": [3.0, 0.0], "b": {"c": 9.0}}
            assert r["min"] == {"a": [0.0, -3.0], "b": {"c": 0.0}}


@pytest.mark.multi_worker
@pytest.mark.timeout(300)
def test_wrap_optimizer_matches_one_device(workers):
    expected = reference._single_device(16, 6, reference._adam)
    for w in workers:
        actual = [np.asarray(a) for a in w.result["plain"]["weights"]]
        assert_weights_close(actual, expected)


@pytest.mark.multi_worker
@pytest.mark.timeout(300)
def test_accumulation_matches_twice_the_batch(workers):
    expected = reference._single_device(32, 3, reference._adam)
    for w in workers:
        actual = [np.asarray(a) for a in w.result["accumulated"]["weights"]]
        assert_weights_close(actual, expected)
