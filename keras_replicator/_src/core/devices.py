"""Logical CPU devices, so one host CPU can hold several replicas.

TensorFlow fixes its device list when its runtime initialises (the first op,
or the first call that lists logical devices). Splitting the CPU into logical
devices must happen before that; afterwards the split can't change until the
process restarts.
"""

from __future__ import annotations

import os

import tensorflow as tf

from keras_replicator._src.core import env
from keras_replicator._src.core import validation

# Replicators split the CPU into at least this many logical devices the first
# time, so that a notebook can later ask for more replicas (up to this number)
# without a kernel restart. Logical CPU devices share one thread pool, so the
# spare ones cost nothing.
MIN_LOGICAL_CPUS = 8
_CPU_REPLICAS_ENV = env.CPU_REPLICAS

_TOO_LATE = (
    "TensorFlow has already initialised its devices with {have} logical "
    "CPU device(s), and {want} CPU replicas need {want}. Devices can only be "
    "split before TensorFlow runs its first op. Call "
    "`keras_replicator.configure_cpu_replicas({want})` (or create the "
    "replicator) at the very start of the program or notebook, before other "
    "TensorFlow or Keras code, then restart the program or kernel."
)


def configure_cpu_replicas(num_replicas: int) -> int:
    """Splits the host CPU into logical devices for `num_replicas` replicas.

    Call it at start-up, before any other TensorFlow or Keras code runs. The
    replicators call it for you when they are created first; call it yourself
    when other TensorFlow code must run before the replicator is created.

    Args:
        num_replicas: The number of CPU replicas wanted, at least 1.

    Returns:
        The number of logical CPU devices now available (at least
        `num_replicas`).

    Raises:
        ValueError: If `num_replicas` is not a positive integer.
        RuntimeError: If TensorFlow has already initialised fewer logical CPU
            devices than `num_replicas`.
    """
    validation.check_positive_int("num_replicas", num_replicas)
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu) or []
    if len(current) >= num_replicas:
        return len(current)
    want = max(num_replicas, MIN_LOGICAL_CPUS)
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * want
        )
        return want
    except RuntimeError:
        # The runtime is already up: live with what it has.
        have = len(tf.config.list_logical_devices("CPU"))
        if have >= num_replicas:
            return have
        raise RuntimeError(
            _TOO_LATE.format(have=have, want=num_replicas)
        ) from None


def default_cpu_replicas() -> int:
    """The number of CPU replicas used when none is given.

    `KERAS_REPLICATOR_CPU_REPLICAS` if set, else the number of CPU cores,
    capped at `MIN_LOGICAL_CPUS`.

    Returns:
        A positive integer.

    Raises:
        ValueError: If the environment variable is not a positive integer.
    """
    value = os.environ.get(_CPU_REPLICAS_ENV)
    if value is not None:
        try:
            parsed = int(value)
        except ValueError:
            parsed = 0
        if parsed < 1:
            raise ValueError(
                f"{_CPU_REPLICAS_ENV} must be a positive integer. "
                f"Received: {_CPU_REPLICAS_ENV}={value!r}"
            )
        return parsed
    return max(1, min(os.cpu_count() or 1, MIN_LOGICAL_CPUS))


def local_gpus() -> list[str]:
    """Names of the logical GPUs of this host, in index order."""
    if not tf.config.list_physical_devices("GPU"):
        # Don't initialise the runtime just to learn there is no GPU.
        return []
    return [d.name for d in tf.config.list_logical_devices("GPU")]
