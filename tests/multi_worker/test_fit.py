"""model.fit / evaluate / predict over 2 workers x 2 CPU replicas."""

import numpy as np
import pytest

from tests import helpers
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
    tmp = reference["tmp"]
    for i in range(2):
        (tmp / f"tmpdir_{i}").mkdir()
    return harness.run_workers(
        WORKER,
        num_workers=2,
        replicas_per_worker=2,
        args=[str(reference["init"]), str(tmp / "out")],
        # Each worker's own TMPDIR, to see what it writes there.
        env_for=lambda i: {"TMPDIR": str(tmp / f"tmpdir_{i}")},
    )


@pytest.mark.multi_worker
@pytest.mark.timeout(300)
def test_fit_matches_single_process(workers, reference):
    for w in workers:
        got = w.result
        assert sorted(got["history"]) == sorted(reference["history"])
        for key, values in reference["history"].items():
            helpers.assert_close(
                got["history"][key], values, f"{key}, worker {w.index}"
            )
        for i, (a, e) in enumerate(
            zip(got["weights"], reference["weights"], strict=True)
        ):
            helpers.assert_close(a, e, f"weight {i}, worker {w.index}")


@pytest.fixture(scope="module")
def one_replica_workers(reference):
    # One CPU replica per process, the usual layout, as mpiexec's ranks.
    tmp = reference["tmp"]
    return harness.run_workers(
        WORKER,
        num_workers=2,
        replicas_per_worker=1,
        args=[str(reference["init"]), str(tmp / "out_one")],
        transport="mpi",
    )


@pytest.mark.multi_worker
@pytest.mark.timeout(300)
def test_one_replica_per_process_matches_single_process(
    one_replica_workers, reference
):
    test_fit_matches_single_process(one_replica_workers, reference)
    for w in one_replica_workers:
        # The process's batches come through a plain tf.data iterator, not
        # a MultiDeviceIterator (six traced functions per iterator).
        assert w.result["iterator"] == "OwnedIterator"


@pytest.mark.multi_worker
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["2x2", "2x1"])
def test_metrics_are_read_in_one_all_reduce_and_reset_in_none(
    workers, one_replica_workers, reference, layout
):
    runs = workers if layout == "2x2" else one_replica_workers
    evaluation = reference["evaluation"]
    for w in runs:
        got = w.result
        # Six sync-on-read sums (loss, accuracy, cross-entropy: a total and
        # a count each), in one all-reduce, not one each; a reset reads
        # none back.
        assert got["metric_variables"] == 6
        assert got["reduces_to_read"] == 1
        assert got["reduces_to_reset"] == 0
        # The metrics hold the last evaluate's: one device's values.
        assert sorted(got["metrics_result"]) == sorted(evaluation)
        for name, value in evaluation.items():
            helpers.assert_close(got["metrics_result"][name], value, name)
        assert all(v == 0 for v in got["reset_result"].values())
    if layout == "2x2":
        assert {w.result["iterator"] for w in runs} == {"OwnedIterator"}


@pytest.mark.multi_worker
@pytest.mark.timeout(300)
def test_only_the_first_build_pulls_a_batch(workers):
    # fit builds the compiled metrics from one pulled batch; its validation
    # runs and the later evaluate find everything built and skip the pull
    # (and its batch-sized all-reduce across workers).
    for w in workers:
        assert w.result["batch_pulls"] == 1


@pytest.mark.multi_worker
@pytest.mark.timeout(300)
def test_evaluate_and_predict_match_single_process(workers, reference):
    for w in workers:
        for key, value in reference["evaluation"].items():
            helpers.assert_close(w.result["evaluation"][key], value, key)
        helpers.assert_close(
            w.result["predictions"], reference["predictions"], "predictions"
        )


@pytest.mark.multi_worker
@pytest.mark.timeout(300)
def test_only_the_chief_writes_files(workers, reference):
    chief, other = workers
    out = reference["tmp"] / "out"
    names = sorted(
        str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()
    )
    assert "ckpt.weights.h5" in names
    assert "log.csv" in names
    assert "backup/latest.weights.h5" in names
    events = [n for n in names if ".tfevents." in n]
    # TensorBoard names event files after the writing process's pid.
    assert events and all(f".{chief.result['pid']}." in n for n in events)
    # CSV: one header and one row per epoch, not two writers' worth.
    rows = (out / "log.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + fit_reference.EPOCHS
    # The other worker's weight saves join the reads and write no file
    # (patches/chief_saves.py); its other files go to its temporary
    # directory, which is gone after fit.
    assert chief.result["tmp_during_fit"] == [[]] * fit_reference.EPOCHS
    during = other.result["tmp_during_fit"][-1]
    assert not any(n.endswith(".weights.h5") for n in during), during
    assert any(n.endswith("log.csv") for n in during), during
    assert other.result["tmp_after_fit"] == []
    # And the callbacks' own paths are put back.
    assert other.result["checkpoint_path_after_fit"] == str(
        out / "ckpt.weights.h5"
    )


@pytest.mark.multi_worker
@pytest.mark.timeout(300)
def test_fit_through_launcher_matches_single_process(reference):
    out = reference["tmp"] / "launched"
    proc, results = harness.run_launcher(
        WORKER, args=[str(reference["init"]), str(out)]
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "[worker 0]" in proc.stdout and "[worker 1]" in proc.stdout
    for got in results:
        for key, values in reference["history"].items():
            helpers.assert_close(got["history"][key], values, key)
        for i, (a, e) in enumerate(
            zip(got["weights"], reference["weights"], strict=True)
        ):
            helpers.assert_close(a, e, f"weight {i}")
