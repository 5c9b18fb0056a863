"""Worker of test_callbacks.py: cross-replica BN and MetricReduction.

Part 1: one training call of CrossReplicaBatchNormalization with the
global batch split 5/3/1/0 over the 4 replicas of 2 workers.
Part 2: `fit` with MetricReduction on shards of different sizes (worker 0:
24 examples, worker 1: 20), per-replica batch 4, learning rate 0.
"""

import keras_replicator as kr

# Create the replicator first: it splits the CPU before TF starts.
replicator = kr.MultiWorkerReplicator()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.multi_worker import harness  # noqa: E402
from tests.multi_worker.callbacks_reference import SHARDS  # noqa: E402
from tests.multi_worker.callbacks_reference import SIZES  # noqa: E402
from tests.multi_worker.callbacks_reference import WORKER_VALUES  # noqa: E402
from tests.multi_worker.callbacks_reference import classification_data  # noqa: E402
from tests.multi_worker.callbacks_reference import global_bn_batch  # noqa: E402
from tests.multi_worker.callbacks_reference import initial_weights  # noqa: E402


def bn_step():
    x = global_bn_batch()
    offsets = np.concatenate([[0], np.cumsum(SIZES)])
    with replicator.scope():
        bn = kr.layers.CrossReplicaBatchNormalization(momentum=0.5)
        bn.build((None, 3))

    def value_fn(ctx):
        i = ctx.replica_id_in_sync_group
        return tf.constant(x[offsets[i] : offsets[i + 1]])

    inputs = replicator.experimental_distribute_values_from_function(value_fn)
    replicator.run(tf.function(lambda t: bn(t, training=True)), args=(inputs,))
    return {
        "moving_mean": [v.numpy() for v in bn.moving_mean.value.values],
        "moving_variance": [v.numpy() for v in bn.moving_variance.value.values],
    }


class AddsWorkerValue(keras.callbacks.Callback):
    """A callback that adds a per-worker value to the epoch logs."""

    def on_epoch_end(self, epoch, logs=None):
        logs["worker_value"] = WORKER_VALUES[replicator.worker_index]


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batches = []

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append(dict(logs))


def fit_uneven_shards():
    x, y = classification_data()
    start = sum(SHARDS[: replicator.worker_index])
    shard = slice(start, start + SHARDS[replicator.worker_index])

    def dataset_fn(ctx):
        # This worker's own shard, batched per replica; no auto-sharding.
        return tf.data.Dataset.from_tensor_slices((x[shard], y[shard])).batch(
            ctx.get_per_replica_batch_size(8)
        )

    dataset = replicator.distribute_datasets_from_function(dataset_fn)
    with replicator.scope():
        model = keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(3, activation="softmax")]
        )
        model.compile(
            keras.optimizers.SGD(0.0),
            "sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
    model.set_weights(initial_weights())
    recorder = Recorder()
    history = model.fit(
        dataset,
        epochs=1,
        verbose=0,
        callbacks=[AddsWorkerValue(), kr.callbacks.MetricReduction(), recorder],
    )
    return {"history": history.history, "batches": recorder.batches}


if __name__ == "__main__":
    harness.write_result(
        {
            "bn": bn_step(),
            "fit": fit_uneven_shards(),
            "index": harness.task_index(),
        }
    )
