"""Which process this is: `kr.process_index()`, `process_count()`, `is_chief()`.

Keras keeps `num_processes()` and `process_id()` unexported in
`keras.src.backend.distribution_lib`; these are the public way to ask, under
`keras.distribution` and the replicators alike. The first source that
applies answers:

1. `keras.distribution.initialize()` joined processes (`processes.py`):
   its count, Keras' `process_id` (the order of `list_devices()`), chief.
2. The current strategy is a replicator (in `replicator.scope()`, or under a
   `keras.distribution` distribution): its `worker_index`, `num_workers`,
   `is_chief`; 0, 1, True under an `AsyncReplicator`, whose chief alone
   runs the program (workers and parameter servers run the steps it sends).
3. A launcher's cluster: `TF_CONFIG` (`keras-replicator launch`,
   `kr.launch`, Kubernetes) or Slurm's or mpiexec's variables, read without
   connecting, so right before a replicator or `initialize()` exists and
   outside scopes. (A `MultiWorkerReplicator` given only `cluster=` answers
   inside its scope only.)
4. Otherwise the only process: 0, 1, True.

No TensorFlow op or collective runs: any process may ask at any time.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import tensorflow as tf

from keras_replicator._src.cluster import config as cluster_lib
from keras_replicator._src.cluster import discovery
from keras_replicator._src.distribution import processes

# Tasks running in step; a ps, an evaluator, or any non-chief task of a
# parameter-server cluster runs on its own.
_STEP_JOBS = ("chief", "worker")


class _Process(NamedTuple):
    index: int
    count: int
    chief: bool


_ALONE = _Process(index=0, count=1, chief=True)


def _current() -> _Process:
    """This process, from the first source that applies (module docstring)."""
    joined = processes.current()
    if joined is not None:
        return _Process(
            joined.process_id, joined.num_processes, joined.cluster.is_chief
        )
    if tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
        kind = getattr(strategy, "replicator_kind", None)
        if kind == "async":
            return _ALONE
        if kind is not None:
            return _Process(
                int(strategy.worker_index),
                int(strategy.num_workers),
                bool(strategy.is_chief),
            )
    return _from_environment()


def _from_environment() -> _Process:
    found = cluster_lib.detect()
    if found == cluster_lib.TF_CONFIG:
        config = cluster_lib.parse_tf_config(os.environ[cluster_lib.TF_CONFIG])
        if config.task_type not in _STEP_JOBS or "ps" in config.cluster:
            return _Process(0, 1, config.is_chief)
        return _Process(
            config.worker_index, config.num_workers, config.is_chief
        )
    if found is not None:
        launched = discovery.detect()
        return _Process(launched.rank, launched.size, launched.rank == 0)
    return _ALONE


def process_index() -> int:
    """This process's index among the processes that run the program.

    The chief is 0. Keras' `process_id` after
    `keras.distribution.initialize()` (the order of the processes' devices
    in `list_devices()` and of `Distribution.distribute_dataset`'s batch
    cuts), `replicator.worker_index` under a replicator. Right from a
    launched script's first line (`keras-replicator launch`, `kr.launch`,
    `TF_CONFIG`, Slurm, mpiexec); 0 alone or under an `AsyncReplicator`.
    Runs no TensorFlow op or collective.

    Example:
    ```python
    import keras_replicator as kr

    kr.process_index()  # 0 in a process of its own
    ```

    Returns:
        An int in `[0, kr.process_count())`.

    Raises:
        ValueError: If `TF_CONFIG`, or Slurm's or MPI's variables, are
            malformed or inconsistent (naming the field).
    """
    return _current().index


def process_count() -> int:
    """The number of processes that run the program together.

    Keras' `num_processes` after `keras.distribution.initialize()`,
    `replicator.num_workers` under a replicator, or the launcher's cluster
    size (`keras-replicator launch`, `kr.launch`, `TF_CONFIG`, Slurm,
    mpiexec); 1 alone or under an `AsyncReplicator`, whose chief alone runs
    the program. Runs no TensorFlow op or collective.

    Example:
    ```python
    import keras_replicator as kr

    kr.process_count()  # 1 in a process of its own
    ```

    Returns:
        An int, at least 1.

    Raises:
        ValueError: If `TF_CONFIG`, or Slurm's or MPI's variables, are
            malformed or inconsistent (naming the field).
    """
    return _current().count


def is_chief() -> bool:
    """Whether this process is the chief: True on exactly one process.

    The `"chief"` task if any, else worker 0 (process 0 after
    `keras.distribution.initialize()`, rank 0 under Slurm or mpiexec);
    `replicator.is_chief` under a replicator; the process writing the files
    `fit`'s callbacks write once (`ModelCheckpoint`, TensorBoard). True
    alone. Runs no TensorFlow op or collective. Calls every process must
    make (`model.save` of sharded weights gathers from all) must not sit
    under `if kr.is_chief():`.

    Example:
    ```python
    import keras_replicator as kr

    if kr.is_chief():
        print("written once, by the chief")
    ```

    Returns:
        A bool.

    Raises:
        ValueError: If `TF_CONFIG`, or Slurm's or MPI's variables, are
            malformed or inconsistent (naming the field).
    """
    return _current().chief
