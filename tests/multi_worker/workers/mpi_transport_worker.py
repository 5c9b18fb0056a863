"""Worker of test_mpi_transport.py, under `mpiexec -n 2`: one replica each.

argv: <mode> <initial weights .npz> <output dir>. Modes:

- `fit`: `kr.auto()` finds the MPI launch; `fit_reference`'s `fit`,
  `evaluate` and `predict` (TensorFlow's tutorial convention: Keras' own
  loop, unchanged).
- `model_across`: `keras.distribution.initialize()`, then
  `distribution_reference`'s ModelParallel over a (1, 2) mesh: its model
  axis spans the two processes, so every product gathers or sums rows
  between them.

Writes `<output dir>/rank<r>.json`: the transport the replicator reports,
how many MPI exchanges this rank made (`mpi_collectives`' own counter, a
library function wrapped here, not TensorFlow), the history, evaluation,
predictions and weights.
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

report = {}
init = list(np.load(init_path).values())
if mode == "fit":
    from tests.multi_worker import fit_reference

    with replicator.scope():
        model = fit_reference.build()
    model.set_weights(init)
    history, evaluation, predictions = fit_reference.train(model)
    report.update(evaluation=evaluation, predictions=predictions.tolist())
else:
    from tests.multi_worker import distribution_reference as reference

    keras.distribution.set_distribution(reference.distribution(mode))
    model = reference.build()
    model.set_weights(init)
    history = reference.train(model)
    replicator = tf.distribute.get_strategy()
report.update(
    transport=replicator.transport,
    replicas=replicator.num_replicas_in_sync,
    calls=calls,
    history=history,
    weights=[w.tolist() for w in model.get_weights()],
)
with open(os.path.join(out_dir, f"rank{kr.process_index()}.json"), "w") as f:
    json.dump(report, f)
