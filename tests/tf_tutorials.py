"""TensorFlow's own tf.distribute tutorials, their training code as written.

- "Custom training with tf.distribute.Strategy"
  (tensorflow.org/tutorials/distribute/custom_training): per-example loss
  (`reduction=None`), `tf.nn.compute_average_loss(per_example_loss,
  global_batch_size=GLOBAL_BATCH_SIZE)` plus
  `tf.nn.scale_regularization_loss(model.losses)`, `apply_gradients` inside
  `strategy.run`, `strategy.reduce(SUM, ...)` of the per-replica losses.
- "Multi-worker training with a custom training loop"
  (tensorflow.org/tutorials/distribute/multi_worker_with_ctl): the same
  idiom with `distribute_datasets_from_function` and RMSprop.

Only the strategy and the data change: synthetic Fashion-MNIST-shaped
images (no download here), in a fixed order (the tutorials shuffle without
a seed, which no two runs could compare). Each function runs under any
strategy (None: no strategy, one device) and returns the epochs' logged
numbers and the final weights. Shared by `tests/test_tf_tutorials.py` and
the worker `tests/multi_worker/workers/tutorial_worker.py`.
"""

import keras
import numpy as np
import tensorflow as tf

# 250 examples at a global batch of 64: 3 full batches and a ragged one.
NUM_EXAMPLES = 250
GLOBAL_BATCH_SIZE = 64
EPOCHS = 3


def fashion_like_data(n=NUM_EXAMPLES, seed=0):
    """Images (n, 28, 28, 1) in [0, 1] and labels 0-9 a CNN can learn."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=n).astype("int64")
    images = rng.uniform(0, 0.3, size=(n, 28, 28, 1)).astype("float32")
    # Each class lights up its own band of rows.
    for i, label in enumerate(labels):
        images[i, 2 * label + 3 : 2 * label + 7, 4:24, 0] += 0.7
    return images, labels


def _scope(strategy):
    return strategy.scope() if strategy is not None else _NoScope()


class _NoScope:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def custom_training(strategy=None, epochs=EPOCHS):
    """The custom_training tutorial's loop; returns logs and weights."""
    train_images, train_labels = fashion_like_data()
    test_images, test_labels = fashion_like_data(n=100, seed=1)
    GLOBAL_BATCH_SIZE_ = GLOBAL_BATCH_SIZE  # noqa: N806 (the tutorial's)
    train_dataset = tf.data.Dataset.from_tensor_slices(
        (train_images, train_labels)
    ).batch(GLOBAL_BATCH_SIZE_)
    test_dataset = tf.data.Dataset.from_tensor_slices(
        (test_images, test_labels)
    ).batch(GLOBAL_BATCH_SIZE_)
    if strategy is not None:
        train_dist_dataset = strategy.experimental_distribute_dataset(
            train_dataset
        )
        test_dist_dataset = strategy.experimental_distribute_dataset(
            test_dataset
        )
    else:
        train_dist_dataset, test_dist_dataset = train_dataset, test_dataset

    def create_model():
        regularizer = tf.keras.regularizers.L2(1e-5)
        model = tf.keras.Sequential(
            [
                tf.keras.layers.Conv2D(
                    32, 3, activation="relu", kernel_regularizer=regularizer
                ),
                tf.keras.layers.MaxPooling2D(),
                tf.keras.layers.Conv2D(
                    64, 3, activation="relu", kernel_regularizer=regularizer
                ),
                tf.keras.layers.MaxPooling2D(),
                tf.keras.layers.Flatten(),
                tf.keras.layers.Dense(
                    64, activation="relu", kernel_regularizer=regularizer
                ),
                tf.keras.layers.Dense(10, kernel_regularizer=regularizer),
            ]
        )
        return model

    with _scope(strategy):
        # Set reduction to `None` so you can do the reduction yourself.
        loss_object = tf.keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=None
        )

        def compute_loss(labels, predictions, model_losses):
            per_example_loss = loss_object(labels, predictions)
            loss = tf.nn.compute_average_loss(
                per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE_
            )
            if model_losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))
            return loss

        test_loss = tf.keras.metrics.Mean(name="test_loss")
        train_accuracy = tf.keras.metrics.SparseCategoricalAccuracy(
            name="train_accuracy"
        )
        test_accuracy = tf.keras.metrics.SparseCategoricalAccuracy(
            name="test_accuracy"
        )
        keras.utils.set_random_seed(0)
        model = create_model()
        optimizer = tf.keras.optimizers.Adam(learning_rate=0.001)
        # Built here (Keras 3): weights and optimizer slots first created
        # inside the replicated tf.function fail under any strategy.
        model.build((None, 28, 28, 1))
        optimizer.build(model.trainable_variables)

    def train_step(inputs):
        images, labels = inputs
        with tf.GradientTape() as tape:
            predictions = model(images, training=True)
            loss = compute_loss(labels, predictions, model.losses)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))  # noqa: B905,E501
        train_accuracy.update_state(labels, predictions)
        return loss

    def test_step(inputs):
        images, labels = inputs
        predictions = model(images, training=False)
        t_loss = loss_object(labels, predictions)
        test_loss.update_state(t_loss)
        test_accuracy.update_state(labels, predictions)

    if strategy is not None:

        @tf.function
        def distributed_train_step(dataset_inputs):
            per_replica_losses = strategy.run(
                train_step, args=(dataset_inputs,)
            )
            return strategy.reduce(
                tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None
            )

        @tf.function
        def distributed_test_step(dataset_inputs):
            return strategy.run(test_step, args=(dataset_inputs,))

    else:
        distributed_train_step = tf.function(train_step)
        distributed_test_step = tf.function(test_step)

    logs = {"loss": [], "accuracy": [], "test_loss": [], "test_accuracy": []}
    for _ in range(epochs):
        total_loss = 0.0
        num_batches = 0
        for x in train_dist_dataset:
            total_loss += distributed_train_step(x)
            num_batches += 1
        train_loss = total_loss / num_batches
        for x in test_dist_dataset:
            distributed_test_step(x)
        logs["loss"].append(float(train_loss))
        logs["accuracy"].append(float(train_accuracy.result()))
        logs["test_loss"].append(float(test_loss.result()))
        logs["test_accuracy"].append(float(test_accuracy.result()))
        test_loss.reset_state()
        train_accuracy.reset_state()
        test_accuracy.reset_state()
    return {"logs": logs, "weights": [np.asarray(w) for w in model.weights]}


def multi_worker_ctl(
    strategy=None, steps_per_epoch=4, epochs=EPOCHS, wrap=False
):
    """The multi_worker_with_ctl tutorial's loop; returns logs and weights.

    With `wrap=True` the optimizer is `strategy.wrap_optimizer`'s.

    Its `dataset_fn` shards by input pipeline and batches per worker; the
    data here is ordered so that every topology sees the same global
    batches: worker w's pipeline takes every W-th per-worker slice.
    """
    images, labels = fashion_like_data(n=GLOBAL_BATCH_SIZE * steps_per_epoch)
    global_batch_size = GLOBAL_BATCH_SIZE

    def dataset_fn(input_context):
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        pipelines = input_context.num_input_pipelines
        per_pipeline = global_batch_size // pipelines
        dataset = tf.data.Dataset.from_tensor_slices((images, labels))
        # Global batch b, pipeline p: examples [b*G + p*G/P, ... + G/P).
        dataset = dataset.batch(per_pipeline).shard(
            pipelines, input_context.input_pipeline_id
        )
        return dataset.unbatch().batch(batch_size).repeat()

    def build_cnn_model():
        regularizer = tf.keras.regularizers.L2(1e-5)
        return tf.keras.Sequential(
            [
                tf.keras.Input(shape=(28, 28)),
                tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
                tf.keras.layers.Conv2D(32, 3, activation="relu"),
                tf.keras.layers.Flatten(),
                tf.keras.layers.Dense(
                    128, activation="relu", kernel_regularizer=regularizer
                ),
                tf.keras.layers.Dense(10),
            ]
        )

    with _scope(strategy):
        keras.utils.set_random_seed(0)
        multi_worker_model = build_cnn_model()
        if strategy is not None:
            multi_worker_dataset = strategy.distribute_datasets_from_function(
                lambda input_context: dataset_fn(input_context)
            )
        else:
            multi_worker_dataset = dataset_fn(tf.distribute.InputContext())
        optimizer = tf.keras.optimizers.RMSprop(learning_rate=0.001)
        # Built here (Keras 3), as in `custom_training`.
        optimizer.build(multi_worker_model.trainable_variables)
        if wrap:
            optimizer = strategy.wrap_optimizer(optimizer)
        train_accuracy = tf.keras.metrics.SparseCategoricalAccuracy(
            name="train_accuracy"
        )

    @tf.function
    def train_step(iterator):
        """Training step function."""

        def step_fn(inputs):
            """Per-Replica step function."""
            x, y = inputs
            x = tf.reshape(x, (-1, 28, 28))
            with tf.GradientTape() as tape:
                predictions = multi_worker_model(x, training=True)
                per_example_loss = (
                    tf.keras.losses.SparseCategoricalCrossentropy(  # noqa: E501
                        from_logits=True, reduction=None
                    )(y, predictions)
                )
                loss = tf.nn.compute_average_loss(
                    per_example_loss, global_batch_size=global_batch_size
                )
                loss += tf.nn.scale_regularization_loss(
                    tf.add_n(multi_worker_model.losses)
                )
            grads = tape.gradient(loss, multi_worker_model.trainable_variables)
            optimizer.apply_gradients(
                zip(grads, multi_worker_model.trainable_variables)  # noqa: B905
            )
            train_accuracy.update_state(y, predictions)
            return loss

        if strategy is None:
            return step_fn(next(iterator))
        per_replica_losses = strategy.run(step_fn, args=(next(iterator),))
        return strategy.reduce(
            tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None
        )

    iterator = iter(multi_worker_dataset)
    logs = {"loss": [], "accuracy": []}
    for _ in range(epochs):
        train_accuracy.reset_state()
        total_loss = 0.0
        num_batches = 0
        for _ in range(steps_per_epoch):
            total_loss += train_step(iterator)
            num_batches += 1
        logs["loss"].append(float(total_loss / num_batches))
        logs["accuracy"].append(float(train_accuracy.result()))
    return {
        "logs": logs,
        "weights": [np.asarray(w) for w in multi_worker_model.weights],
    }
