"""Run under `mpiexec -n 2 ... <timeout> <elements> <out>`: rank 1 never sums.

Rank 0 sums `elements` float32 (a small sum is polled by itself, one over
1 MB waits at a barrier first) with `collective_timeout_seconds`; rank 1
sleeps instead. Rank 0 must end within its bound with an error naming it,
write `ENDED ...` and the error to the file `out` (output sent as a job
aborts may be lost), and exit, aborting the MPI job (mpiexec then ends
rank 1). A fourth argument sets rank 1's sleep (default 300 s).
"""

import sys
import time

import keras_replicator as kr

timeout, elements, out = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
replicator = kr.MultiWorkerReplicator(collective_timeout_seconds=timeout)

import tensorflow as tf  # noqa: E402

if replicator.worker_index == 1:
    time.sleep(float(sys.argv[4]) if len(sys.argv) > 4 else 300)
    sys.exit(0)


@tf.function
def step():
    def fn():
        context = tf.distribute.get_replica_context()
        return context.all_reduce("sum", tf.ones([elements]))

    return replicator.run(fn)


start = time.monotonic()
try:
    step()
except Exception as error:  # noqa: BLE001 - what a user sees, printed
    with open(out, "w") as f:
        f.write(f"ENDED after {time.monotonic() - start:.1f} s: {error}")
    sys.exit(3)
print("UNEXPECTED: the sum returned without rank 1", flush=True)
