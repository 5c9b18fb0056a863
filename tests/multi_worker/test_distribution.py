"""keras.distribution over 2 worker processes x 2 CPU replicas each.

`keras.distribution.initialize()` (from TF_CONFIG on one worker, from
Keras' `KERAS_DISTRIBUTION_*` variables on the other), then `ModelParallel`
on a (batch 2 across workers) x (model 2 inside a worker) mesh fed by our
sharder, on a (1, 4) mesh whose model axis spans the workers, and on data
of unknown length (a `filter`), against one device; and a model with
`Dropout` and `BatchNormalization`, whose masks and moments are the global
batch's across the processes; and `mixed_bfloat16` with the model axis
across the processes. One process group for every check. The
launched `DataParallel` / `ModelParallel` script is
test_distribution_gemma.py's; `initialize()` under mpiexec and Slurm is
test_distribution_launchers.py's, under `kr.launch` from a notebook
test_notebook_launch.py's.
"""

import numpy as np
import pytest

from tests.multi_worker import distribution_reference
from tests.multi_worker import harness

WORKER = harness.REPO_ROOT / "tests/multi_worker/workers/distribution_worker.py"
DEVICES = [f"/job:worker/task:{t}/cpu:{i}" for t in range(2) for i in range(2)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return distribution_reference.one_device_run(
        tmp_path_factory.mktemp("distribution")
    )


@pytest.fixture(scope="module")
def unknown_length_reference(tmp_path_factory):
    return distribution_reference.one_device_run(
        tmp_path_factory.mktemp("unknown_length"), known_length=False
    )


@pytest.fixture(scope="module")
def batch_statistics_reference(tmp_path_factory):
    return distribution_reference.one_device_run(
        tmp_path_factory.mktemp("batch_statistics"),
        make=distribution_reference.build_batch_statistics,
    )


@pytest.fixture(scope="module")
def mixed_reference(tmp_path_factory):
    return distribution_reference.one_device_run(
        tmp_path_factory.mktemp("mixed"),
        make=distribution_reference.build_mixed,
        policy=distribution_reference.MIXED,
        static=True,
    )


@pytest.fixture(scope="module")
def workers(reference, batch_statistics_reference, mixed_reference):
    return harness.run_workers(
        WORKER,
        num_workers=2,
        replicas_per_worker=2,
        timeout=300,
        args=[
            str(reference["init"]),
            str(batch_statistics_reference["init"]),
            str(mixed_reference["init"]),
        ],
    )


@pytest.mark.multi_worker
@pytest.mark.timeout(420)
def test_initialize_lists_every_workers_devices(workers):
    for w in workers:
        assert w.result["num_processes"] == 2
        assert w.result["process_id"] == w.index
        # The public answers: Keras' own after `initialize()`, and before
        # it, from TF_CONFIG (worker 1; worker 0 has Keras' variables).
        assert w.result["this_process"] == [w.index, 2, w.index == 0]
        assert w.result["devices"] == DEVICES
        assert (
            "The device mesh has 8 devices but only 4"
            in (w.result["too_large_mesh"])
        )
    (second,) = [w for w in workers if w.index == 1]
    assert second.result["this_process_before_initialize"] == [1, 2, False]


@pytest.mark.multi_worker
@pytest.mark.timeout(420)
def test_model_parallel_fed_by_our_sharder_matches_one_device(
    workers, reference
):
    for w in workers:
        got = w.result["sharder"]
        assert got["replicator"] == "ProcessReplicator"
        # MultiWorkerReplicator's features: chief-only files, preemption at
        # the step, the hang watchdog, Keras' multi-worker fixes.
        assert {
            "chief_only",
            "preemption",
            "hang_watchdog",
            "keras_compat",
        } <= set(got["patches"]), got["patches"]
        distribution_reference.assert_matches(
            got, reference, 1e-4, f"worker {w.index}"
        )
    shapes = [w.result["sharder"]["shard_shapes"] for w in workers]
    assert shapes[0] == shapes[1]
    kernel = next(v for k, v in shapes[0].items() if k.endswith("d1/kernel"))
    assert kernel == {d: [12, 8] for d in DEVICES}


@pytest.mark.multi_worker
@pytest.mark.timeout(420)
def test_dropout_masks_and_batch_moments_are_global_across_workers(
    workers, batch_statistics_reference
):
    # Each process's replicas draw their rows of one device's mask and
    # normalise with the global batch's moments (`docs/exact.md`), so the
    # numbers are one device's, moving statistics included.
    for w in workers:
        distribution_reference.assert_matches(
            w.result["batch_statistics"],
            batch_statistics_reference,
            1e-4,
            f"worker {w.index}",
        )


@pytest.mark.multi_worker
@pytest.mark.timeout(420)
def test_a_model_axis_across_workers_matches_one_device(workers, reference):
    for w in workers:
        got = w.result["model_across"]
        distribution_reference.assert_matches(
            got, reference, 1e-4, f"worker {w.index}"
        )
        kernel = next(
            v for k, v in got["shard_shapes"].items() if k.endswith("d1/kernel")
        )
        assert kernel == {d: [12, 4] for d in DEVICES}
        # Reading sharded values again (`save_weights`, `get_weights`)
        # traces nothing new.
        assert got["functions_started_by_reads"] == 0


@pytest.mark.multi_worker
@pytest.mark.timeout(420)
# Keras says so at each epoch's end, on one device too.
@pytest.mark.filterwarnings("ignore:Your input ran out of data")
def test_data_of_unknown_length_matches_one_device(
    workers, unknown_length_reference
):
    # Keras finds each epoch's end by running out of data, on every worker.
    for w in workers:
        distribution_reference.assert_matches(
            w.result["unknown_length"],
            unknown_length_reference,
            1e-5,
            f"worker {w.index}",
        )


@pytest.mark.multi_worker
@pytest.mark.timeout(420)
def test_mixed_precision_rows_cross_processes_with_one_devices_losses(
    workers, mixed_reference
):
    # bfloat16 products whose rows move between the processes (chosen in
    # the graph: Keras' per-process cut loses the batch's static size; the
    # worker prints when the rows path runs). Each replica's 16-bit
    # rounding makes no replicated run one device's to float32 tolerance;
    # the losses are one device's to 1e-2.
    for w in workers:
        got = w.result["mixed"]
        assert got["compute_dtype"] == "bfloat16"
        assert "False" not in got["paths"], got["paths"]
        assert "mixed: rows moved" in w.output, w.output[-3000:]
        for key in ("loss",):
            np.testing.assert_allclose(
                got["history"][key],
                mixed_reference["history"][key],
                rtol=1e-2,
                err_msg=f"worker {w.index}",
            )
