"""A `LayoutMap` that lays out what no key matches, by shape and layer.

`keras.distribution.ModelParallel` needs a `LayoutMap` whose keys (regexes on
variable paths) say how each weight is split. keras-hub ships one for a few
backbones; for any other model someone must write the regexes, and a renamed
layer silently stops matching, so the model loads whole on every device
(keras-hub #2806).

`AutoLayoutMap` lays out each variable no key matches as it is created, by
the rule `auto_layout_map` states, from its shape, dtype, name and layer (the
caller of the name scope `Layer.add_weight` opens). A free (output) dimension
is split where there is one, so a product by the sharded kernel moves rows,
not the kernel (`contraction.py`).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any

import keras
import numpy as np

from keras_replicator._src.upstream import global_state

DEFAULT_MIN_BYTES = 1 << 20

_local = threading.local()

_CONVOLUTIONS = (
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.Conv3D,
    keras.layers.Conv1DTranspose,
    keras.layers.Conv2DTranspose,
    keras.layers.Conv3DTranspose,
    keras.layers.DepthwiseConv1D,
    keras.layers.DepthwiseConv2D,
    keras.layers.SeparableConv1D,
    keras.layers.SeparableConv2D,
)


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the automatic rule made of one variable.

    Attributes:
        rule: The rule that applied (e.g. `"dense out"`).
        dim: The dimension split along the model axis, or None (whole).
        reason: Why it stays whole, when `dim` is None.
    """

    path: str
    shape: tuple[int, ...]
    rule: str
    dim: int | None
    reason: str | None = None

    def __str__(self) -> str:
        if self.dim is None:
            return f"whole: {self.reason}"
        return f"auto: {self.rule} (dim {self.dim})"


class AutoLayoutMap(keras.distribution.LayoutMap):
    """A `LayoutMap` that lays out every variable no key matches.

    Made by `auto_layout_map`; see there.
    """

    def __init__(
        self,
        device_mesh: Any,
        *,
        min_bytes: int = DEFAULT_MIN_BYTES,
        model_dim_name: str = "model",
    ):
        if not isinstance(device_mesh, keras.distribution.DeviceMesh):
            raise TypeError(
                "`auto_layout_map` takes a `keras.distribution.DeviceMesh`. "
                f"Received: mesh={device_mesh!r} (of type "
                f"{type(device_mesh).__name__})"
            )
        if model_dim_name not in device_mesh.axis_names:
            raise ValueError(
                "`model_dim_name` must be an axis of the mesh; the mesh has "
                f"axes {tuple(device_mesh.axis_names)}. Received: "
                f"model_dim_name={model_dim_name!r}"
            )
        if (
            isinstance(min_bytes, bool)
            or not isinstance(min_bytes, (int, np.integer))
            or min_bytes < 1
        ):
            raise ValueError(
                "`min_bytes` must be a positive integer (bytes). "
                f"Received: min_bytes={min_bytes!r}"
            )
        super().__init__(device_mesh)
        self.min_bytes = int(min_bytes)
        self.model_dim_name = model_dim_name
        axis = list(device_mesh.axis_names).index(model_dim_name)
        self._devices = int(device_mesh.shape[axis])
        # Path -> `Decision` of the last variable the rule laid out there.
        self.decisions: dict[str, Decision] = {}

    def __getitem__(self, key: str):
        layout = super().__getitem__(key)
        if layout is not None:
            return layout
        creating = getattr(_local, "creating", None)
        if creating is not None and creating[0].path == key:
            decision = self.decide(*creating)
            self.decisions[key] = decision
            if decision.dim is None:
                return None
            axes = [None] * len(decision.shape)
            axes[decision.dim] = self.model_dim_name
            return keras.distribution.TensorLayout(
                tuple(axes), self.device_mesh
            )
        return None

    def decide(self, variable: Any, shape, layer: Any = None) -> Decision:
        """The rule's decision for `variable` of `shape`, made by `layer`."""
        shape = tuple(int(d) for d in shape)
        path = variable.path

        def whole(reason, rule="-"):
            return Decision(path, shape, rule, None, reason)

        if not shape:
            return whole("a scalar")
        if not variable.trainable:
            return whole("not trainable")
        if getattr(variable, "synchronization", None) == "on_read":
            return whole("on-read")
        dtype = np.dtype(keras.backend.standardize_dtype(variable.dtype))
        if not np.issubdtype(dtype, np.floating) and dtype.name != "bfloat16":
            return whole(f"{dtype.name}, not a float")
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.min_bytes:
            return whole(f"{nbytes:,} B < min_bytes")
        if self._devices == 1:
            return whole(f"{self.model_dim_name!r} axis has 1 device")
        rule, order = _preference(variable.name, shape, layer)
        for dim in order:
            if shape[dim] % self._devices == 0:
                return Decision(path, shape, rule, dim)
        return whole(f"no dimension divisible by {self._devices}", rule)


def _preference(name: str, shape, layer) -> tuple[str, list[int]]:
    """The rule's name and its dimensions, most preferred first."""
    rank = len(shape)
    last_first = list(range(rank - 1, -1, -1))
    if isinstance(layer, keras.layers.Embedding) and rank == 2:
        # `reverse_embeddings` are `(hidden, vocabulary)`. A table split by
        # the vocabulary gives each replica its own block of lookups and of
        # tied logits (`matmul(x, transpose(table))`).
        vocab = 1 if name == "reverse_embeddings" else 0
        label = "logits" if name == "reverse_embeddings" else "embedding"
        return f"{label} vocabulary", [vocab, 1 - vocab]
    experts = getattr(layer, "num_experts", None)
    if rank >= 3 and experts is not None and shape[0] == experts:
        return "expert stack", [0] + last_first[:-1]
    if isinstance(layer, keras.layers.EinsumDense) and name == "kernel":
        labels = _einsum_kernel_labels(layer.equation, rank)
        if labels is not None:
            k_labels, out_labels = labels
            free = [d for d, lab in enumerate(k_labels) if lab in out_labels]
            contracted = [d for d in range(rank) if d not in free]
            return "einsum output", free + contracted
    if isinstance(layer, keras.layers.Dense) and name == "kernel" and rank == 2:
        return "dense out", [1, 0]
    if isinstance(layer, _CONVOLUTIONS) and name.endswith("kernel"):
        return "conv channels", [rank - 1, rank - 2] if rank >= 2 else [0]
    return "by shape", last_first


def _einsum_kernel_labels(equation, rank):
    """`(kernel labels, output labels)` of `"x,kernel->out"`, or None."""
    if not isinstance(equation, str) or "->" not in equation:
        return None
    inputs, out = equation.replace(" ", "").split("->")
    parts = inputs.split(",")
    if len(parts) != 2 or len(parts[1]) != rank or "." in parts[1]:
        return None
    return parts[1], out


class laying_out:  # noqa: N801 (a context manager, named as one)
    """While open, `AutoLayoutMap` lays out `variable` of `shape`.

    `sharded.sharding_strategy` opens it around Keras' layout lookup, which
    passes the map only the variable's path; the layer is the caller of the
    innermost name scope.
    """

    def __init__(self, variable: Any, shape):
        stack = global_state.get_global_attribute("name_scope_stack") or []
        caller = stack[-1].caller if stack else None
        layer = caller if isinstance(caller, keras.layers.Layer) else None
        self._creating = (variable, shape, layer)

    def __enter__(self):
        self._saved = getattr(_local, "creating", None)
        _local.creating = self._creating
        return self

    def __exit__(self, *exc):
        _local.creating = self._saved


def auto_layout_map(
    mesh: Any,
    *,
    min_bytes: int = DEFAULT_MIN_BYTES,
    model_dim_name: str = "model",
) -> AutoLayoutMap:
    """A `LayoutMap` that splits every large weight, with no keys written.

    Pass it to `ModelParallel` as a hand-written map. Keys you set on it win,
    as on any `LayoutMap`; every other variable is laid out when created. A
    trainable float variable of at least `min_bytes` is split along the
    `model_dim_name` axis on one dimension that axis divides, chosen so that a
    product by the split kernel moves rows rather than the kernel and each
    replica computes its own block of outputs: an embedding's vocabulary (of
    tied or untied logits too), a `Dense` kernel's output dimension, an
    `EinsumDense` kernel's output labels (attention heads before the head
    size), the experts of a layer with `num_experts`, a convolution kernel's
    channels, else the last dimension that divides. Smaller, non-trainable and
    non-float variables, and those no dimension of which the axis divides,
    stay whole on every device. Other mesh axes (a `"batch"` axis) split the
    batch, as with any map.

    The rule reads only the variable and its layer, so every process makes
    the same layout. `kr.layout_report(model)` names, per variable, the key or
    rule that laid it out, or why it is whole; the map's `decisions` holds the
    same per path.

    Example:
    ```python
    mesh = keras.distribution.DeviceMesh(
        (1, 4), ("batch", "model"), keras.distribution.list_devices()
    )
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=kr.auto_layout_map(mesh), batch_dim_name="batch"
        )
    )
    ```

    Args:
        mesh: The `keras.distribution.DeviceMesh` of the `ModelParallel`.
        min_bytes: Variables of fewer bytes stay whole. Defaults to
            `1 << 20` (1 MiB).
        model_dim_name: The mesh axis that splits weights. Defaults to
            `"model"`.

    Returns:
        An `AutoLayoutMap` (a `keras.distribution.LayoutMap`).

    Raises:
        TypeError: If `mesh` is not a `DeviceMesh`.
        ValueError: If `model_dim_name` is not an axis of `mesh`, or
            `min_bytes` is not a positive integer.
    """
    return AutoLayoutMap(
        mesh, min_bytes=min_bytes, model_dim_name=model_dim_name
    )


def decision(layout_map: Any, path: str) -> Decision | None:
    """The rule's decision for the variable at `path`, if it made one."""
    decisions = getattr(layout_map, "decisions", None)
    return None if decisions is None else decisions.get(path)
