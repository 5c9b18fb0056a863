"""Everyday Keras training code, as rows that run under any strategy.

Shared by `tests/test_drop_in.py` (one device, 2 and 4 local replicas) and
the multi-worker worker (`tests/multi_worker/workers/drop_in_worker.py`).
Each row trains a seeded model with single-device code and returns its
final weights and History; under a replicator they must equal one device's.
"""

import keras
import numpy as np
import tensorflow as tf

GLOBAL_BATCH = 32
EPOCHS = 2


def data(n=128, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = (x[:, :3].sum(axis=1) > 0).astype("int32") + (x[:, 3] > 1)
    return x, y.astype("int32")


def mlp(seed=1):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3),
        ]
    )


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _compile(model, optimizer, **kwargs):
    model.compile(
        optimizer, _loss(), metrics=["sparse_categorical_accuracy"], **kwargs
    )
    return model


def _fit(model, x, y, **kwargs):
    kwargs.setdefault("batch_size", GLOBAL_BATCH)
    history = model.fit(x, y, epochs=EPOCHS, shuffle=False, verbose=0, **kwargs)
    return history.history


# The guide "Customizing what happens in fit() with TensorFlow"
# (keras.io/guides/custom_train_step_in_tensorflow), its code as written.
class GuideModel(keras.Model):
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        for metric in self.metrics:
            if metric.name != "loss":
                metric.update_state(y, y_pred)
            else:
                metric.update_state(loss)
        return {m.name: m.result() for m in self.metrics}


# The guide's GAN (two optimizers, a Loss object inside train_step), with
# its random latent vectors and label noise replaced by functions of the
# batch so that one device and N replicas see the same numbers.
class GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, real_images):
        if isinstance(real_images, tuple):
            real_images = real_images[0]
        batch_size = tf.shape(real_images)[0]
        random_latent_vectors = real_images[:, : self.latent_dim] * 0.5
        generated_images = self.generator(random_latent_vectors)
        combined_images = tf.concat([generated_images, real_images], axis=0)
        labels = tf.concat(
            [tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0
        )
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(
            zip(grads, self.discriminator.trainable_weights, strict=True)
        )
        misleading_labels = tf.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(
                self.generator(random_latent_vectors)
            )
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(
            zip(grads, self.generator.trainable_weights, strict=True)
        )
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {
            "d_loss": self.d_loss_tracker.result(),
            "g_loss": self.g_loss_tracker.result(),
        }


class _Sequence(keras.utils.PyDataset):
    def __init__(self, x, y, batch_size):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return len(self.x) // self.batch_size

    def __getitem__(self, i):
        s = slice(i * self.batch_size, (i + 1) * self.batch_size)
        return self.x[s], self.y[s]


def _optimizer_row(make_optimizer, n=128, **fit_kwargs):
    def row():
        x, y = data(n)
        model = _compile(mlp(), make_optimizer())
        return model, _fit(model, x, y, **fit_kwargs)

    return row


def _class_weight():
    x, y = data()
    model = _compile(mlp(), keras.optimizers.Adam(0.01))
    return model, _fit(model, x, y, class_weight={0: 1.0, 1: 3.0, 2: 0.5})


def _sample_weight():
    x, y = data()
    weights = np.linspace(0.1, 2.0, len(x)).astype("float32")
    model = _compile(mlp(), keras.optimizers.Adam(0.01))
    return model, _fit(model, x, y, sample_weight=weights)


def _py_dataset():
    x, y = data()
    model = _compile(mlp(), keras.optimizers.Adam(0.01))
    history = model.fit(
        _Sequence(x, y, GLOBAL_BATCH), epochs=EPOCHS, shuffle=False, verbose=0
    )
    return model, history.history


def _mixed(policy, make_optimizer):
    def row():
        x, y = data()
        saved = keras.config.dtype_policy()
        keras.config.set_dtype_policy(policy)
        try:
            model = mlp()
            model.compile(
                make_optimizer(),
                _loss(),
                metrics=["sparse_categorical_accuracy"],
            )
        finally:
            keras.config.set_dtype_policy(saved)
        return model, _fit(model, x, y)

    return row


def _guide_model():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    return GuideModel(inputs, keras.layers.Dense(3)(hidden))


def _custom_train_step():
    x, y = data()
    model = _compile(_guide_model(), keras.optimizers.Adam(0.01))
    return model, _fit(model, x, y)


def _custom_test_step():
    x, y = data()
    model = _compile(_guide_model(), keras.optimizers.Adam(0.01))
    history = _fit(model, x, y, validation_data=data(64, seed=5))
    evaluated = model.evaluate(*data(64, seed=6), batch_size=32, verbose=0)
    history["evaluate"] = _floats(evaluated)
    return model, history


def _floats(values):
    """`evaluate`'s results as floats, nested dicts flattened by key."""
    # Keras < 3.14 returns a custom test_step's nested dict
    # ({"compile_metrics": {...}}) as one result; 3.14 flattens the logs.
    if isinstance(values, dict):
        return [f for key in sorted(values) for f in _floats(values[key])]
    if isinstance(values, list | tuple):
        return [f for v in values for f in _floats(v)]
    return [float(v) for v in np.ravel(values)]


def _gan():
    x, _ = data()
    latent_dim = 4
    keras.utils.set_random_seed(1)
    discriminator = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    generator = keras.Sequential(
        [
            keras.Input((latent_dim,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(8),
        ]
    )
    gan = GAN(discriminator, generator, latent_dim)
    gan.compile(
        d_optimizer=keras.optimizers.Adam(0.003),
        g_optimizer=keras.optimizers.Adam(0.003),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )
    # Keras builds a model before `fit` under every tf.distribute strategy
    # (stock MirroredStrategy too) and cannot build one without `call`
    # ("Unable to automatically build the model"): build it first, as the
    # message says.
    gan.built = True
    gan.d_optimizer.build(discriminator.trainable_variables)
    gan.g_optimizer.build(generator.trainable_variables)
    history = gan.fit(
        x, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0
    )
    return gan, history.history


# name -> (row, tolerance on weights, relative tolerance on History).
ROWS = {
    "plain": (_optimizer_row(lambda: keras.optimizers.Adam(0.01)), 1e-5),
    "class_weight": (_class_weight, 1e-5),
    "sample_weight": (_sample_weight, 1e-5),
    "py_dataset": (_py_dataset, 1e-5),
    "validation_split": (
        _optimizer_row(
            lambda: keras.optimizers.Adam(0.01), validation_split=0.25
        ),
        1e-5,
    ),
    # 93 examples: the last global batch of 29 splits 15/14 (2 replicas)
    # and 8/8/8/5 (4 replicas: each takes ceil(29 / 4) rows in turn).
    "uneven_last_batch": (
        _optimizer_row(lambda: keras.optimizers.Adam(0.01), n=93),
        1e-5,
    ),
    "gradient_accumulation": (
        _optimizer_row(
            lambda: keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
        ),
        1e-5,
    ),
    "clipnorm": (
        _optimizer_row(lambda: keras.optimizers.AdamW(0.01, clipnorm=0.5)),
        1e-5,
    ),
    "global_clipnorm": (
        _optimizer_row(lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.3)),
        1e-5,
    ),
    "clipvalue": (
        _optimizer_row(lambda: keras.optimizers.SGD(0.1, clipvalue=0.05)),
        1e-5,
    ),
    "use_ema": (
        _optimizer_row(
            lambda: keras.optimizers.Adam(
                0.01, use_ema=True, ema_overwrite_frequency=3
            )
        ),
        1e-5,
    ),
    "loss_scale_factor": (
        _optimizer_row(
            lambda: keras.optimizers.SGD(0.1, loss_scale_factor=128.0)
        ),
        1e-5,
    ),
    "loss_scale_optimizer_float16": (
        _mixed(
            "mixed_float16",
            lambda: keras.optimizers.LossScaleOptimizer(
                keras.optimizers.Adam(0.01)
            ),
        ),
        2e-3,
    ),
    "mixed_bfloat16": (
        _mixed("mixed_bfloat16", lambda: keras.optimizers.Adam(0.01)),
        2e-2,
    ),
    "custom_train_step": (_custom_train_step, 1e-5),
    "custom_test_step": (_custom_test_step, 1e-5),
    "gan_train_step": (_gan, 1e-5),
}


def run(name, strategy=None):
    """Runs row `name` under `strategy` (None: one device).

    Returns:
        `{"weights": [...], "history": {...}}` as plain lists.
    """
    row, _ = ROWS[name]
    if strategy is None:
        with tf.device("CPU:0"):
            model, history = row()
    else:
        with strategy.scope():
            model, history = row()
    return {
        "weights": [np.asarray(w).tolist() for w in model.get_weights()],
        "history": {k: [float(v) for v in vs] for k, vs in history.items()},
    }


def assert_same(actual, expected, name, label=None):
    """Asserts row `name`'s weights and History equal the reference's.

    Weights agree within the row's tolerance; History within 1e-5 relative
    (ten times the weight tolerance for the 16-bit rows).
    """
    _, atol = ROWS[name]
    rel = 1e-5 if atol <= 1e-5 else atol * 10
    name = label or name
    assert len(actual["weights"]) == len(expected["weights"]), name
    for i, (a, e) in enumerate(
        zip(actual["weights"], expected["weights"], strict=True)
    ):
        np.testing.assert_allclose(
            np.asarray(a),
            np.asarray(e),
            atol=atol,
            rtol=0,
            err_msg=f"{name}: weight {i}",
        )
    assert sorted(actual["history"]) == sorted(expected["history"]), name
    for key, values in expected["history"].items():
        np.testing.assert_allclose(
            actual["history"][key],
            values,
            rtol=rel,
            atol=1e-7,
            err_msg=f"{name}: history[{key!r}]",
        )
