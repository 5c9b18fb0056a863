"""Worker of test_fit.py: fit, evaluate and predict under a replicator.

argv: <initial weights .npz> <output dir>. Builds the model of
`fit_reference`, sets the given initial weights, trains with every
file-writing callback, and reports numbers and where files went.
"""

import os
import sys
import tempfile

import keras_replicator as kr

# Create the replicator first: it splits the CPU before TF starts.
replicator = kr.MultiWorkerReplicator()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras.src.backend.tensorflow import trainer as tf_trainer  # noqa: E402

from tests.multi_worker import fit_reference  # noqa: E402
from tests.multi_worker import harness  # noqa: E402

init_path, out_dir = sys.argv[1], sys.argv[2]
tmp_root = tempfile.gettempdir()
seen_in_tmp = []


def _files_in_tmp():
    return sorted(
        os.path.relpath(os.path.join(d, f), tmp_root)
        for d, _, files in os.walk(tmp_root)
        for f in files
    )


# Count the calls that pull a batch only to build the model (see keras_compat:
# it pulls one right before each `_symbolic_build`).
batch_pulls = []
_stock_build = tf_trainer.TensorFlowTrainer._symbolic_build


def _counting_build(*args, **kwargs):
    batch_pulls.append(1)
    return _stock_build(*args, **kwargs)


tf_trainer.TensorFlowTrainer._symbolic_build = _counting_build

with replicator.scope():
    model = fit_reference.build()
model.set_weights(list(np.load(init_path).values()))
callbacks = fit_reference.file_callbacks(out_dir)
spy = keras.callbacks.LambdaCallback(
    on_epoch_end=lambda epoch, logs: seen_in_tmp.append(_files_in_tmp())
)
history, evaluation, predictions = fit_reference.train(
    model, callbacks=[*callbacks, spy]
)
# What reading and resetting the metrics costs across workers: calls of the
# replicator's `reduce` (each an all-reduce), and the iterator a dataset gets.
reduces = []
_stock_reduce = replicator.reduce


def _counting_reduce(*args, **kwargs):
    reduces.append(1)
    return _stock_reduce(*args, **kwargs)


replicator.reduce = _counting_reduce
with replicator.scope():
    metrics_result = {
        k: float(v) for k, v in model.get_metrics_result().items()
    }
    reduces_to_read = len(reduces)
    model.reset_metrics()
    reduces_to_reset = len(reduces) - reduces_to_read
    replicator.reduce = _stock_reduce
    reset_result = {k: float(v) for k, v in model.get_metrics_result().items()}
dataset = replicator.experimental_distribute_dataset(
    tf.data.Dataset.range(16).batch(8)
)
harness.write_result(
    {
        "metrics_result": metrics_result,
        "metric_variables": sum(len(m.variables) for m in model.metrics),
        "reduces_to_read": reduces_to_read,
        "reduces_to_reset": reduces_to_reset,
        "reset_result": reset_result,
        "iterator": type(iter(dataset)._iterators[0]._iterator).__name__,
        "history": history,
        "evaluation": evaluation,
        "predictions": predictions,
        "weights": model.get_weights(),
        "is_chief": replicator.is_chief,
        "pid": os.getpid(),
        "tmp_during_fit": seen_in_tmp,
        "tmp_after_fit": _files_in_tmp(),
        "checkpoint_path_after_fit": callbacks[0].filepath,
        "batch_pulls": len(batch_pulls),
    }
)
