"""Unmodified scripts under mpiexec (PyPI's mpich + mpi4py, on loopback)."""

import ast
import re
import time

import numpy as np
import pytest

from tests.multi_worker import fit_reference
from tests.multi_worker import harness

WORKERS = harness.REPO_ROOT / "tests/multi_worker/workers"


@pytest.mark.multi_worker
@pytest.mark.timeout(400)
def test_mpiexec_fit_under_auto_matches_single_process(tmp_path):
    model = fit_reference.build()
    init = tmp_path / "init.npz"
    np.savez(init, *model.get_weights())
    reference_history, _, _ = fit_reference.train(model)

    result = harness.mpiexec(
        WORKERS / "mpi_fit_worker.py",
        init,
        tmp_path,
        timeout=300,
        env={"KERAS_REPLICATOR_CPU_REPLICAS": "2"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # Two CPU replicas per process: MPI carries one, so gRPC, saying why.
    assert (
        "transport: grpc, as mpiexec started this job (PMI_RANK is set), "
        "but each process holds 2 replicas" in result.stderr
    ), result.stderr[-3000:]
    for rank in (0, 1):
        summary = (tmp_path / f"rank{rank}.txt").read_text()
        # 2 workers x 2 CPU replicas, found with no TF_CONFIG.
        assert summary.startswith("MultiWorkerReplicator 2 4 ")
        weights = list(np.load(tmp_path / f"rank{rank}.npz").values())
        for i, (a, e) in enumerate(
            zip(weights, model.get_weights(), strict=True)
        ):
            np.testing.assert_allclose(
                a, e, atol=1e-5, rtol=0, err_msg=f"weight {i}, rank {rank}"
            )
        losses = [
            float(v) for v in re.findall(r"[\d.]+", summary.split("[")[1])
        ]
        np.testing.assert_allclose(losses, reference_history["loss"], atol=1e-5)


@pytest.mark.multi_worker
@pytest.mark.timeout(300)
def test_rank_that_cannot_reach_its_peer_fails_within_the_timeout():
    start = time.monotonic()
    result = harness.mpiexec(WORKERS / "mpi_lost_rank.py", 10, timeout=240)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert "UNEXPECTED" not in result.stdout
    assert re.search(
        r"could not reach: worker:1 at 127\.0\.0\.1:\d+", result.stderr
    ), result.stderr[-3000:]
    assert "within 10 s" in result.stderr
    assert elapsed < 240


def test_the_mpi_script_contains_no_cluster_code():
    tree = ast.parse((WORKERS / "mpi_fit_worker.py").read_text())
    tree.body = tree.body[1:]  # drop the module docstring
    code = ast.unparse(tree)
    for word in ("TF_CONFIG", "PMI_RANK", "mpi4py", "MPI", "cluster", "port"):
        assert not re.search(rf"\b{word}\b", code), word


@pytest.mark.multi_worker
@pytest.mark.timeout(200)
def test_env_under_mpiexec_shows_the_mpi_cluster():
    result = harness.mpiexec(
        "-m", "keras_replicator._src.cli.main", "env", timeout=150
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert f"launcher: mpi: rank {rank} of 2" in result.stdout
    assert result.stdout.count("auto() picks: MultiWorkerReplicator") == 2
    assert result.stdout.count("transport: mpi, as mpiexec started") == 2
    assert re.search(r'"worker": \["127\.0\.0\.1:\d+", "127', result.stdout)
