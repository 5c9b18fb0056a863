"""What a `LayoutMap` did to a model: a report, and warnings for what it missed.

Keras matches a `LayoutMap` key against a variable's path with
`re.fullmatch` (an exact key first), so a key can silently match nothing: the
guide's `"d1/kernel"` works on its Functional model, but a `Sequential`
model's path is `sequential/d1/kernel`. `layout_report` shows each
variable's key and block; `warn_once`, at a model's first `fit` under
`ModelParallel`, logs what the map missed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import weakref
from typing import Any

import keras
import numpy as np

from keras_replicator._src.core import placements
from keras_replicator._src.sharding import auto_layout

# Variables above this many bytes that no key matches are warned about.
LARGE_BYTES = 1 << 20
_logger = logging.getLogger("keras_replicator")
_warned: weakref.WeakSet = weakref.WeakSet()


@dataclasses.dataclass(frozen=True)
class Row:
    """One variable: its path, full shape, the key it matched, its block.

    An optimizer slot's `key` is that of the variable it was made from, whose
    layout it has. `rule`: under `kr.auto_layout_map`, for a variable no key
    matched, the rule that split it or why it is whole (`auto_layout.Decision`).
    """

    path: str
    shape: tuple[int, ...]
    key: str | None
    block: tuple[int, ...]
    bytes_per_device: int
    optimizer: bool
    rule: str | None = None


@dataclasses.dataclass(frozen=True)
class LayoutReport:
    """Every variable's placement and the totals each device holds.

    Attributes:
        rows: One `Row` per model and optimizer variable.
        weights_bytes: The model's variables' bytes on each device.
        optimizer_bytes: The optimizer's variables' bytes on each device.
        largest_gather_bytes: The largest sharded variable's bytes: the
            largest transient a step gathers on each device.
        unmatched_keys: Layout map keys that matched no variable, less
            layer-output keys (`"<layer path>/output"`: activations).
    """

    rows: tuple[Row, ...]
    weights_bytes: int
    optimizer_bytes: int
    largest_gather_bytes: int
    unmatched_keys: tuple[str, ...]

    def __str__(self) -> str:
        """The table: one line per variable, then the totals per device."""
        header = ("variable", "shape", "key", "per device", "bytes")
        cells = [
            (
                r.path,
                str(r.shape),
                r.key or r.rule or "-",
                str(r.block),
                f"{r.bytes_per_device:,}",
            )
            for r in self.rows
        ]
        widths = [
            max(len(row[i]) for row in [header, *cells])
            for i in range(len(header))
        ]

        def line(row):
            left = [
                f"{c:<{w}}" for c, w in zip(row[:-1], widths[:-1], strict=True)
            ]
            return "  ".join([*left, f"{row[-1]:>{widths[-1]}}"])

        lines = [line(header), *(line(row) for row in cells)]
        lines.append(
            f"per device: weights {self.weights_bytes:,} B, optimizer "
            f"{self.optimizer_bytes:,} B, largest gathered transient "
            f"{self.largest_gather_bytes:,} B"
        )
        if self.unmatched_keys:
            lines.append(f"keys that matched nothing: {self.unmatched_keys}")
        return "\n".join(lines)


def _layout_map():
    distribution = keras.distribution.distribution()
    return getattr(distribution, "_layout_map", None)


def matched_key(layout_map, path: str) -> str | None:
    """The key Keras' `LayoutMap` uses for `path`, or None."""
    if layout_map is None:
        return None
    keys = list(layout_map.keys())
    if path in keys:
        return path
    found = [k for k in keys if re.fullmatch(k, path)]
    return found[0] if len(found) == 1 else None


def _nbytes(shape, variable) -> int:
    inner = getattr(variable, "_value", variable)
    return math.prod(shape) * np.dtype(inner.dtype.as_numpy_dtype).itemsize


def _reference(slot, weights) -> Any:
    """The model variable an optimizer slot was made from, or None.

    Keras names a slot `<reference path, "/" as "_">_<slot name>` and gives
    it the reference's layout (`add_variable_from_reference`); the longest
    such prefix wins (`d1_kernel` over `d1`).
    """
    found = [w for w in weights if slot.name.startswith(_slot_prefix(w.path))]
    return max(found, key=lambda w: len(w.path), default=None)


def _slot_prefix(path: str) -> str:
    return path.replace("/", "_") + "_"


def _row(variable, layout_map, optimizer: bool, weights=()) -> Row:
    shape = tuple(int(d) for d in variable.shape)
    placement = placements.of(variable)
    block = placement.local_shape if placement is not None else shape
    key = matched_key(layout_map, variable.path)
    decision = auto_layout.decision(layout_map, variable.path)
    if key is None and optimizer:
        reference = _reference(variable, weights)
        if reference is not None:
            key = matched_key(layout_map, reference.path)
            decision = auto_layout.decision(layout_map, reference.path)
    return Row(
        path=variable.path,
        shape=shape,
        key=key,
        block=tuple(block),
        bytes_per_device=_nbytes(block, variable),
        optimizer=optimizer,
        rule=str(decision) if key is None and decision is not None else None,
    )


def _names_an_output(key: str, model: Any) -> bool:
    """Whether `key` is, or fully matches, a `"<layer path>/output"` hint."""
    for layer in model._flatten_layers(include_self=True, recursive=True):
        path = f"{layer.path}/output"
        if key == path:
            return True
        try:
            if re.fullmatch(key, path):
                return True
        except re.error:
            return False
    return False


def layout_report(model: Any, print_fn=None) -> LayoutReport:
    """Reports where every variable of `model` lives, and the totals.

    Per model and optimizer variable: its path, full shape, the `LayoutMap`
    key that matched it (or `-`; a slot shows its variable's), its block per
    device and the bytes; then per device the weights, the optimizer state
    and the largest full value a step gathers. Under no distribution or
    `DataParallel` every variable is whole. The report's `str` is the table;
    as with `model.summary()`, only `print_fn` prints.

    Example:
    ```python
    report = kr.layout_report(model)
    print(report)  # the table
    report.weights_bytes  # bytes of weights on each device
    kr.layout_report(model, print_fn=print)  # prints the table itself
    ```

    Args:
        model: A built Keras model.
        print_fn: Called once with the report's text (`print`, a logger's
            `info`, `lines.append`). Defaults to None: nothing is printed.

    Returns:
        A `LayoutReport`.

    Raises:
        ValueError: If `model` is not built.
    """
    if not getattr(model, "built", False):
        raise ValueError(
            "`layout_report` needs a built model (its variables exist once "
            f"it is built). Received: model={model!r}"
        )
    layout_map = _layout_map()
    rows = [_row(v, layout_map, False) for v in model.weights]
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and optimizer.built:
        rows += [
            _row(v, layout_map, True, model.weights)
            for v in optimizer.variables
        ]
    used = {r.key for r in rows if r.key is not None}
    keys = tuple(layout_map.keys()) if layout_map is not None else ()
    sharded = [
        _nbytes(r.shape, v)
        for r, v in zip(rows, _variables(model), strict=True)
        if r.block != r.shape
    ]
    report = LayoutReport(
        rows=tuple(rows),
        weights_bytes=sum(r.bytes_per_device for r in rows if not r.optimizer),
        optimizer_bytes=sum(r.bytes_per_device for r in rows if r.optimizer),
        largest_gather_bytes=max(sharded, default=0),
        unmatched_keys=tuple(
            k for k in keys if k not in used and not _names_an_output(k, model)
        ),
    )
    if print_fn is not None:
        print_fn(str(report))
    return report


def _variables(model):
    found = list(model.weights)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and optimizer.built:
        found += list(optimizer.variables)
    return found


def warn_once(model: Any, large_bytes: int = LARGE_BYTES) -> None:
    """Logs, once per model, what its `ModelParallel` layout map missed.

    Keys that matched no variable; variables over `large_bytes` (1 MiB) that
    no key matched, whole on every device; variables a key matched whose
    layout splits nothing. Nothing under other distributions.
    """
    layout_map = _layout_map()
    if layout_map is None or model in _warned:
        return
    _warned.add(model)
    report = layout_report(model, print_fn=None)
    problems = []
    if report.unmatched_keys:
        problems.append(
            f"layout map keys that matched no variable (Keras matches a key "
            f"against the whole path, e.g. 'sequential/d1/kernel'; '.*d1/"
            f"kernel' matches it): {list(report.unmatched_keys)}"
        )
    whole = [r for r in report.rows if r.block == r.shape]
    large = [
        f"{r.path} {r.shape} ({r.bytes_per_device / 2**20:.1f} MiB)"
        for r in whole
        if r.key is None
        and not r.optimizer
        and r.bytes_per_device > large_bytes
    ]
    if large:
        problems.append(
            f"variables over {large_bytes / 2**20:g} MB that no key matched "
            f"stay whole on every device: {large}"
        )
    unsplit = [r.path for r in whole if r.key is not None and not r.optimizer]
    if unsplit:
        problems.append(
            f"variables a key matched whose layout splits nothing: {unsplit}"
        )
    if problems:
        _logger.warning(
            "keras-replicator: the ModelParallel layout map of %s: %s. See "
            "`kr.layout_report(model)`.",
            getattr(model, "name", model),
            "; ".join(problems),
        )
