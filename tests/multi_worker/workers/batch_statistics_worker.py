"""Worker of test_batch_statistics.py: keras.io's convnet over 2 workers.

argv: `sync` (the default replicator) or `per_replica`
(`sync_batch_norm=False`). One replica per worker, over gRPC or, started
under mpiexec, MPI. Fits `keras_io_convnet` as the in-process test does
and writes its history, weights and transport.
"""

import sys

import keras_replicator as kr

replicator = kr.MultiWorkerReplicator(sync_batch_norm=sys.argv[1] == "sync")

from tests import keras_io_convnet  # noqa: E402
from tests.multi_worker import harness  # noqa: E402

history, weights = keras_io_convnet.train(replicator.scope())
harness.write_result(
    {
        "history": history,
        "weights": weights,
        "transport": replicator.transport,
    }
)
