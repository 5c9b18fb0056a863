"""Layers given another method for the length of a block, in place.

`fit` under `keras.distribution` computes some layers as JAX does over the
whole mesh (`BatchNormalization`'s moments, `Dropout`'s masks) without
changing the model the user holds: each layer gets an instance attribute
that shadows one method while the block is open, and loses it after.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any


@contextlib.contextmanager
def overridden(
    model: Any, layers: Sequence[Any], name: str, function: Callable
):
    """While open, `layer.<name>` is `functools.partial(function, layer)`.

    An instance attribute, which Keras' tracking neither sees nor saves.
    The model's train function is traced anew on entry and on exit (when
    there are layers), so a `fit` inside the block uses the override and a
    later `fit` outside it does not.

    Args:
        model: The Keras model the layers belong to.
        layers: The layers to change (none: nothing happens).
        name: The method's name.
        function: `function(layer, *args, **kwargs)`.

    Yields:
        `layers`.
    """
    if not layers:
        yield layers
        return
    for layer in layers:
        object.__setattr__(layer, name, functools.partial(function, layer))
    model.train_function = None
    try:
        yield layers
    finally:
        for layer in layers:
            if name in vars(layer):
                object.__delattr__(layer, name)
        model.train_function = None
