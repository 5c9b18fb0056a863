"""model.fit / evaluate / predict over 2 workers x 2 CPU replicas."""

import numpy as np
import pytest

from tests.multi_worker import fit_reference
from tests.multi_worker import harness

WORKER = harness.REPO_ROOT / "tests/multi_worker/workers/fit_worker.py"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fit")
    model = fit_reference.build()
    init = tmp / "init.npz"
    np.savez(init, *model.get_weights())
    history, evaluation, predictions = fit_reference.train(model)
    return {
        "init": init,
        "tmp": tmp,
        "history": history,
        "evaluation": evaluation,
        "predictions": predictions,
        "weights": model.get_weights(),
    }


@pytest.fixture(scope="module")
def workers(reference):
    return harness.run_workers(
        WORKER,
        num_workers=2,
        replicas_per_worker=2,
        args=[str(reference["init"]), str(reference["tmp"] / "out")],
    )


def _assert_close(actual, expected, what):
    np.testing.assert_allclose(
        np.asarray(actual),
        np.asarray(expected),
        atol=1e-5,
        rtol=0,
        err_msg=what,
    )


@pytest.mark.multi_worker
@pytest.mark.timeout(300)
def test_fit_matches_single_process(workers, reference):
    for w in workers:
        got = w.result
        assert sorted(got["history"]) == sorted(reference["history"])
        for key, values in reference["history"].items():
            _assert_close(
                got["history"][key], values, f"{key}, worker {w.index}"
            )
        for i, (a, e) in enumerate(
            zip(got["weights"], reference["weights"], strict=True)
        ):
            _assert_close(a, e, f"weight {i}, worker {w.index}")


@pytest.mark.multi_worker
@pytest.mark.timeout(300)
def test_evaluate_and_predict_match_single_process(workers, reference):
    for w in workers:
        for key, value in reference["evaluation"].items():
            _assert_close(w.result["evaluation"][key], value, key)
        _assert_close(
            w.result["predictions"], reference["predictions"], "predictions"
        )
