"""Worker of test_distribution.py: keras.distribution over 2 processes.

argv: <initial weights .npz> <the batch-statistics model's .npz> <the
mixed-precision run's .npz>. Calls
`keras.distribution.initialize()` (from Keras' variables on worker 0,
TF_CONFIG on worker 1), then trains the model of `distribution_reference`
under `ModelParallel` on a (batch 2 across processes) x (model 2 inside a
process) mesh fed by our sharder, and on a (1, 4) mesh whose model axis
spans the processes (fed by Keras' per-process cut; and the (2, 2) mesh
again on data of unknown length), then the batch-statistics model
(`Dropout`, `BatchNormalization`) on the (2, 2) mesh, and the first model
under `mixed_bfloat16` on the (1, 4) mesh, and reports the numbers, the
devices and where the weights live. `DataParallel` and the (2, 2) mesh fed
by Keras' cut are `examples/gemma_model_parallel.py`'s,
launched by test_distribution_gemma.py.
"""

import json
import os
import sys
import tempfile

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.tensorflow import distribution_lib

import keras_replicator as kr
from keras_replicator._src.patches import registry
from tests import helpers
from tests.multi_worker import distribution_reference as reference
from tests.multi_worker import harness

if harness.task_index() == 0:
    # Keras' own variables on worker 0; TF_CONFIG (as `keras-replicator
    # launch` and Kubernetes set it) on worker 1.
    config = json.loads(os.environ.pop("TF_CONFIG"))
    os.environ["KERAS_DISTRIBUTION_JOB_ADDRESSES"] = ",".join(
        config["cluster"]["worker"]
    )
    os.environ["KERAS_DISTRIBUTION_NUM_PROCESSES"] = "2"
    os.environ["KERAS_DISTRIBUTION_PROCESS_ID"] = "0"
# Before `initialize()`, and without a TensorFlow op (`initialize` must
# come first): worker 1 reads its place from TF_CONFIG.
before = [kr.process_index(), kr.process_count(), kr.is_chief()]
keras.distribution.initialize()
report = {
    "num_processes": distribution_lib.num_processes(),
    "process_id": distribution_lib.process_id(),
    "this_process_before_initialize": before,
    "this_process": [kr.process_index(), kr.process_count(), kr.is_chief()],
    "devices": keras.distribution.list_devices(),
}
# A mesh larger than the cluster: refused before any collective.
too_many = [f"/job:worker/task:{t}/cpu:{i}" for t in range(2) for i in range(4)]
try:
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=too_many)
    )
except ValueError as e:
    report["too_large_mesh"] = str(e)
# Devices out of process order: refused.
try:
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(
            devices=keras.distribution.list_devices()[::-1]
        )
    )
except NotImplementedError as e:
    report["reordered_mesh"] = str(e)
init = list(np.load(sys.argv[1]).values())
for kind in ("model_across", "sharder", "unknown_length"):
    mesh = "model_parallel" if kind == "unknown_length" else kind
    keras.distribution.set_distribution(reference.distribution(mesh))
    model = reference.build()
    model.set_weights(init)
    data = None
    if kind == "unknown_length":
        data = reference.dataset(known_length=False)
    if kind == "sharder":
        data = tf.distribute.get_strategy().distribute(
            reference.dataset(batched=False), reference.GLOBAL_BATCH
        )
    history = reference.train(model, data)
    report[kind] = {
        "history": history,
        "weights": model.get_weights(),
        "shard_shapes": {
            v.path: {d: list(s) for d, s in kr.shard_shapes(v).items()}
            for v in model.weights
        },
        "replicator": type(tf.distribute.get_strategy()).__name__,
        # A multi-worker replicator's features, installed for it.
        "patches": list(registry.installed()),
    }
    if kind == "model_across":
        # Host reads all-gather every sharded value over the processes:
        # after the first, the gathers' functions are traced already.
        started = helpers.tf_functions_started()
        with tempfile.TemporaryDirectory() as folder:
            for _ in range(2):
                model.save_weights(os.path.join(folder, "m.weights.h5"))
                model.get_weights()
        report[kind]["functions_started_by_reads"] = (
            helpers.tf_functions_started() - started
        )
# Dropout masks and BatchNormalization's moments over the global batch,
# across the processes.
keras.distribution.set_distribution(reference.distribution("model_parallel"))
model = reference.build_batch_statistics()
model.set_weights(list(np.load(sys.argv[2]).values()))
history = reference.train(model)
report["batch_statistics"] = {
    "history": history,
    "weights": model.get_weights(),
}
# Mixed precision with the model axis across the processes: bfloat16 rows
# cross the wire (the products' gathers and sums).
from keras_replicator._src.sharding import contraction  # noqa: E402

paths = []
choose = contraction._choose


def _recorded(moving, moving_fn, kernel_fn):
    # A Python bool when chosen at trace time, else chosen in the graph
    # (Keras' per-process cut of a batch loses its static size): then the
    # rows path says so when it runs.
    paths.append(str(moving) if isinstance(moving, bool) else "graph")

    def rows():
        with tf.control_dependencies([tf.print("mixed: rows moved")]):
            return tf.nest.map_structure(tf.identity, moving_fn())

    return choose(moving, rows, kernel_fn)


contraction._choose = _recorded
keras.config.set_dtype_policy(reference.MIXED)
keras.distribution.set_distribution(reference.distribution("model_across"))
model = reference.build_mixed()
model.set_weights(list(np.load(sys.argv[3]).values()))
history = reference.train(model, reference.dataset(static=True))
report["mixed"] = {
    "history": history,
    "weights": model.get_weights(),
    "compute_dtype": model.get_layer("d1").compute_dtype,
    "paths": sorted(set(paths)),
}
keras.config.set_dtype_policy("float32")
keras.distribution.set_distribution(None)
harness.write_result(report)
