"""The base every replicator shares: chief, batch helpers, research API.

Each backend is a `tf.distribute.Strategy` subclass with `ReplicatorMixin` first
in its bases, so every backend gets the same `is_chief`, global-batch helpers,
`replicate`, `wrap_optimizer` and `distribute`.
"""

from __future__ import annotations

import itertools
import threading

import tensorflow as tf

# Group keys of collective ops are process-global in TensorFlow's runtime, but
# each tf.distribute strategy numbers its groups from 1. Two strategies in one
# process with different device sets then share group key 1 and the runtime
# fails with "joining a group with size 4, but that group has size 2 ... Restart
# your program" (tensorflow/tensorflow#62790). Every replicator takes its own
# block of keys instead. Workers of one cluster create their replicators in the
# same order, so they agree on the keys.
_KEY_BLOCK = 10_000
_key_blocks = itertools.count(1)
_key_lock = threading.Lock()


def next_collective_key_base() -> int:
    """Returns a collective group-key base no other replicator here uses."""
    with _key_lock:
        return next(_key_blocks) * _KEY_BLOCK


class ReplicatorMixin:
    """What every replicator backend has, whatever its topology.

    Put it first in the bases of a `tf.distribute.Strategy` subclass. Subclasses
    that span processes override `is_chief`, `num_workers` and `worker_index`.
    """

    @property
    def is_chief(self) -> bool:
        """True on exactly one process: the one that writes files and logs."""
        return True

    @property
    def num_workers(self) -> int:
        """The number of worker processes that hold replicas."""
        return 1

    @property
    def worker_index(self) -> int:
        """This process's index among the workers, from 0."""
        return 0

    @property
    def replicas_per_worker(self) -> int:
        """The number of replicas this process holds."""
        return self.num_replicas_in_sync // self.num_workers

    def per_replica_batch_size(self, global_batch_size: int) -> int:
        """Splits a global batch size evenly over all replicas.

        Args:
            global_batch_size: The batch size of one step over all replicas
                and workers.

        Returns:
            `global_batch_size // num_replicas_in_sync`.

        Raises:
            ValueError: If `global_batch_size` is not a positive integer or is
                not divisible by the number of replicas.
        """
        _check_positive_int("global_batch_size", global_batch_size)
        replicas = self.num_replicas_in_sync
        if global_batch_size % replicas:
            raise ValueError(
                f"The global batch size must be divisible by the number of "
                f"replicas ({replicas}). Received: "
                f"global_batch_size={global_batch_size}, "
                f"num_replicas_in_sync={replicas}"
            )
        return global_batch_size // replicas

    def global_batch_size(self, per_replica_batch_size: int) -> int:
        """The global batch size for a per-replica batch size.

        Args:
            per_replica_batch_size: Examples each replica takes per step.

        Returns:
            `per_replica_batch_size * num_replicas_in_sync`.

        Raises:
            ValueError: If `per_replica_batch_size` is not a positive integer.
        """
        _check_positive_int("per_replica_batch_size", per_replica_batch_size)
        return per_replica_batch_size * self.num_replicas_in_sync

    def __repr__(self) -> str:
        devices = getattr(self.extended, "worker_devices", ())
        return (
            f"{type(self).__name__}(num_replicas_in_sync="
            f"{self.num_replicas_in_sync}, devices={list(devices)})"
        )


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"`{name}` must be a positive integer. Received: {name}={value!r}"
        )


def in_replica_context() -> bool:
    """True inside `strategy.run` (or with no strategy at all)."""
    return not tf.distribute.in_cross_replica_context()
