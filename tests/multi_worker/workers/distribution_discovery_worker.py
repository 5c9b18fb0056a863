"""Worker of test_distribution_launchers.py: `initialize()` with no arguments.

argv: <initial weights .npz> <output dir>. Started by mpiexec or as a
Slurm task (emulated: the variables of a job step, no TF_CONFIG), it calls
`keras.distribution.initialize()` with no arguments, so the cluster comes
from our discovery alone; then it trains `distribution_reference`'s model
under `DataParallel` over every listed device and writes
`<output dir>/rank<process id>.json` (there is no per-worker result
variable under these launchers): the process count and id, the devices,
the workers' addresses, the history, the weights and the class of the
replicator that ran.
"""

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.tensorflow import distribution_lib

import keras_replicator  # noqa: F401 - runs keras.distribution on TF
from keras_replicator._src.distribution import processes
from tests.multi_worker import distribution_reference as reference

init_path, out_dir = sys.argv[1], sys.argv[2]
keras.distribution.initialize()
report = {
    "num_processes": distribution_lib.num_processes(),
    "process_id": distribution_lib.process_id(),
    "devices": keras.distribution.list_devices(),
    "tf_config": os.environ.get("TF_CONFIG"),
    # The addresses discovery gave every process.
    "workers": list(processes.current().cluster.cluster["worker"]),
}
keras.distribution.set_distribution(reference.distribution("data_parallel"))
model = reference.build()
model.set_weights(list(np.load(init_path).values()))
report["history"] = reference.train(model)
report["weights"] = [w.tolist() for w in model.get_weights()]
report["replicator"] = type(tf.distribute.get_strategy()).__name__
keras.distribution.set_distribution(None)
path = os.path.join(out_dir, f"rank{report['process_id']}.json")
with open(path, "w") as f:
    json.dump(report, f, default=lambda v: v.tolist())
