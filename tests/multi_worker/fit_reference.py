"""The model, data and training of the multi-worker fit tests.

Shared by the worker script and the single-process reference, so both run
exactly the same Keras code. Data order: the arrays are fed unshuffled with
the GLOBAL batch size; Keras batches them globally and the replicator splits
each global batch over all replicas of all workers, so step t sees the same
examples as step t of the single-process run.
"""

import os

import keras

from tests import helpers

GLOBAL_BATCH = 16
EPOCHS = 2


def build():
    keras.utils.set_random_seed(7)
    model = helpers.conv_dense_model()
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.5),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy", keras.metrics.SparseCategoricalCrossentropy()],
    )
    return model


def data():
    x, y = helpers.classification_data(64, seed=3)
    x_val, y_val = helpers.classification_data(32, seed=4)
    return (x, y), (x_val, y_val)


def file_callbacks(out_dir):
    """Every file-writing Keras callback, writing under `out_dir`."""
    return [
        keras.callbacks.ModelCheckpoint(
            os.path.join(out_dir, "ckpt.weights.h5"), save_weights_only=True
        ),
        keras.callbacks.CSVLogger(os.path.join(out_dir, "log.csv")),
        keras.callbacks.TensorBoard(os.path.join(out_dir, "tb")),
        keras.callbacks.BackupAndRestore(
            os.path.join(out_dir, "backup"), delete_checkpoint=False
        ),
    ]


def train(model, callbacks=()):
    (x, y), (x_val, y_val) = data()
    history = model.fit(
        x,
        y,
        batch_size=GLOBAL_BATCH,
        epochs=EPOCHS,
        shuffle=False,
        validation_data=(x_val, y_val),
        callbacks=list(callbacks),
        verbose=0,
    )
    evaluation = model.evaluate(
        x_val, y_val, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True
    )
    predictions = model.predict(x_val, batch_size=GLOBAL_BATCH, verbose=0)
    return history.history, evaluation, predictions
