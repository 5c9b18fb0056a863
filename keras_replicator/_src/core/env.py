"""Every environment variable keras-replicator reads or sets, by name."""

# CPU replicas per process (LocalReplicator default; MultiWorkerReplicator's
# replicas per worker; set by `launch --replicas-per-worker`).
CPU_REPLICAS = "KERAS_REPLICATOR_CPU_REPLICAS"
# The port and host name a worker announces in MPI/Slurm discovery.
PORT = "KERAS_REPLICATOR_PORT"
HOST = "KERAS_REPLICATOR_HOST"
# TensorFlow's cluster description.
TF_CONFIG = "TF_CONFIG"
