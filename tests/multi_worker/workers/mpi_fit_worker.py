"""Run under `mpiexec -n 2`: model.fit under kr.auto(), with no cluster code.

argv: <initial weights .npz> <output dir>. There is no TF_CONFIG: auto()
finds the MPI launch, the ranks exchange addresses with mpi4py, and
MultiWorkerReplicator trains over TensorFlow's own collectives.
"""

import os
import sys

import keras_replicator as kr

replicator = kr.auto()

import numpy as np  # noqa: E402

from tests.multi_worker import fit_reference  # noqa: E402

init_path, out_dir = sys.argv[1], sys.argv[2]
with replicator.scope():
    model = fit_reference.build()
model.set_weights(list(np.load(init_path).values()))
history, evaluation, _ = fit_reference.train(model)
np.savez(
    os.path.join(out_dir, f"rank{replicator.worker_index}.npz"),
    *model.get_weights(),
)
with open(
    os.path.join(out_dir, f"rank{replicator.worker_index}.txt"), "w"
) as f:
    f.write(
        f"{type(replicator).__name__} {replicator.num_workers} "
        f"{replicator.num_replicas_in_sync} {history['loss']}\n"
    )
