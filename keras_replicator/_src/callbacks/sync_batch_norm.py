"""SyncBatchNorm: cross-replica batch norm for a model, no code changes.

The callback converts the model's `BatchNormalization` layers *in place*
for the duration of `fit`: each layer keeps its class, config and weights,
and only its moment computation (the private `_moments(inputs, mask)` that
Keras' `BatchNormalization.call` calls in training mode) is replaced by the
single-all-reduce cross-replica version of `CrossReplicaBatchNormalization`.

Why in place rather than swapping in new layer objects:

- The model's structure, layer names, weights, optimizer slots and any
  references the user holds stay valid; nothing is rebuilt or copied.
- A model saved afterwards is a plain Keras model: its layers are still
  `keras.layers.BatchNormalization` with the user's config, so the `.keras`
  file loads with Keras alone (no `keras_replicator` import, no custom
  object), with the trained moving statistics.
- It works the same for Sequential, functional and subclassed models, and
  for BN layers nested in other layers, which cannot be swapped generically.

The price is reliance on a private Keras method; `tests/test_sync_batch_norm`
checks that Keras still calls it, so an upgrade that changes it fails loudly.
"""

from __future__ import annotations

import functools
import warnings

import keras

from keras_replicator._src.layers import cross_replica_batch_norm as crbn

# The Keras source line this module relies on (keras/src/layers/
# normalization/batch_normalization.py, BatchNormalization.call).
KERAS_MOMENTS_CALL = "mean, variance = self._moments(inputs, mask)"
_NO_BN_WARNING = (
    "SyncBatchNorm found no BatchNormalization layer in model {name!r}; it "
    "does nothing for this model."
)


class SyncBatchNorm(keras.callbacks.Callback):
    """Makes every `BatchNormalization` of the model cross-replica in `fit`.

    At train begin it converts each `keras.layers.BatchNormalization` of the
    model, nested models and layers included, so that its training-mode
    statistics cover the global batch of all replicas and workers (one
    all-reduce per layer and step, see `CrossReplicaBatchNormalization`),
    and rebuilds the train function so the change takes effect even if the
    model was trained before. At train end it restores the layers and drops
    the train function, so a later `fit` without this callback is plain
    Keras again. Inference (`evaluate`, `predict`) is unchanged: BN then
    uses its moving statistics, which are identical on every replica.

    The layers keep their class and config, so the trained model saves and
    loads as a plain Keras model.

    Position in the callback list: anywhere. It only acts at train begin
    and train end and does not read or write `logs`.

    On a model without any `BatchNormalization` it warns once (per callback
    instance) and does nothing.

    Example:
    ```python
    replicator = kr.LocalReplicator(num_replicas=2)
    with replicator.scope():
        model = keras.Sequential([
            keras.Input((4,)),
            keras.layers.Dense(8),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(1),
        ])
        model.compile("sgd", "mse")
    model.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=4, verbose=0,
              callbacks=[kr.callbacks.SyncBatchNorm()])
    ```
    """

    def __init__(self):
        super().__init__()
        self._converted = []
        self._warned = False

    @property
    def converted_layers(self) -> tuple:
        """The BN layers converted for the current `fit` (empty outside)."""
        return tuple(self._converted)

    def on_train_begin(self, logs=None):
        """Converts the BN layers and rebuilds the train function."""
        layers = batch_norm_layers(self.model)
        if not layers:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    _NO_BN_WARNING.format(name=self.model.name), stacklevel=2
                )
            return
        for layer in layers:
            if isinstance(layer, crbn.CrossReplicaBatchNormalization):
                continue  # Already cross-replica.
            if "_moments" in vars(layer):
                # Converted already: by another SyncBatchNorm in this fit, or
                # by one whose fit raised (Keras then skips on_train_end).
                # Adopt it, so this callback's on_train_end restores it.
                self._converted.append(layer)
                continue
            # object.__setattr__: an instance attribute Keras' attribute
            # tracking neither sees nor serializes.
            object.__setattr__(
                layer, "_moments", functools.partial(crbn.sync_moments, layer)
            )
            self._converted.append(layer)
        if self._converted:
            # fit() made the train function before on_train_begin; it may
            # even be traced already (an earlier fit). Trace it anew.
            self.model.make_train_function(force=True)

    def on_train_end(self, logs=None):
        """Restores the layers' own moments; the next fit retraces."""
        if not self._converted:
            return
        for layer in self._converted:
            if "_moments" in vars(layer):  # Two callbacks may share a layer.
                object.__delattr__(layer, "_moments")
        self._converted = []
        # The traced function still holds the cross-replica moments.
        self.model.train_function = None


def batch_norm_layers(model: keras.layers.Layer) -> list:
    """Every `BatchNormalization` in `model`, nested ones included, once.

    Args:
        model: A Keras model or layer.

    Returns:
        The BN layers in Keras' depth-first tracking order.
    """
    return [
        layer
        for layer in model._flatten_layers(include_self=True, recursive=True)
        if isinstance(layer, keras.layers.BatchNormalization)
    ]
