"""Model, data and training of the fault tests (worker and reference)."""

import keras

from tests import helpers

GLOBAL_BATCH = 16
EPOCHS = 4


def build():
    keras.utils.set_random_seed(11)
    model = helpers.conv_dense_model()
    model.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
        loss="sparse_categorical_crossentropy",
    )
    return model


def train(model, callbacks=()):
    x, y = helpers.classification_data(64, seed=5)
    return model.fit(
        x,
        y,
        batch_size=GLOBAL_BATCH,
        epochs=EPOCHS,
        shuffle=False,
        callbacks=list(callbacks),
        verbose=0,
    )
