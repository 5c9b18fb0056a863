"""Layers that compute as JAX does under `keras.distribution`, in place.

`fit` under `keras.distribution` computes some layers over the whole mesh,
as JAX's one program does (BN moments, `Dropout` masks), without changing
the user's model: an instance attribute shadows one method. It decides when
traced (global under a `keras.distribution`'s replicator, else stock), so it
stays installed; the train function is retraced only when one is added.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from keras_replicator._src.core import placements


def under_distribution() -> bool:
    """Whether the strategy being traced is a `keras.distribution`'s."""
    strategy = tf.distribute.get_strategy()
    return getattr(strategy, placements.DISTRIBUTION_ATTR, None) is not None


def install(layers: Sequence[Any], name: str, function: Callable) -> bool:
    """Sets `layer.<name> = functools.partial(function, layer)` where unset.

    Keras' tracking neither sees nor saves it. `function(layer, *args,
    **kwargs)` calls the stock method itself where it does not apply.
    Returns whether any layer got it now (then retrace the train function).
    """
    added = False
    for layer in layers:
        if name not in vars(layer):
            object.__setattr__(layer, name, functools.partial(function, layer))
            added = True
    return added
