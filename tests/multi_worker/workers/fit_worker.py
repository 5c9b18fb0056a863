"""Worker of test_fit.py: fit, evaluate and predict under a replicator.

argv: <initial weights .npz> <output dir>. Builds the model of
`fit_reference`, sets the given initial weights, trains, and reports.
"""

import sys

import keras_replicator as kr

# Create the replicator first: it splits the CPU before TF starts.
replicator = kr.MultiWorkerReplicator()

import numpy as np  # noqa: E402

from tests.multi_worker import fit_reference  # noqa: E402
from tests.multi_worker import harness  # noqa: E402

init_path, out_dir = sys.argv[1], sys.argv[2]
with replicator.scope():
    model = fit_reference.build()
model.set_weights(list(np.load(init_path).values()))
history, evaluation, predictions = fit_reference.train(
    model, callbacks=fit_reference.file_callbacks(out_dir, replicator)
)
harness.write_result(
    {
        "history": history,
        "evaluation": evaluation,
        "predictions": predictions,
        "weights": model.get_weights(),
        "is_chief": replicator.is_chief,
    }
)
