"""Logical CPU devices, so one host CPU can hold several replicas.

TensorFlow fixes its device list when its runtime initialises (the first op,
or the first listing of logical devices): the CPU must be split before that,
and the split can't change until the process restarts. TensorFlow is imported
inside functions, so `keras-replicator env` can say what `kr.auto()` would
pick (`find_tpu`, `default_cpu_replicas`, `gpus_possible`) without it.
"""

from __future__ import annotations

import glob
import os
import sys
import sysconfig

from keras_replicator._src.core import env
from keras_replicator._src.core import validation

# The fewest logical CPUs a first split makes, so a notebook can later ask for
# more replicas (up to this) without a restart. They share one thread pool, so
# spare ones cost nothing.
MIN_LOGICAL_CPUS = 8
_CPU_REPLICAS_ENV = env.CPU_REPLICAS

_TOO_LATE = (
    "TensorFlow has already initialised its devices with {have} logical "
    "CPU device(s), and {want} CPU replicas need {want}: TensorFlow ran an "
    "op before keras_replicator could split the CPU, and devices can only "
    "be split before the first op. Fix: put `import keras_replicator` "
    "(which splits the CPU into {min_cpus} logical devices when it is "
    "imported first) or `keras_replicator.configure_cpu_replicas({want})` "
    "at the very start of the program or notebook, before other TensorFlow "
    "or Keras code runs, then restart the program or kernel. Received: "
    "num_replicas={want}, logical CPU devices={have}"
)


def configure_cpu_replicas(num_replicas: int) -> int:
    """Splits the host CPU into logical devices for `num_replicas` replicas.

    Call it at start-up, before other TensorFlow or Keras code runs. A
    replicator created first calls it for you; otherwise, call it yourself.

    Args:
        num_replicas: The number of CPU replicas wanted, at least 1.

    Returns:
        The number of logical CPU devices now, at least `num_replicas`.

    Raises:
        ValueError: If `num_replicas` is not a positive integer.
        RuntimeError: If TensorFlow has already initialised fewer logical CPU
            devices than `num_replicas`.
    """
    import tensorflow as tf

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
            _TOO_LATE.format(
                have=have, want=num_replicas, min_cpus=MIN_LOGICAL_CPUS
            )
        ) from None


def runtime_started() -> bool:
    """True once TensorFlow's eager runtime is up (its first op ran)."""
    from keras_replicator._src.upstream import context

    # Private, but the only way to ask without starting the runtime (as
    # `tf.config.list_logical_devices` would).
    return context.context()._context_handle is not None  # noqa: SLF001


def split_cpu_at_import() -> int | None:
    """Splits the CPU into logical devices if TensorFlow has not started.

    `import keras_replicator` calls it, so a program that imports it before
    any TensorFlow op can later create `LocalReplicator`s of up to
    `MIN_LOGICAL_CPUS` (or `KERAS_REPLICATOR_CPU_REPLICAS`) CPU replicas.
    No-op if the runtime is up, the host has a GPU (replicas are GPUs then),
    the CPU is already configured, or `KERAS_REPLICATOR_SPLIT_CPU=0`.

    Returns:
        The number of logical CPU devices made, or None if it did nothing.
    """
    if os.environ.get(env.SPLIT_CPU_AT_IMPORT, "1") == "0":
        return None
    import tensorflow as tf

    if runtime_started():
        return None
    if tf.config.list_physical_devices("GPU"):
        return None
    cpu = tf.config.list_physical_devices("CPU")[0]
    if tf.config.get_logical_device_configuration(cpu):
        return None
    try:
        want = max(default_cpu_replicas(), MIN_LOGICAL_CPUS)
    except ValueError:
        # A bad KERAS_REPLICATOR_CPU_REPLICAS is reported where it is used.
        want = MIN_LOGICAL_CPUS
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * want
        )
    except RuntimeError:
        return None
    return want


def default_cpu_replicas() -> int:
    """The number of CPU replicas (a positive int) used when none is given.

    `KERAS_REPLICATOR_CPU_REPLICAS` if set, else the CPU cores, capped at
    `MIN_LOGICAL_CPUS`.

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


def find_tpu() -> str | None:
    """Says where a TPU is, without connecting to it (nor TensorFlow).

    Returns:
        The `tpu` argument for `TPUClusterResolver` (`"local"`, a name, or a
        `grpc://` address), or `None` when no TPU is visible.
    """
    name = os.environ.get("TPU_NAME")
    if name:
        return name
    colab = os.environ.get("COLAB_TPU_ADDR")
    if colab:
        return colab if colab.startswith("grpc://") else f"grpc://{colab}"
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return "local"
    return None


# Linux traces of a usable GPU: NVIDIA device files and driver, ROCm's driver.
_GPU_FILES = ("/dev/nvidia[0-9]*", "/proc/driver/nvidia/gpus/*", "/dev/kfd")


def gpus_possible() -> str | None:
    """Why TensorFlow might see a GPU here, answered without TensorFlow.

    Returns what was found (a file, a plugin folder, the platform), or None
    only on Linux with no NVIDIA or ROCm driver files and no TensorFlow device
    plugin (in `site-packages/tensorflow-plugins` or
    `TF_PLUGGABLE_DEVICE_LIBRARY_PATH`). Elsewhere (macOS Metal, Windows
    DirectML) only TensorFlow can say.
    """
    if sys.platform != "linux":
        return f"platform {sys.platform}"
    for pattern in _GPU_FILES:
        found = glob.glob(pattern)
        if found:
            return found[0]
    if os.environ.get("TF_PLUGGABLE_DEVICE_LIBRARY_PATH"):
        return "TF_PLUGGABLE_DEVICE_LIBRARY_PATH"
    folders = {p for p in sys.path if "site-packages" in p}
    folders.add(sysconfig.get_paths()["purelib"])
    for folder in sorted(f for f in folders if f):
        plugins = os.path.join(folder, "tensorflow-plugins")
        if os.path.isdir(plugins):
            return plugins
    return None


def local_gpus() -> list[str]:
    """This host's logical GPU names in index order.

    Empty, and TensorFlow stays unimported, if it is not imported yet and
    `gpus_possible` rules GPUs out.
    """
    if "tensorflow" not in sys.modules and gpus_possible() is None:
        return []
    import tensorflow as tf

    if not tf.config.list_physical_devices("GPU"):
        # Don't initialise the runtime just to learn there is no GPU.
        return []
    return [d.name for d in tf.config.list_logical_devices("GPU")]
