"""keras.io's "Image classification from scratch" convnet, as users write it.

`make_model` of keras-io/examples/vision/image_classification_from_scratch
.py (fchollet, 2020; its Xception-like network of `Conv2D`,
`SeparableConv2D`, `BatchNormalization` and residual adds), and its
`compile`, unchanged but for sizes a CPU test can afford: the block widths
are a parameter (the example's are 128, 256, 512, 728 and 1024), the
images 32 x 32, and the dropout rate a parameter so that a test can
compare with one device (each replica draws its own mask; the example's
rate is 0.25). The data are generated images of two classes in a
`tf.data` pipeline, batched as the example batches its dataset.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import layers

IMAGE_SIZE = (32, 32)
# The example's widths, scaled down 16 times.
WIDTHS = (8, 16, 32, 46, 64)


def make_model(input_shape, num_classes, widths=WIDTHS, dropout=0.25):
    first, *blocks, last = widths
    inputs = keras.Input(shape=input_shape)

    # Entry block
    x = layers.Rescaling(1.0 / 255)(inputs)
    x = layers.Conv2D(first, 3, strides=2, padding="same")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)

    previous_block_activation = x  # Set aside residual

    for size in blocks:
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(size, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)

        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(size, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)

        x = layers.MaxPooling2D(3, strides=2, padding="same")(x)

        # Project residual
        residual = layers.Conv2D(size, 1, strides=2, padding="same")(
            previous_block_activation
        )
        x = layers.add([x, residual])  # Add back residual
        previous_block_activation = x  # Set aside next residual

    x = layers.SeparableConv2D(last, 3, padding="same")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)

    x = layers.GlobalAveragePooling2D()(x)
    if num_classes == 2:
        units = 1
    else:
        units = num_classes

    x = layers.Dropout(dropout)(x)
    # We specify activation=None so as to return logits
    outputs = layers.Dense(units, activation=None)(x)
    return keras.Model(inputs, outputs)


def compile_model(model):
    model.compile(
        optimizer=keras.optimizers.Adam(3e-4),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[keras.metrics.BinaryAccuracy(name="acc")],
    )


def dataset(n=64, batch_size=16, seed=0):
    """Images of two classes: brighter ones are class 1."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, size=(n,)).astype("float32")
    images = rng.uniform(0, 160, size=(n, *IMAGE_SIZE, 3)).astype("float32")
    images += 80.0 * labels[:, None, None, None]
    return tf.data.Dataset.from_tensor_slices((images, labels)).batch(
        batch_size
    )


def train(scope=None, epochs=1, seed=1, dropout=0.0):
    """Builds (in `scope`), compiles and fits; returns history and weights."""
    keras.utils.set_random_seed(seed)
    with scope if scope is not None else _Nothing():
        model = make_model(IMAGE_SIZE + (3,), num_classes=2, dropout=dropout)
        compile_model(model)
    history = model.fit(dataset(), epochs=epochs, verbose=0, shuffle=False)
    return history.history, [np.array(w) for w in model.get_weights()]


# A bias followed by `BatchNormalization` has a gradient of exactly zero in
# exact arithmetic (the layer subtracts the batch mean): in floats it is
# noise of about 1e-9 whose sign depends on the order of the sums, which
# any split batch changes, and Adam turns that noise into steps of up to
# its learning rate, on one device too. Those weights are compared to
# within Adam's steps (its rate, 4 steps, either sign); the loss and every
# other weight to 1e-5.
ADAM_STEPS = 2 * 3e-4 * 4


def zero_gradient_weights():
    """Indices (in `model.weights`) of weights of zero exact gradient."""
    keras.utils.set_random_seed(1)
    model = make_model(IMAGE_SIZE + (3,), 2, dropout=0.0)
    x, y = next(iter(dataset()))
    loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True)[:, 0])
    grads = tape.gradient(loss, model.trainable_variables)
    ids = {
        id(v)
        for v, g in zip(model.trainable_variables, grads, strict=True)
        if float(tf.reduce_max(tf.abs(g))) < 1e-6
    }
    return [i for i, w in enumerate(model.weights) if id(w) in ids]


def assert_one_devices(history, weights, reference, zero_gradients):
    """`train`'s outputs against one device's (see `ADAM_STEPS`)."""
    h0, w0 = reference
    np.testing.assert_allclose(history["loss"], h0["loss"], rtol=1e-5)
    np.testing.assert_allclose(history["acc"], h0["acc"], atol=1e-6)
    for i, (a, b) in enumerate(zip(weights, w0, strict=True)):
        atol = ADAM_STEPS if i in zero_gradients else 1e-5
        np.testing.assert_allclose(a, b, rtol=0, atol=atol, err_msg=str(i))


def farthest(weights, reference) -> float:
    """The largest difference of any weight from `reference`'s."""
    return max(
        float(np.max(np.abs(np.asarray(a) - b)))
        for a, b in zip(weights, reference[1], strict=True)
    )


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *args):
        return False
