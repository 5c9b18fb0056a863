"""examples/gemma_model_parallel.py under `keras-replicator launch`.

The example is a plain keras.distribution script: `initialize()` with no
arguments, keras-hub's own `GemmaBackbone.get_layout_map(mesh)`, `fit` on
global batches, a `ModelCheckpoint`. Launched as a user launches it
(`keras-replicator launch --workers 2 --replicas-per-worker 2 -- python
examples/gemma_model_parallel.py`):

- `ModelParallel` on a (batch 2 across the workers) x (model 2 inside each)
  mesh: weights and logged numbers equal one device (1e-4), and both
  workers report the same blocks for the embedding table;
- `DataParallel` over the 2 x 2 devices: one device's numbers (1e-5).

The chief alone writes the checkpoint, with whole values: it loads into an
unsharded model as the final weights.
"""

import json
import runpy

import numpy as np
import pytest

from tests import helpers
from tests.multi_worker import harness

pytestmark = [pytest.mark.multi_worker, pytest.mark.timeout(600)]

SCRIPT = harness.REPO_ROOT / "examples/gemma_model_parallel.py"
DEVICES = [f"/job:worker/task:{t}/cpu:{i}" for t in range(2) for i in range(2)]


@pytest.fixture(scope="module")
def example():
    return runpy.run_path(str(SCRIPT))


@pytest.fixture(scope="module")
def one_device(example, tmp_path_factory):
    history, weights = example["main"](
        ["--distribution", "none", "--out", str(tmp_path_factory.mktemp("one"))]
    )
    return history, weights


def _launch(kind, out):
    proc, _ = harness.run_launcher(
        SCRIPT, ["--distribution", kind, "--out", str(out)], 2, 2, timeout=400
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    reports = []
    for process in (0, 1):
        report = json.loads((out / f"process{process}.json").read_text())
        weights = np.load(out / f"process{process}.npz")
        report["weights"] = list(weights.values())
        reports.append(report)
    return proc.stdout, reports


def _assert_one_device(reports, one_device, rtol, atol):
    history, weights = one_device
    for process, report in enumerate(reports):
        assert report["devices"] == DEVICES
        assert report["strategy"] == "ProcessReplicator"
        assert sorted(report["history"]) == sorted(history)
        for key, values in history.items():
            np.testing.assert_allclose(
                report["history"][key],
                values,
                rtol=rtol,
                atol=atol,
                err_msg=f"process {process} {key}",
            )
        pairs = zip(report["weights"], weights, strict=True)
        for i, (a, e) in enumerate(pairs):
            np.testing.assert_allclose(
                a, e, rtol=rtol, atol=atol, err_msg=f"process {process} w{i}"
            )


def _assert_checkpoint(example, out, weights):
    """The chief's checkpoint: whole values, loadable on one device."""
    model = example["build_model"]()
    model.optimizer.build(model.trainable_variables)  # the file has its slots
    model.load_weights(out / "model.weights.h5")
    for i, (a, e) in enumerate(zip(model.get_weights(), weights, strict=True)):
        helpers.assert_close(a, e, f"checkpoint weight {i}", atol=0)
    assert sorted(p.name for p in out.iterdir()) == [
        "model.weights.h5",
        "process0.json",
        "process0.npz",
        "process1.json",
        "process1.npz",
    ]


def test_model_parallel_across_two_launched_workers_is_one_device(
    example, one_device, tmp_path
):
    stdout, reports = _launch("model_parallel", tmp_path)
    _assert_one_device(reports, one_device, rtol=1e-4, atol=1e-6)
    # (64, 16): vocabulary over "model" (2), hidden size over "batch" (2).
    shapes = [r["embedding_shard_shapes"] for r in reports]
    assert shapes[0] == shapes[1] == {d: [32, 8] for d in DEVICES}
    # The chief's log lines: one per epoch, and the summary.
    assert stdout.count("[worker 0] Epoch 2/2") == 1, stdout[-3000:]
    assert "[worker 1] Epoch" not in stdout
    _assert_checkpoint(example, tmp_path, reports[0]["weights"])


def test_data_parallel_across_two_launched_workers_is_one_device(
    example, one_device, tmp_path
):
    _, reports = _launch("data_parallel", tmp_path)
    _assert_one_device(reports, one_device, rtol=0, atol=1e-5)
    whole = {d: [64, 16] for d in DEVICES}
    for report in reports:
        assert report["embedding_shard_shapes"] == whole
    _assert_checkpoint(example, tmp_path, reports[0]["weights"])
