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
harness.write_result(
    {
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
