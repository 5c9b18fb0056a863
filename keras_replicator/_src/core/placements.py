"""Which Keras variables are stored sharded, and how reads resolve: a leaf.

`keras.distribution.ModelParallel` stores a variable its layout map splits as
one block per device (`sharding/sharded.py`), its `sharding.layout.Placement`
in `ATTR`. Patches ask here rather than import the distribution package
(which imports replicators). In a replica step a sharded variable reads as
its gathered full value, except while an optimizer updates it: then reads and
writes touch the replica's own block (`local_reads`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable
from typing import Any

ATTR = "_keras_replicator_placement"
# Attribute of a replicator: the `keras.distribution` Distribution it runs.
DISTRIBUTION_ATTR = "_keras_distribution"

_local = threading.local()


def of(variable: Any) -> Any:
    """The `Placement` of a sharded Keras variable, else None."""
    return getattr(variable, ATTR, None)


def any_sharded(variables: Iterable[Any]) -> bool:
    """Whether any of `variables` is stored sharded."""
    return any(of(v) is not None for v in variables)


@contextlib.contextmanager
def local_reads():
    """While open (on this thread), sharded variables read their own block."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def reading_locally() -> bool:
    """Whether `local_reads` is open on this thread."""
    return bool(getattr(_local, "depth", 0))
