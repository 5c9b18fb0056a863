"""Worker of test_distribution_ragged.py: ragged last batches.

argv: <initial weights .npz>. Under `DataParallel` and `ModelParallel`
over every process's devices, fits and evaluates each dataset of
`ragged_reference` (a last batch of 5 rows, and of 1), then feeds a
dataset no process can split (its tensors disagree on the batch size)
and reports the error.
"""

import sys

import keras
import numpy as np
import tensorflow as tf

import keras_replicator  # noqa: F401
from tests.multi_worker import harness
from tests.multi_worker import ragged_reference as reference

keras.distribution.initialize()
init = list(np.load(sys.argv[1]).values())
report = {}
for kind in ("data_parallel", "model_parallel"):
    keras.distribution.set_distribution(reference.distribution(kind))
    for name in reference.SIZES:
        model = reference.build()
        model.set_weights(init)
        report[f"{kind}/{name}"] = reference.run(model, name)
mismatched = tf.data.Dataset.zip(
    (
        tf.data.Dataset.range(128).batch(64, drop_remainder=True),
        tf.data.Dataset.range(128).batch(32, drop_remainder=True),
    )
)
try:
    model.fit(mismatched, verbose=0)
except ValueError as e:
    report["error"] = str(e)
keras.distribution.set_distribution(None)
harness.write_result(report)
