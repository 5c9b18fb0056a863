"""Which process this is: `kr.process_index()`, `process_count()`, `is_chief()`.

Keras keeps `num_processes()` and `process_id()` in its backend
(`keras.src.backend.distribution_lib`); `keras.distribution` does not
export them. These three are the public way to ask, under
`keras.distribution` and under the replicators alike. The first source
that applies answers:

1. `keras.distribution.initialize()` joined several processes
   (`processes.py`): its count, this process's index (Keras'
   `process_id`, the order of `list_devices()`) and its chief.
2. A replicator is the current strategy (inside `replicator.scope()`, or
   the one a `keras.distribution` distribution runs on): its
   `worker_index`, `num_workers` and `is_chief`. Under an
   `AsyncReplicator` the chief alone runs the program (its workers and
   parameter servers run the steps it sends): 0, 1 and True.
3. A launcher described a cluster: `TF_CONFIG` (`keras-replicator
   launch`, `kr.launch`, Kubernetes), or Slurm's or mpiexec's variables.
   They are read without connecting, so the answer is right before the
   replicator or `initialize()` exists, and outside `replicator.scope()`.
   (A `MultiWorkerReplicator` given its cluster by `cluster=` alone, with
   none of these set, answers inside its scope only.)
4. Otherwise this is the only process: 0, 1 and True.

Reading them runs no TensorFlow op and no collective: any process may ask
at any time, alone, before `initialize()` too.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import tensorflow as tf

from keras_replicator._src.cluster import config as cluster_lib
from keras_replicator._src.cluster import discovery
from keras_replicator._src.distribution import processes

# Tasks that run the program in step with the others; a parameter server,
# an evaluator, or any task of a parameter-server cluster but its chief,
# runs on its own.
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

    From 0; the chief is 0. It is Keras' `process_id` after
    `keras.distribution.initialize()` (the order in which
    `keras.distribution.list_devices()` lists the processes' devices and
    in which `Distribution.distribute_dataset` cuts each batch), and
    `replicator.worker_index` under a replicator. In a launched process
    (`keras-replicator launch`, `kr.launch`, `TF_CONFIG`, Slurm,
    mpiexec) it is right from the first line of the script; in a process
    of its own it is 0. Under an `AsyncReplicator`, where only the chief
    runs the program, it is 0.

    Reading it runs no TensorFlow op and no collective.

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

    The processes `keras.distribution.initialize()` joined (Keras'
    `num_processes`), or `replicator.num_workers` under a replicator, or
    those of the cluster a launcher described (`keras-replicator launch`,
    `kr.launch`, `TF_CONFIG`, Slurm, mpiexec); 1 in a process of its own
    and under an `AsyncReplicator`, whose chief alone runs the program.

    Reading it runs no TensorFlow op and no collective.

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

    The chief is the `"chief"` task if the cluster has one, else worker 0
    (process 0 after `keras.distribution.initialize()`, rank 0 under
    Slurm or mpiexec). It is `replicator.is_chief` under a replicator, and
    the process that writes the files `fit`'s callbacks write once
    (`ModelCheckpoint`'s, TensorBoard's logs). True in a process of its
    own.

    Reading it runs no TensorFlow op and no collective. A call that every
    process must make (`model.save` of sharded weights gathers them from
    every process) must not sit under `if kr.is_chief():`.

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
