"""Marks data helpers put on datasets (they never install patches).

The exact evaluation patch (`patches/exact_eval.py`) reads them.
"""

from __future__ import annotations

import inspect
from typing import Any

# Set on a distributed dataset whose padding carries sample weight 0.
PADDED_ATTR = "_keras_replicator_padded"
# Set on a `kr.data.shard(..., mode="eval")` input function that pads.
PADDED_EVAL_ATTR = "padded_eval"


def mark_padded(distributed: Any) -> Any:
    """Marks a distributed dataset as padded by the sharder; returns it."""
    setattr(distributed, PADDED_ATTR, True)
    return distributed


def is_padded(x: Any) -> bool:
    """Whether `x` is data the sharder padded with zero-weight examples."""
    if getattr(x, PADDED_ATTR, False):
        return True
    # A user's distribute_datasets_from_function(kr.data.shard(...)).
    return bool(getattr(input_fn_of(x), PADDED_EVAL_ATTR, False))


def input_fn_of(distributed: Any) -> Any:
    """The user's input function behind our wrappers of it, or None."""
    return inspect.unwrap(getattr(distributed, "_dataset_fn", None))
