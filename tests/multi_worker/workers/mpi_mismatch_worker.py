"""Run under `mpiexec -n 2 ... <out dir>`: collectives whose ranks disagree.

Four steps, each traced differently on the two ranks: a sum of other
shapes, of other dtypes, two collectives in other orders, and one extra
collective on rank 0 (named apart: a collective of the same name and
shape on each rank is the same one, as far as any rank can tell). Each
must fail on both ranks, before any bytes move,
with an error naming each rank's op; then a step both ranks agree on must
still give the right sum. Writes `<out dir>/rank<r>.json`: per case, the
error text (or None) and the seconds it took.
"""

import json
import sys
import time

import keras_replicator as kr

out_dir = sys.argv[1]
replicator = kr.MultiWorkerReplicator(collective_timeout_seconds=30)

import tensorflow as tf  # noqa: E402

rank = replicator.worker_index


def _sum(value):
    return tf.distribute.get_replica_context().all_reduce("sum", value)


def _gather(value):
    return tf.distribute.get_replica_context().all_gather(value, axis=0)


def _extra():
    with tf.name_scope("extra"):
        return _sum(tf.ones([2]))


CASES = {
    "shape": lambda: _sum(tf.ones([3 + rank])),
    "dtype": lambda: _sum(tf.ones([3], [tf.float32, tf.float64][rank])),
    "order": lambda: (
        [_sum(tf.ones([2])), _gather(tf.ones([2]))]
        if rank == 0
        else [_gather(tf.ones([2])), _sum(tf.ones([2]))]
    ),
    # The extra one is told apart by its name: the ops of one shape that
    # follow it pair up with others, of other names.
    "count": lambda: (
        [_extra(), _sum(tf.ones([2]))] if rank == 0 else [_sum(tf.ones([2]))]
    ),
    "agreed": lambda: _sum(tf.ones([2]) * (rank + 1)),
}
report = {}
for name, fn in CASES.items():
    start = time.monotonic()
    try:
        value = tf.function(lambda fn=fn: replicator.run(fn))()
        error = None
        result = tf.nest.map_structure(lambda t: t.numpy().tolist(), value)
    except Exception as e:  # noqa: BLE001 - what a user sees, recorded
        error, result = f"{type(e).__name__}: {e}", None
    report[name] = {
        "error": error,
        "result": result,
        "seconds": time.monotonic() - start,
    }
with open(f"{out_dir}/rank{rank}.json", "w") as f:
    json.dump(report, f)
