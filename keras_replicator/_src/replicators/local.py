"""LocalReplicator: synchronous in-graph replication on one host."""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from keras_replicator._src.core import devices as devices_lib
from keras_replicator._src.core import validation
from keras_replicator._src.patches import plain_iterator
from keras_replicator._src.replicators import base
from keras_replicator._src.upstream import mirrored_strategy


class LocalReplicator(base.ReplicatorMixin, tf.distribute.MirroredStrategy):
    """Replicates Keras and TensorFlow code over the devices of one host.

    The paper's `MultiGpuReplicator`: in-graph, synchronous data parallelism
    over the local GPUs, or over logical CPU devices on a host without GPU.
    Keras code needs only `with replicator.scope():`.

    CPU replicas need the CPU split before TensorFlow initialises; a first
    replicator does it (at least 8 logical CPUs, so later ones in the
    process, as in a notebook, can use up to 8). If other TensorFlow code ran
    first, call `keras_replicator.configure_cpu_replicas` at start-up.
    Replicators can be created repeatedly, with any replica counts: each
    uses its own collective keys.

    Example:
    ```python
    replicator = kr.LocalReplicator(num_replicas=2)
    with replicator.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    model.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=4, verbose=0)
    ```

    Args:
        num_replicas: Defaults to all local GPUs, else
            `KERAS_REPLICATOR_CPU_REPLICAS` or the CPU cores (at most 8).
        devices: One device name per replica, e.g. `["/gpu:0", "/gpu:1"]`
            or `["/cpu:0", "/cpu:1"]`. Defaults to the first `num_replicas`
            GPUs or logical CPUs.
        gradient_reduction: `"auto"`, `"mean"` or `"sum"` (the property of
            that name). Defaults to `"auto"`.
        hang_seconds: After this many seconds without a finished step in
            `fit`, `evaluate`, `predict` or `replicate`, the process prints
            every thread's stack and exits with code 76 (in a notebook the
            loop raises `RuntimeError`). A loop's first step and checkpoint
            saves get up to 5 times the timeout. 0 turns it off.
            Defaults to None: `KERAS_REPLICATOR_HANG_SECONDS`, else 600.
        sync_batch_norm: `BatchNormalization` statistics over the global
            batch in Keras and `replicate` steps (the property of that
            name). Defaults to True.
        shard_optimizer_state: Each replica keeps 1/N of every per-weight
            optimizer variable (ZeRO stage 1); checkpoints hold the full
            state. For `SGD`, `Adam`, `AdamW`, `RMSprop` in Keras steps
            (`fit`, `train_on_batch`, a custom `train_step`); see
            `docs/speed.md`. Defaults to False.

    Raises:
        ValueError: If `num_replicas` is not a positive integer, disagrees
            with `len(devices)` or exceeds the GPUs, a device does not
            exist, `gradient_reduction` is not `"auto"`, `"mean"` or
            `"sum"`, or `hang_seconds` is negative.
        RuntimeError: If CPU replicas are wanted but TensorFlow already
            initialised too few logical CPU devices.
    """

    replicator_kind = "local"

    def __init__(
        self,
        num_replicas: int | None = None,
        devices: Sequence[str] | None = None,
        gradient_reduction: str = "auto",
        hang_seconds: float | None = None,
        shard_optimizer_state: bool = False,
        sync_batch_norm: bool = True,
    ):
        self._set_options(
            gradient_reduction,
            sync_batch_norm,
            hang_seconds,
            shard_optimizer_state,
        )
        device_names = _resolve_devices(num_replicas, devices)
        # Read by MirroredExtended; see base.next_collective_key_base.
        self._collective_key_base = base.next_collective_key_base()
        # E.g. first build from a local batch, collectives in tf.cond, ...
        self._install_patches()
        # MirroredStrategy's __init__, with our extended class.
        tf.distribute.Strategy.__init__(
            self, _LocalExtended(self, devices=device_names)
        )


class _LocalExtended(
    plain_iterator.PlainInputExtended, mirrored_strategy.MirroredExtended
):
    """CPU replicas read batches in turns (`patches/plain_iterator.py`)."""


def _resolve_devices(
    num_replicas: int | None, devices: Sequence[str] | None
) -> list[str]:
    """Validates the arguments and returns one device name per replica."""
    validation.check_positive_int("num_replicas", num_replicas, allow_none=True)
    if devices is not None:
        if isinstance(devices, str) or not len(devices):
            raise ValueError(
                "`devices` must be a non-empty list of device names such as "
                f"['/cpu:0', '/cpu:1']. Received: devices={devices!r}"
            )
        if num_replicas is not None and num_replicas != len(devices):
            raise ValueError(
                "`num_replicas` must equal the number of `devices` (one "
                f"replica per device). Received: num_replicas={num_replicas}, "
                f"devices={list(devices)!r} ({len(devices)} devices)"
            )
        return _check_devices_exist(devices)

    gpus = devices_lib.local_gpus()
    if gpus:
        if num_replicas is not None and num_replicas > len(gpus):
            raise ValueError(
                f"This host has {len(gpus)} GPU(s), fewer than the replicas "
                f"asked for. Received: num_replicas={num_replicas}"
            )
        return gpus[: num_replicas or len(gpus)]

    count = num_replicas or devices_lib.default_cpu_replicas()
    devices_lib.configure_cpu_replicas(count)
    return [f"/device:CPU:{i}" for i in range(count)]


def _check_devices_exist(devices: Sequence[str]) -> list[str]:
    specs = []
    for name in devices:
        try:
            spec = tf.DeviceSpec.from_string(name)
        except (ValueError, TypeError):
            spec = None
        if spec is None or spec.device_type is None:
            raise ValueError(
                "Each device must be a device name such as '/gpu:0' or "
                f"'/cpu:1'. Received: device={name!r}"
            )
        specs.append(spec)
    cpu_indices = [
        (s.device_index or 0) for s in specs if s.device_type.upper() == "CPU"
    ]
    if cpu_indices and max(cpu_indices) < devices_lib.MIN_LOGICAL_CPUS:
        # CPU replicas: split the CPU before the runtime lists its devices.
        devices_lib.configure_cpu_replicas(max(cpu_indices) + 1)
    known = {
        (d.device_type.upper(), tf.DeviceSpec.from_string(d.name).device_index)
        for d in tf.config.list_logical_devices()
    }
    names = []
    for name, spec in zip(devices, specs, strict=True):
        key = (spec.device_type.upper(), spec.device_index or 0)
        if key not in known:
            available = sorted(f"/{t.lower()}:{i}" for t, i in known)
            raise ValueError(
                f"Device {name!r} does not exist on this host. Available: "
                f"{available}. Received: device={name!r}"
            )
        names.append(f"/device:{key[0]}:{key[1]}")
    if len(set(names)) != len(names):
        raise ValueError(
            "Each replica needs its own device; `devices` has duplicates. "
            f"Received: devices={list(devices)!r}"
        )
    return names
