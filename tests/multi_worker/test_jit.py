"""`jit_compile=True` under MultiWorkerReplicator: XLA per replica.

Stock Keras fails here both with two replicas per worker (one XLA cluster
for every local replica) and with one (the cluster holds the gradients'
collective all-reduce, which XLA does not compile on CPU); see
`per_replica_jit`. `build` and `train` run both in the workers and in the
single-process reference, so both run exactly the same Keras code. And
under `keras.distribution.ModelParallel` over 2 processes x 2 devices
(each device's share of the step compiled between the collectives), on a
(1, 4) mesh whose model axis spans the processes and on a (2, 2) one.
"""

import numpy as np
import pytest

from tests import helpers
from tests.multi_worker import distribution_reference
from tests.multi_worker import harness

GLOBAL_BATCH = 16

WORKER = """
import os

import keras_replicator as kr

# Create the replicator first: it splits the CPU before TF starts.
replicator = kr.MultiWorkerReplicator()

from tests.multi_worker import harness  # noqa: E402
from tests.multi_worker import test_jit  # noqa: E402

with replicator.scope():
    model = test_jit.build(int(os.environ["STEPS_PER_EXECUTION"]))
harness.write_result(test_jit.train(model))
"""


def build(steps_per_execution):
    import keras

    return helpers.jit_dense_model(
        keras.optimizers.SGD(0.1, momentum=0.9), steps_per_execution
    )


def train(model):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    history = model.fit(
        x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0
    )
    evaluation = model.evaluate(
        x, y, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True
    )
    predictions = model.predict(x, batch_size=GLOBAL_BATCH, verbose=0)
    return {
        "history": history.history,
        "evaluation": evaluation,
        "predictions": predictions,
        "weights": model.get_weights(),
    }


def _reference(steps_per_execution):
    import tensorflow as tf

    with tf.device("/cpu:0"):
        return train(build(steps_per_execution))


@pytest.mark.multi_worker
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "replicas_per_worker, steps_per_execution",
    [(2, 2), (1, 1)],
    ids=["2x2_spe2", "2x1_spe1"],
)
def test_jit_fit_evaluate_predict_match_single_process(
    replicas_per_worker, steps_per_execution
):
    expected = _reference(steps_per_execution)
    workers = harness.run_workers(
        WORKER,
        num_workers=2,
        replicas_per_worker=replicas_per_worker,
        timeout=240,
        env={"STEPS_PER_EXECUTION": str(steps_per_execution)},
    )
    for w in workers:
        got = w.result
        assert sorted(got["history"]) == sorted(expected["history"])
        for key, values in expected["history"].items():
            helpers.assert_close(
                got["history"][key], values, f"{key}, {w.index}"
            )
        for key, value in expected["evaluation"].items():
            helpers.assert_close(
                got["evaluation"][key], value, f"evaluate {key}"
            )
        helpers.assert_close(
            got["predictions"], expected["predictions"], "predict"
        )
        for i, (a, e) in enumerate(
            zip(got["weights"], expected["weights"], strict=True)
        ):
            helpers.assert_close(a, e, f"weight {i}, worker {w.index}")


MODEL_PARALLEL_WORKER = """
import sys

import keras
import numpy as np

import keras_replicator  # noqa: F401
from tests.multi_worker import distribution_reference as reference
from tests.multi_worker import harness

keras.distribution.initialize()
init = list(np.load(sys.argv[1]).values())
report = {}
for kind in ("model_across", "model_parallel"):
    keras.distribution.set_distribution(reference.distribution(kind))
    model = reference.build()
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=True,
    )
    model.set_weights(init)
    report[kind] = {
        "history": reference.train(model),
        "weights": model.get_weights(),
    }
harness.write_result(report)
"""


@pytest.mark.multi_worker
@pytest.mark.timeout(400)
def test_jit_under_model_parallel_over_processes_matches_one_device(tmp_path):
    expected = distribution_reference.one_device_run(tmp_path)
    workers = harness.run_workers(
        MODEL_PARALLEL_WORKER,
        num_workers=2,
        replicas_per_worker=2,
        timeout=300,
        args=[str(expected["init"])],
        # TensorFlow logs its first XLA compilation at this level.
        env={"TF_CPP_MIN_LOG_LEVEL": "0"},
    )
    for w in workers:
        assert "Compiled cluster using XLA" in w.output, w.index
        assert "compiles each device's share" in w.output, w.index
        for kind in ("model_across", "model_parallel"):
            distribution_reference.assert_matches(
                w.result[kind], expected, 1e-5, f"{kind}, worker {w.index}"
            )
