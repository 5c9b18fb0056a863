"""Drop-in rows and a Loss object in `step_fn` on 2 workers x 2 replicas.

One run of `workers/drop_in_worker.py` covers every row of
`tests/drop_in_cases.py`; each is compared with one device in this process.
"""

import numpy as np
import pytest

from tests import drop_in_cases as cases
from tests import test_drop_in
from tests.multi_worker import harness

WORKER = harness.REPO_ROOT / "tests/multi_worker/workers/drop_in_worker.py"


@pytest.fixture(scope="module")
def workers():
    return harness.run_workers(
        WORKER, num_workers=2, replicas_per_worker=2, timeout=900
    )


@pytest.mark.multi_worker
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", sorted(cases.ROWS))
def test_row_matches_one_device(workers, name):
    expected = test_drop_in._one_device(name)
    for w in workers:
        actual = w.result[name]
        assert "error" not in actual, actual.get("error")
        cases.assert_same(
            actual, expected, name, label=f"{name} (worker {w.index})"
        )


@pytest.mark.multi_worker
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("wrap", ["wrapped", "plain"])
def test_loss_object_in_step_fn_matches_one_device(workers, wrap):
    weights, losses = test_drop_in.one_device_loss_object()
    for w in workers:
        actual = w.result[f"loss_object_{wrap}"]
        for a, e in zip(actual["weights"], weights, strict=True):
            np.testing.assert_allclose(np.asarray(a), e, atol=1e-5, rtol=0)
        np.testing.assert_allclose(actual["losses"], losses, rtol=1e-5)
