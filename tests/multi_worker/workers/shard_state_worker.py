"""Worker of test_shard_state.py: sharded optimizer state on 2 x 2.

argv: <output dir>. Trains every case of `tests/test_shard_state.py`'s
multi-worker list with `shard_optimizer_state=True` and reports the
weights; the Adam case also reports its full optimizer state (a
collective: every worker saves) and writes a `BackupAndRestore` backup
under the output dir.
"""

import os
import sys

import keras_replicator as kr

# Create the replicator first: it splits the CPU before TF starts.
replicator = kr.MultiWorkerReplicator(shard_optimizer_state=True)

import keras  # noqa: E402

from tests import test_shard_state as cases  # noqa: E402
from tests.multi_worker import harness  # noqa: E402

out_dir = sys.argv[1]
results = {}
for name, (optimizer, options) in sorted(cases.MULTI_WORKER_CASES.items()):
    callbacks = []
    if name == "adam":
        callbacks.append(
            keras.callbacks.BackupAndRestore(
                os.path.join(out_dir, "backup"), delete_checkpoint=False
            )
        )
    model = cases._train(
        replicator,
        cases.OPTIMIZERS[optimizer],
        epochs=1 if name == "adam" else 2,
        callbacks=callbacks,
        **options,
    )
    # Adam's first slot of the 8 x 7 kernel: 56 / 4 elements per replica.
    slot = model.optimizer.variables[2].value.values[0]
    result = {"weights": model.get_weights(), "slot_shape": list(slot.shape)}
    if name == "adam":
        store = {}
        model.optimizer.save_own_variables(store)
        result["optimizer"] = [store[str(i)] for i in range(len(store))]
    results[name] = result
harness.write_result(results)
