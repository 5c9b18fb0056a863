"""Models with BatchNormalization for the SyncBatchNorm tests.

It imports Keras only, never keras_replicator: the saved-model test loads
these models in a fresh process that must not import keras_replicator.
"""

import keras

INPUT_SHAPE = (6, 6, 2)


def sequential():
    return keras.Sequential(
        [
            keras.Input(INPUT_SHAPE),
            keras.layers.Conv2D(3, 3),
            keras.layers.BatchNormalization(momentum=0.5),
            keras.layers.Flatten(),
            keras.layers.Dense(1),
        ],
        name="sequential_bn",
    )


def functional():
    inputs = keras.Input(INPUT_SHAPE)
    x = keras.layers.Conv2D(3, 3)(inputs)
    a = keras.layers.BatchNormalization(momentum=0.5)(x)
    b = keras.layers.BatchNormalization(momentum=0.9, center=False)(x)
    x = keras.layers.Concatenate()([a, b])
    outputs = keras.layers.Dense(1)(keras.layers.Flatten()(x))
    return keras.Model(inputs, outputs, name="functional_bn")


@keras.saving.register_keras_serializable(package="kr_tests")
class Block(keras.layers.Layer):
    """A conv + BN block: the BN layer is nested one level down."""

    def __init__(self, filters, **kwargs):
        super().__init__(**kwargs)
        self.filters = filters
        self.conv = keras.layers.Conv2D(filters, 3)
        self.bn = keras.layers.BatchNormalization(momentum=0.5)

    def call(self, x, training=None):
        return keras.ops.relu(self.bn(self.conv(x), training=training))

    def get_config(self):
        return {**super().get_config(), "filters": self.filters}


@keras.saving.register_keras_serializable(package="kr_tests")
class Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = Block(3)
        self.flatten = keras.layers.Flatten()
        self.head = keras.layers.Dense(1)

    def call(self, x, training=None):
        return self.head(self.flatten(self.block(x, training=training)))


def subclassed():
    model = Subclassed(name="subclassed_bn")
    model(keras.ops.zeros((1, *INPUT_SHAPE)))
    return model


BUILDERS = {
    "sequential": sequential,
    "functional": functional,
    "subclassed": subclassed,
}
