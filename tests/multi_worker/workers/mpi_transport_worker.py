"""Worker of test_mpi_transport.py, under `mpiexec -n 2`: one replica each.

argv: <mode> <initial weights .npz> <output dir>. Modes:

- `fit`: `kr.auto()` finds the MPI launch; `fit_reference`'s `fit`,
  `evaluate` and `predict` (TensorFlow's tutorial convention: Keras' own
  loop, unchanged).
- `distribution`: `keras.distribution.initialize()`, then
  `distribution_reference`'s model under ModelParallel over a (1, 2) mesh
  (its model axis spans the two processes, so every product gathers or
  sums rows between them), then again under DataParallel.

Writes `<output dir>/rank<r>.json`: per run, the transport the replicator
reports, how many MPI exchanges this rank made (`mpi_collectives`' own
functions, wrapped here to count; not TensorFlow), the history (and
evaluation and predictions) and the weights.
"""

import json
import os
import sys

mode, init_path, out_dir = sys.argv[1], sys.argv[2], sys.argv[3]

import keras_replicator as kr  # noqa: E402
from keras_replicator._src import mpi_collectives  # noqa: E402

calls = {"sum": 0, "gather": 0}
_sum, _gather = mpi_collectives._sum_arrays, mpi_collectives._gather_array


def _counted_sum(*args):
    calls["sum"] += 1
    return _sum(*args)


def _counted_gather(*args):
    calls["gather"] += 1
    return _gather(*args)


mpi_collectives._sum_arrays = _counted_sum
mpi_collectives._gather_array = _counted_gather

if mode == "fit":
    replicator = kr.auto()
else:
    import keras

    keras.distribution.initialize()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def _report(replicator, model, history, **extra):
    report = {
        "transport": replicator.transport,
        "replicas": replicator.num_replicas_in_sync,
        "calls": dict(calls),
        "history": history,
        "weights": [w.tolist() for w in model.get_weights()],
        **extra,
    }
    calls.update(sum=0, gather=0)
    return report


reports = {}
init = list(np.load(init_path).values())
if mode == "fit":
    from tests.multi_worker import fit_reference

    with replicator.scope():
        model = fit_reference.build()
    model.set_weights(init)
    history, evaluation, predictions = fit_reference.train(model)
    reports["fit"] = _report(
        replicator,
        model,
        history,
        evaluation=evaluation,
        predictions=predictions.tolist(),
    )
else:
    from tests.multi_worker import distribution_reference as reference

    for kind in ("model_across", "data_parallel"):
        keras.distribution.set_distribution(reference.distribution(kind))
        model = reference.build()
        model.set_weights(init)
        history = reference.train(model)
        replicator = tf.distribute.get_strategy()
        reports[kind] = _report(replicator, model, history)
        keras.distribution.set_distribution(None)
with open(os.path.join(out_dir, f"rank{kr.process_index()}.json"), "w") as f:
    json.dump(reports, f)
