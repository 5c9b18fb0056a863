"""`keras.distribution` on TensorFlow: the backend hooks Keras calls.

Keras 3.15's TensorFlow `distribution_lib` is a stub ("!!!DO NOT USE!!!
... prototype"): no `get_device_count`, `initialize`, `num_processes`,
`process_id`, `distribute_tensor` or `distribute_data_input`, and mesh and
layout conversions needing DTensor (unused here: `distribution/`'s notes).
`ModelParallel` failed (`AttributeError: ... distribute_tensor` for an
`"<layer>/output"` key); `DataParallel` trained silently on one device.

Installed at import (the API is used before any replicator exists), this:

- fills in the hooks. `distribute_tensor` and `distribute_data_input` return
  their input (compute is data-parallel over the mesh, so an activation is
  the replica's slice and an output layout a hint); the conversions return
  the Keras objects;
- makes `initialize()` join the cluster's processes
  (`distribution/processes.py`): `list_devices()` then lists every process's
  devices (`"/job:worker/task:1/cpu:0"`), with real `num_processes()` and
  `process_id()`;
- cuts each global batch by process with a `map`, keeping the dataset's
  length, each process taking the rows a replicator gives its devices (a
  ragged batch may leave one none), and passes `replicator.distribute(...)`
  data through. The cut lives in `Distribution.distribute_tf_dataset` /
  `distribute_dataset` on 3.15, in `DataParallel`'s and `ModelParallel`'s
  `distribute_dataset` on 3.10-3.14, in `TFDatasetAdapter._distribute_dataset`
  on 3.16; each is replaced where it is;
- makes `set_distribution(d)` (and so `Distribution.scope()`) make `d`'s
  replicator the current strategy, and `set_distribution(None)` drop it. The
  replicator comes from the factory `distribution/` registers
  (`set_replicator_factory`): patches do not import replicators.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf
from keras.src import distribution as keras_src_distribution
from keras.src.backend.common import global_state
from keras.src.backend.tensorflow import distribution_lib as backend_lib
from keras.src.distribution import distribution_lib

from keras_replicator._src.core import versions
from keras_replicator._src.patches import registry

_factory: Callable[[Any], Any] | None = None
# The runtime's `initialize(job_addresses, num_processes, process_id)` and
# `current() -> Processes | None` (see `distribution/processes.py`).
_initializer: Callable[..., None] | None = None
_processes: Callable[[], Any] | None = None
# The strategy `set_distribution` made current, to drop it again.
_current: list[Any] = []


def set_replicator_factory(factory: Callable[[Any], Any]) -> None:
    """Registers `factory(distribution) -> replicator` (the runtime's)."""
    global _factory
    _factory = factory


def set_process_hooks(
    initializer: Callable[..., None], processes: Callable[[], Any]
) -> None:
    """Registers the runtime's `initialize` and its record of processes."""
    global _initializer, _processes
    _initializer = initializer
    _processes = processes


def _joined():
    return _processes() if _processes is not None else None


def _list_devices(original, device_type=None):
    joined = _joined()
    if joined is None:
        return original(device_type)
    if device_type is not None and device_type.lower() != joined.device_type:
        return []
    return joined.devices()


def _get_device_count(original, device_type=None):
    return len(backend_lib.list_devices(device_type))


def _num_processes(original):
    joined = _joined()
    return 1 if joined is None else joined.num_processes


def _process_id(original):
    joined = _joined()
    return 0 if joined is None else joined.process_id


def _initialize(
    original, job_addresses=None, num_processes=None, process_id=None
):
    if _initializer is None:
        raise RuntimeError(
            "keras_replicator's distribution runtime is not loaded; "
            "`import keras_replicator` first."
        )
    _initializer(job_addresses, num_processes, process_id)


def _distribute_tensor(original, tensor, layout):
    """What `keras.distribution.distribute_tensor` means here.

    Compute is data-parallel over the mesh; a step cuts each global batch
    itself. So the tensor is returned as it is:

    - inside a replica step (it is already this device's slice);
    - inside a layer call (a `"<layer>/output"` layout), also outside a
      step: Keras builds the model before the first `fit`
      (`_symbolic_build`), and users call `model(x)`; refusing made a
      `LayoutMap` output key like `(None, "model")` fail `fit`;
    - outside both (keras-hub's `generate` uses `get_data_layout`), for a
      layout splitting at most the batch dimension: the next step cuts it.

    Outside both, splitting another dimension asks for a tensor in blocks,
    which only variables are here: refused.
    """
    in_step = (
        tf.distribute.has_strategy()
        and tf.distribute.get_replica_context() is not None
    )
    if in_step or _in_layer_call():
        return tensor
    axes = tuple(getattr(layout, "axes", None) or ())
    if any(axis is not None for axis in axes[1:]):
        raise NotImplementedError(
            "On TensorFlow, keras-replicator lays out tensors along the "
            "batch (their first dimension) only: each step cuts the batch "
            "over the mesh's devices, and only variables are stored in "
            "blocks. A layout that splits another dimension is supported "
            "for variables (a LayoutMap) and as a layer's output hint. "
            f"Received: layout axes={axes}, tensor shape="
            f"{tuple(getattr(tensor, 'shape', ()))}"
        )
    return tensor


def _in_layer_call() -> bool:
    """Whether a Keras `Layer.__call__` is running on this thread."""
    return global_state.get_global_attribute("current_call_ctx") is not None


def _distribute_data_input(
    original, per_process_batch, layout, batch_dim_name=None
):
    return per_process_batch


def _distribute_tf_dataset(original, self, dataset):
    """Process p takes part p of every global batch, keeping the count.

    Keras' cut (`rebatch` then `shard`) loses the cardinality, so `fit`
    ends an epoch by running out of data; over two workers the next epoch
    then differed from one device's by about 1e-3 after Adam (cause in TF's
    multi-worker iterator not pinned down). A `map` keeps it, gives the same
    batches when the batch divides, and splits one that does not (Keras
    refuses it, or gives a ragged last batch to some processes only) as a
    replicator does (`_cut_by_process`), whatever the mesh.
    """
    if _joined() is None or not self._is_multi_process:
        return original(self, dataset)
    return _cut_by_process(
        dataset,
        self._num_processes,
        self._process_id,
        _joined().replicas_per_worker,
    )


def _distribute_dataset_keras_3_10(original, self, dataset):
    """`distribute_dataset` of a `DataParallel` or `ModelParallel`.

    Keras 3.10 to 3.14 cut the batches there; this does what 3.15's
    `_distribute_dataset` and `_distribute_tf_dataset` do.
    TODO: delete when the oldest supported Keras is 3.15.
    """
    joined = _joined()
    if joined is None or not self._is_multi_process:
        return original(self, dataset)
    if isinstance(dataset, tf.distribute.DistributedDataset):
        return dataset
    # Keras 3.10's ModelParallel has no `auto_shard_dataset`: it shards.
    if not getattr(self, "_auto_shard_dataset", True) or not isinstance(
        dataset, tf.data.Dataset
    ):
        return original(self, dataset)
    return _cut_by_process(
        dataset,
        joined.num_processes,
        joined.process_id,
        joined.replicas_per_worker,
    )


def _cut_by_process(dataset, count, index, devices_per_process=1):
    """Process `index` of `count` takes its part of every global batch.

    Its part is the rows its devices get when a replicator splits the batch
    over every device in process order (`_device_rows`), so a batch that
    does not divide is split as under a replicator, and a process may get
    none (weighed by its count, zero).

    Raises:
        ValueError: Before any data is read: for unbatched scalars, and for
            a batch whose tensors have different static batch sizes.
    """
    specs = tf.nest.flatten(dataset.element_spec)
    if any(
        getattr(s, "shape", None) is None or s.shape.rank == 0 for s in specs
    ):
        raise ValueError(
            "The batch size of the input dataset is unknown: its elements "
            "are not batched. Batch it with its global batch size (e.g. "
            "`dataset.batch(batch_size)`); each process takes its part of "
            f"every batch. Received: element_spec={dataset.element_spec}"
        )
    sizes = sorted(
        {
            s.shape[0]
            for s in specs
            if s.shape.rank is not None and s.shape[0] is not None
        }
    )
    if len(sizes) > 1:
        raise ValueError(
            "Every tensor of a batch must have the same batch size (first "
            "dimension): each process takes the same rows of each. "
            f"Received: batch sizes={sizes}, element_spec="
            f"{dataset.element_spec}"
        )
    devices = count * devices_per_process
    first = index * devices_per_process
    known = all(
        s.shape.rank is not None and s.shape[0] is not None for s in specs
    )
    static = sizes[0] if known and sizes else None

    def cut(*element):
        element = element[0] if len(element) == 1 else element
        # A static batch (`drop_remainder=True`) is cut by Python ints: the
        # part keeps a static size, so the step's example count is static
        # and the gradients' plain mean needs no weights.
        size = (
            tf.shape(tf.nest.flatten(element)[0])[0]
            if static is None
            else static
        )
        start, stop = _device_rows(
            size, devices, first, first + devices_per_process
        )
        return tf.nest.map_structure(lambda t: t[start:stop], element)

    return dataset.map(cut).prefetch(tf.data.AUTOTUNE)


def _device_rows(size, devices, first, stop):
    """Rows `[start, end)` of devices `first` to `stop - 1` of `devices`.

    As TensorFlow's `_LegacyRebatchDataset` splits a batch of unknown size:
    device d takes rows `[d * c, (d + 1) * c)` of `size` (a scalar tensor),
    `c = ceil(size / devices)`, clipped (64 rows on 3 devices are 22, 22,
    20; 5 on 4 are 2, 2, 1, 0). Returns scalar tensors of `size`'s dtype,
    or Python ints for an int `size`.
    """
    chunk = (size + devices - 1) // devices
    if isinstance(size, int):
        return min(first * chunk, size), min(stop * chunk, size)
    return tf.minimum(first * chunk, size), tf.minimum(stop * chunk, size)


def _distribute_dataset(original, self, dataset):
    # `replicator.distribute(...)` data (our sharder) is distributed over
    # every replica of every process already; Keras would refuse it.
    if _joined() is not None and isinstance(
        dataset, tf.distribute.DistributedDataset
    ):
        return dataset
    return original(self, dataset)


def _adapter_distribute_dataset(original, self, dataset, distribution):
    """`TFDatasetAdapter._distribute_dataset` (Keras 3.16).

    Keras 3.16 (nightlies from 3.16.0.dev) cuts the batches in the `tf.data`
    adapter (the distribution's `distribute_dataset` and
    `distribute_tf_dataset` are gone); this does what 3.15's do.
    TODO: the only branch when the oldest supported Keras is 3.16.
    """
    if _joined() is None or not distribution._is_multi_process:
        return original(self, dataset, distribution)
    if isinstance(dataset, tf.distribute.DistributedDataset):
        return dataset
    return _cut_by_process(
        dataset,
        distribution._num_processes,
        distribution._process_id,
        _joined().replicas_per_worker,
    )


def _to_backend_mesh(original, device_mesh):
    return device_mesh


def _to_backend_layout(original, tensor_layout):
    if tensor_layout.device_mesh is None:
        raise ValueError(
            "Cannot create sharding when device mesh is not set for "
            f"TensorLayout. Received: layout={tensor_layout!r}"
        )
    return tensor_layout


def _set_distribution(original, value):
    strategy = None
    if value is not None:
        if _factory is None:
            raise RuntimeError(
                "keras_replicator's distribution runtime is not loaded; "
                "`import keras_replicator` first."
            )
        strategy = _factory(value)
    original(value)
    _make_current(strategy)


def _make_current(strategy) -> None:
    """Makes `strategy` (or none) the process' current strategy."""
    if _current and tf.distribute.get_strategy() is _current[-1]:
        tf.distribute.experimental_set_strategy(None)
    _current.clear()
    if strategy is not None:
        tf.distribute.experimental_set_strategy(strategy)
        _current.append(strategy)


# Every module that exports `set_distribution`: user code reaches it as
# `keras.distribution.set_distribution`, Keras' own `Distribution.scope()`
# through the defining module.
_SET_OWNERS = tuple(
    dict.fromkeys(
        (distribution_lib, keras_src_distribution, keras.distribution)
    )
)

if versions.keras_before("3.15"):
    # Keras 3.10 to 3.14: `DataParallel` and `ModelParallel` each cut the
    # dataset in their own `distribute_dataset`.
    # TODO: delete when the oldest supported Keras is 3.15.
    _DATASET_TARGETS = tuple(
        registry.Target(
            owner, "distribute_dataset", _distribute_dataset_keras_3_10
        )
        for owner in (
            distribution_lib.DataParallel,
            distribution_lib.ModelParallel,
        )
    )
elif versions.keras_before("3.16.0.dev0"):
    # Keras 3.15: `Distribution.distribute_dataset` cuts the dataset.
    _DATASET_TARGETS = (
        registry.Target(
            distribution_lib.Distribution,
            "distribute_dataset",
            _distribute_dataset,
        ),
        registry.Target(
            distribution_lib.Distribution,
            "distribute_tf_dataset",
            _distribute_tf_dataset,
        ),
    )
else:
    # Keras 3.16 (3.16.0.dev nightlies): the `tf.data` adapter cuts it.
    from keras.src.trainers.data_adapters import tf_dataset_adapter

    _DATASET_TARGETS = (
        registry.Target(
            tf_dataset_adapter.TFDatasetAdapter,
            "_distribute_dataset",
            _adapter_distribute_dataset,
        ),
    )

PATCH = registry.register(
    registry.Patch(
        name="keras_distribution",
        targets=(
            registry.Target(backend_lib, "list_devices", _list_devices),
            # Hooks the TensorFlow backend does not define.
            *(
                registry.Target(backend_lib, name, function, optional=True)
                for name, function in (
                    ("get_device_count", _get_device_count),
                    ("num_processes", _num_processes),
                    ("process_id", _process_id),
                    ("initialize", _initialize),
                    ("distribute_tensor", _distribute_tensor),
                    ("distribute_data_input", _distribute_data_input),
                )
            ),
            *_DATASET_TARGETS,
            registry.Target(backend_lib, "_to_backend_mesh", _to_backend_mesh),
            registry.Target(
                backend_lib, "_to_backend_layout", _to_backend_layout
            ),
            *(
                registry.Target(owner, "set_distribution", _set_distribution)
                for owner in _SET_OWNERS
            ),
        ),
        # Installed at import (`distribution/__init__.py`), not by a kind.
        applies_to=frozenset(),
        pins=(
            registry.Pin(
                "keras.src.distribution.distribution_lib",
                (
                    "set_distribution(self)",
                    "return distribution_lib.distribute_tensor(tensor, layout)",
                ),
            ),
            registry.Pin(
                "keras.src.distribution.distribution_lib",
                (
                    "self._num_processes = distribution_lib.num_processes()",
                    "self._process_id = distribution_lib.process_id()",
                ),
                keras=">=3.15",
            ),
            registry.Pin(
                "keras.src.distribution.distribution_lib",
                (
                    "return self.distribute_tf_dataset(dataset)",
                    "def distribute_tf_dataset(self, dataset):",
                ),
                keras=">=3.15,<3.16.0.dev0",
            ),
            registry.Pin(
                "keras.src.trainers.data_adapters.tf_dataset_adapter",
                (
                    "if distribution is not None and "
                    "distribution.auto_shard_dataset:",
                    "dataset = self._distribute_dataset(dataset, distribution)",
                    "def _distribute_dataset(self, dataset, distribution):",
                ),
                keras=">=3.16.0.dev0",
            ),
            registry.Pin(
                "keras.src.distribution.distribution_lib",
                (
                    "self._num_process = distribution_lib.num_processes()",
                    "self._is_multi_process = self._num_process > 1",
                    "def distribute_dataset(self, dataset):",
                    "distributed_dataset = dataset.rebatch(",
                ),
                keras="<3.15",
            ),
            registry.Pin(
                "keras.src.backend.tensorflow.distribution_lib",
                ("def list_devices(device_type=None):",),
            ),
            # `_in_layer_call`: a layer's output hint is applied while its
            # call context is open.
            registry.Pin(
                "keras.src.layers.layer",
                (
                    "layout = distribution.get_tensor_layout("
                    "current_layer_path)",
                    "layer_call_ctx = global_state.get_global_attribute("
                    '"current_call_ctx")',
                ),
            ),
        ),
        delete_when=(
            "Keras' TensorFlow backend implements `keras.distribution` "
            "(keras-team/keras#18473)"
        ),
    )
)
