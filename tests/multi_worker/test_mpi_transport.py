"""The MPI transport: unmodified scripts under `mpiexec -n 2`, one replica each.

The ranks' collectives go over mpi4py (PyPI's mpich), not TensorFlow's gRPC
ring, and the numbers are one device's: `fit`, `evaluate` and `predict`
under `kr.auto()`, and `keras.distribution`'s ModelParallel with its model
axis across the two processes (every product gathers or sums between
them). The worker counts the MPI exchanges each rank made, so a run that
fell back to gRPC fails here. The choice rules themselves are
tests/test_transport.py's; the faults (a killed rank, a hang, SIGTERM)
are below.
"""

import json
import re

import numpy as np
import pytest

from tests import helpers
from tests.multi_worker import distribution_reference
from tests.multi_worker import fit_reference
from tests.multi_worker import harness

pytestmark = pytest.mark.multi_worker

WORKER = (
    harness.REPO_ROOT / "tests/multi_worker/workers/mpi_transport_worker.py"
)
# One replica per process: what MPI carries.
ONE_REPLICA = {"KERAS_REPLICATOR_CPU_REPLICAS": "1"}


def _run(mode, init, out_dir, timeout=240):
    result = harness.mpiexec(
        WORKER, mode, init, out_dir, timeout=timeout, env=ONE_REPLICA
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # The chief's first line says which transport, and why.
    assert re.search(
        r"keras-replicator transport: mpi, as mpiexec started this job "
        r"\(PMI_RANK is set\) and mpi4py imports",
        result.stderr,
    ), result.stderr[-3000:]
    assert result.stderr.count("keras-replicator transport:") == 1
    reports = [
        json.loads((out_dir / f"rank{rank}.json").read_text())
        for rank in (0, 1)
    ]
    for runs in reports:
        for report in runs.values():
            assert report["transport"] == "mpi"
            assert report["replicas"] == 2
    return reports


@pytest.mark.timeout(400)
def test_fit_evaluate_predict_over_mpi_are_one_devices(tmp_path):
    model = fit_reference.build()
    init = tmp_path / "init.npz"
    np.savez(init, *model.get_weights())
    history, evaluation, predictions = fit_reference.train(model)

    for rank, runs in enumerate(_run("fit", init, tmp_path)):
        report, what = runs["fit"], f"rank {rank}"
        # Every step's gradients and logs went over MPI.
        steps = fit_reference.EPOCHS * 64 // fit_reference.GLOBAL_BATCH
        assert report["calls"]["sum"] >= steps, report["calls"]
        for key, values in history.items():
            helpers.assert_close(
                report["history"][key], values, f"{what} {key}"
            )
        for key, value in evaluation.items():
            helpers.assert_close(
                report["evaluation"][key], value, f"{what} eval {key}"
            )
        helpers.assert_close(
            report["predictions"], predictions, f"{what} predict"
        )
        for i, (a, e) in enumerate(
            zip(report["weights"], model.get_weights(), strict=True)
        ):
            helpers.assert_close(a, e, f"{what} weight {i}")


@pytest.mark.timeout(400)
def test_keras_distribution_over_mpi_is_one_device(tmp_path):
    reference = distribution_reference.one_device_run(tmp_path)
    runs = _run("distribution", reference["init"], tmp_path)
    for rank, report in enumerate(runs):
        # ModelParallel with its model axis across the processes: the
        # sharded kernels' products gathered rows over MPI.
        model_parallel = report["model_across"]
        assert model_parallel["calls"]["gather"] > 0, model_parallel["calls"]
        distribution_reference.assert_matches(
            model_parallel, reference, 1e-5, f"ModelParallel, rank {rank}"
        )
        data_parallel = report["data_parallel"]
        assert data_parallel["calls"]["sum"] > 0, data_parallel["calls"]
        distribution_reference.assert_matches(
            data_parallel, reference, 1e-5, f"DataParallel, rank {rank}"
        )
