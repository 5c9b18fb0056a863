"""One training script for every backend: kr.auto(), distribute, fit, evaluate.

tests/multi_worker/test_one_script.py runs this file unmodified under a
LocalReplicator (no cluster), on 2 workers (TF_CONFIG) and on 2 workers + 1
parameter server (TF_CONFIG with a "ps" job); `kr.auto()` picks the backend.
"""

import os

import keras
import tensorflow as tf

import keras_replicator as kr
from keras_replicator._src.cli import demo

GLOBAL_BATCH = 64
EPOCHS = 3

replicator = kr.auto()  # first: a cluster must be joined before TF runs

(x_train, y_train), (x_test, y_test) = demo.load_digits_split()
# NOTE: GLOBAL_BATCH is the batch of one step over every replica (under
# parameter servers: of one step on one worker).
train = replicator.distribute(
    tf.data.Dataset.from_tensor_slices((x_train, y_train)),
    GLOBAL_BATCH,
    static_shapes=True,  # full batches only, on every backend
)
test = replicator.distribute(
    tf.data.Dataset.from_tensor_slices((x_test, y_test)),
    GLOBAL_BATCH,
    mode="eval",
)

with replicator.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Flatten(),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(
        keras.optimizers.Adam(0.01),
        "sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )

history = model.fit(train, epochs=EPOCHS, verbose=0)
logs = model.evaluate(test, verbose=0, return_dict=True)
print(type(replicator).__name__, "evaluate:", logs)

if os.environ.get("KERAS_REPLICATOR_RESULT"):  # the test's hook
    from tests.multi_worker import harness

    predicted = model.predict(x_test, verbose=0).argmax(-1)
    harness.write_result(
        {
            "backend": type(replicator).__name__,
            "iterations": int(model.optimizer.iterations.numpy()),
            "epochs_logged": len(history.history["loss"]),
            "evaluate": logs,
            "predict_accuracy": float((predicted == y_test).mean()),
            "weights": [w.tolist() for w in model.get_weights()],
        }
    )
