"""A ragged last global batch under keras.distribution over processes.

1797 digits at a global batch of 64 end with a batch of 5 rows, which
does not divide by 2 or 3 processes (nor 64 by 3). Each process takes the
rows a replicator gives its devices, possibly none, and `fit` and
`evaluate` under `DataParallel` and `ModelParallel` give one device's
losses, metrics and weights. One process group per process count: 2
processes of 2 devices (5 rows: 2, 2 | 1, 0) and 3 of 1 (64 rows: 22, 22,
20; 5 rows: 2, 2, 1); a last batch of 1 row leaves every process but the
first none. A dataset no process can split is refused with one line.
"""

import pytest

from tests import helpers
from tests.multi_worker import harness
from tests.multi_worker import ragged_reference

WORKER = harness.REPO_ROOT / "tests/multi_worker/workers/ragged_worker.py"
KINDS = ("data_parallel", "model_parallel")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return ragged_reference.one_device_run(tmp_path_factory.mktemp("ragged"))


def _assert_one_device(got, expected, what):
    assert sorted(got["history"]) == sorted(expected["history"]), what
    for key, values in expected["history"].items():
        helpers.assert_close(
            got["history"][key], values, f"{what} {key}", atol=1e-5
        )
    assert sorted(got["evaluate"]) == sorted(expected["evaluate"]), what
    for key, value in expected["evaluate"].items():
        helpers.assert_close(
            got["evaluate"][key], value, f"{what} evaluate {key}", atol=1e-5
        )
    for i, (a, e) in enumerate(
        zip(got["weights"], expected["weights"], strict=True)
    ):
        helpers.assert_close(a, e, f"{what} weight {i}", atol=1e-5)


@pytest.mark.multi_worker
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "processes, devices", [(2, 2), (3, 1)], ids=["2x2", "3x1"]
)
def test_ragged_last_batch_over_processes_matches_one_device(
    reference, processes, devices
):
    workers = harness.run_workers(
        WORKER,
        num_workers=processes,
        replicas_per_worker=devices,
        timeout=480,
        args=[str(reference["init"])],
    )
    for w in workers:
        for kind in KINDS:
            for name in ragged_reference.SIZES:
                _assert_one_device(
                    w.result[f"{kind}/{name}"],
                    reference[name],
                    f"{kind} {name} on {processes}x{devices}, process "
                    f"{w.index}",
                )
        # Refused before any step, in one line naming the sizes.
        assert "batch sizes=[32, 64]" in w.result["error"], w.result
        assert "\n" not in w.result["error"]
        assert "InvalidArgumentError" not in w.output
