"""TpuReplicator: synchronous replication over the cores of a TPU or pod.

Untested on real TPUs (none in CI); its static-shape data contract is tested
through XLA on CPU replicas (`tests/test_sharding.py`).
"""

from __future__ import annotations

import tensorflow as tf

from keras_replicator._src.core import devices
from keras_replicator._src.replicators import base

# Finds a TPU without TensorFlow, for `kr.auto()` and `keras-replicator env`.
find_tpu = devices.find_tpu

# Where a TPU is looked for, in order; named in the error when none is found.
_LOOKED_FOR = (
    "the `tpu` argument",
    "the TPU_NAME environment variable (Cloud TPU name or pod)",
    "COLAB_TPU_ADDR (a Colab TPU runtime)",
    "local TPU chips (/dev/accel* or /dev/vfio/* on a TPU VM)",
)


def resolver_for(
    tpu: str | tf.distribute.cluster_resolver.TPUClusterResolver | None,
) -> tf.distribute.cluster_resolver.TPUClusterResolver:
    """Makes the `TPUClusterResolver` for a `tpu` argument (see TpuReplicator).

    Raises TypeError for another type, RuntimeError if no TPU is found or
    the named one can't be resolved.
    """
    resolver_cls = tf.distribute.cluster_resolver.TPUClusterResolver
    if isinstance(tpu, resolver_cls):
        return tpu
    if tpu is not None and not isinstance(tpu, str):
        raise TypeError(
            "`tpu` must be None, a TPU name or address, or a "
            f"TPUClusterResolver. Received: tpu={tpu!r}"
        )
    target = tpu or find_tpu()
    if not target:
        raise RuntimeError(
            "No TPU found. Looked for: " + "; ".join(_LOOKED_FOR) + ". On "
            "Colab pick a TPU runtime; elsewhere pass tpu='name' or "
            "tpu='grpc://host:8470'. Received: tpu=None"
        )
    try:
        return resolver_cls(tpu=target)
    except (ValueError, RuntimeError, tf.errors.OpError) as error:
        raise RuntimeError(
            f"Could not resolve the TPU {target!r}: {error}. Received: "
            f"tpu={tpu!r}"
        ) from error


class TpuReplicator(base.ReplicatorMixin, tf.distribute.TPUStrategy):
    """Replicates Keras and TensorFlow code over TPU cores (Colab, VM, pod).

    The paper's `TpuReplicator`: a `tf.distribute.TPUStrategy` that finds,
    connects to and initialises the TPU. Steps are XLA-compiled, so batches
    need static shapes: `replicator.distribute` gives them by default
    (training drops the remainder, evaluation pads and masks it), with one
    input pipeline per TPU host.

    Args:
        tpu: `None` (default: TPU_NAME, then a Colab TPU, then a TPU VM's
            local chips), `"local"`, a TPU or pod name, a `grpc://host:port`
            address, or a `TPUClusterResolver`.

    Raises:
        RuntimeError: If no TPU is found or it can't be initialised.
        TypeError: If `tpu` has an unsupported type.
    """

    replicator_kind = "tpu"

    def __init__(self, tpu=None):
        resolver = resolver_for(tpu)
        if resolver.master() not in ("", "local"):
            # Only remote TPU workers (Colab, named TPUs, pods) need connecting.
            tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        # Exact evaluation of padded batches (patches/exact_eval), ...
        self._install_patches()
        super().__init__(resolver)
