"""Run under `mpiexec -n 2`: rank 1 leaves right after the address exchange.

Rank 0 then waits for a peer that never starts; the start-up watchdog must
end it within its timeout with an error naming the lost rank and address.
"""

import sys

from keras_replicator._src.cluster import discovery

found = discovery.detect()
if found.rank == 1:
    discovery.exchange_addresses(found)
    sys.exit(0)

import keras_replicator as kr  # noqa: E402

kr.MultiWorkerReplicator(timeout_seconds=float(sys.argv[1]))
print("UNEXPECTED: the cluster started without rank 1")
