"""SyncBatchNorm: cross-replica batch norm for a model, no code changes.

During `fit` each `BatchNormalization` keeps class, config and weights; only
its private `_moments(inputs, mask)` (called by `call` in training mode)
becomes `CrossReplicaBatchNormalization`'s. In place, so structure, weights,
optimizer slots and user references stay valid, a saved `.keras` loads
without `keras_replicator`, and nested BN layers in any kind of model work
(they cannot be swapped generically). The price is a private Keras method;
`tests/test_sync_batch_norm` checks Keras still calls it.
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

    At train begin, each `keras.layers.BatchNormalization` (nested ones
    included) takes training statistics over all replicas and workers (one
    all-reduce per layer and step, see `CrossReplicaBatchNormalization`),
    and the train function is rebuilt, even if traced by an earlier fit. At
    train end the layers are restored and the train function dropped, so a
    later `fit` is plain Keras. Inference uses the moving statistics,
    identical on every replica. The model saves and loads as plain Keras.

    Any position in the callback list (it never touches `logs`). Without
    any BN layer it warns once per instance and does nothing.

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
                # Converted by another SyncBatchNorm, maybe one whose fit raised
                # (Keras skips on_train_end): adopt it, to restore it later.
                self._converted.append(layer)
                continue
            # An instance attribute Keras' tracking neither sees nor saves.
            object.__setattr__(
                layer, "_moments", functools.partial(crbn.sync_moments, layer)
            )
            self._converted.append(layer)
        if self._converted:
            # fit() made (maybe traced) the train function already: remake.
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
    """Every `BatchNormalization` in a model or layer, nested ones, once.

    In Keras' depth-first tracking order.
    """
    return [
        layer
        for layer in model._flatten_layers(include_self=True, recursive=True)
        if isinstance(layer, keras.layers.BatchNormalization)
    ]
