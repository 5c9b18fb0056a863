"""Every environment variable keras-replicator reads or sets, by name."""

# CPU replicas per process (LocalReplicator default; MultiWorkerReplicator's
# replicas per worker; set by `launch --replicas-per-worker`).
CPU_REPLICAS = "KERAS_REPLICATOR_CPU_REPLICAS"
# The port and host name a worker announces in MPI/Slurm discovery.
PORT = "KERAS_REPLICATOR_PORT"
HOST = "KERAS_REPLICATOR_HOST"
TF_CONFIG = "TF_CONFIG"
# "1" in workers `keras-replicator launch` starts on one host: the chief's
# `MultiWorkerReplicator()` advises one process (cluster/process_layout.py).
LAUNCHED = "KERAS_REPLICATOR_LAUNCHED"
# "0": `import keras_replicator` leaves the CPU unsplit (core/devices.py).
SPLIT_CPU_AT_IMPORT = "KERAS_REPLICATOR_SPLIT_CPU"
# `kr.launch` workers: the pickled function and where its result goes.
LAUNCH_PAYLOAD = "KERAS_REPLICATOR_LAUNCH_PAYLOAD"
LAUNCH_RESULT = "KERAS_REPLICATOR_LAUNCH_RESULT"
# Comma-separated signals (empty: off) on which `fit` stops at the same step
# on every worker, writes the `BackupAndRestore` backup and exits; the
# launcher forwards them to its workers.
PREEMPTION_SIGNALS = "KERAS_REPLICATOR_PREEMPTION_SIGNALS"
# About how often, in seconds, multi-worker fit agrees on a pending signal.
PREEMPTION_CHECK_SECONDS = "KERAS_REPLICATOR_PREEMPTION_CHECK_SECONDS"
# Seconds without progress after which the hang watchdog ends a process
# (training/hang_watchdog.py); "0" or "off" turns it off.
HANG_SECONDS = "KERAS_REPLICATOR_HANG_SECONDS"
# A path: every `fit` under a replicator writes its timeline there
# (callbacks/timeline.py).
TIMELINE = "KERAS_REPLICATOR_TIMELINE"
# "grpc" or "mpi": forces the transport of the collectives between processes
# (cluster/transport.py); unset, an mpiexec/srun --mpi launch picks MPI.
TRANSPORT = "KERAS_REPLICATOR_TRANSPORT"
