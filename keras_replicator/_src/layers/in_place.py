"""Layers that compute as JAX does under `keras.distribution`, in place.

`fit` under `keras.distribution` computes some layers over the whole mesh,
as JAX's one program does (`BatchNormalization`'s moments, `Dropout`'s
masks), without changing the model the user holds: each such layer gets
an instance attribute that shadows one method. The override decides
while the step is traced: under the replicator of a `keras.distribution`
it computes over the global batch, anywhere else it is the stock method.
So it stays installed: the model's train function is traced anew only
when an override is added, not at every `fit`.
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

    An instance attribute, which Keras' tracking neither sees nor saves.

    Args:
        layers: The layers.
        name: The method's name.
        function: `function(layer, *args, **kwargs)`; it calls the stock
            method itself where it does not apply.

    Returns:
        Whether any layer got the override now (its model's train function
        must then be traced anew).
    """
    added = False
    for layer in layers:
        if name not in vars(layer):
            object.__setattr__(layer, name, functools.partial(function, layer))
            added = True
    return added
