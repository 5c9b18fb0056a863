"""LinearWarmup: Goyal et al. warm-up values, step by step; bad input."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr

TARGET = 0.4  # The scaled rate: 0.1 per replica x 4 replicas.


class _LrProbe(keras.callbacks.Callback):
    """Records the rate each execution starts with, by global step."""

    def __init__(self):
        super().__init__()
        self.rates = {}
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        step = self._epoch * self.params["steps"] + batch
        lr = self.model.optimizer.learning_rate
        self.rates[step] = float(keras.ops.convert_to_numpy(lr))


def _model(strategy=None, steps_per_execution=1):
    with strategy.scope() if strategy else tf.distribute.get_strategy().scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(
            keras.optimizers.SGD(TARGET),
            "mse",
            steps_per_execution=steps_per_execution,
        )
    return model


def _expected(step, scale, total):
    if step >= total:
        return TARGET
    return TARGET * (1 / scale + (1 - 1 / scale) * step / total)


def _fit(model, callbacks, epochs=3, n=64, initial_epoch=0):
    model.fit(
        np.ones((n, 2), "float32"),
        np.ones((n, 1), "float32"),
        batch_size=16,
        epochs=epochs,
        initial_epoch=initial_epoch,
        verbose=0,
        callbacks=callbacks,
    )


@pytest.fixture(scope="module")
def replicator():
    return kr.LocalReplicator(4)


@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_rates_follow_goyal_schedule(replicator, steps_per_execution):
    model = _model(replicator, steps_per_execution)
    probe = _LrProbe()
    # 4 steps per epoch; 1.5 epochs -> 6 warm-up steps; scale = 4 replicas.
    _fit(model, [kr.callbacks.LinearWarmup(warmup_epochs=1.5), probe])
    steps = range(0, 12, steps_per_execution)
    assert sorted(probe.rates) == list(steps)
    for step in steps:
        np.testing.assert_allclose(
            probe.rates[step], _expected(step, 4, 6), rtol=1e-6
        )
    # First step: the single-replica rate; then +0.05 per step.
    np.testing.assert_allclose(probe.rates[0], 0.1, rtol=1e-6)


def test_train_end_restores_target_for_next_fit():
    model = _model()
    warmup = kr.callbacks.LinearWarmup(warmup_steps=8, scale=2)
    _fit(model, [warmup], epochs=1)  # 4 of 8 warm-up steps: rate 0.3.
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(TARGET)
    # Resumed at epoch 1: warm-up continues from step 4, toward TARGET.
    probe = _LrProbe()
    _fit(model, [warmup, probe], epochs=2, initial_epoch=1)
    np.testing.assert_allclose(
        [probe.rates[s] for s in (4, 5, 6, 7)],
        [_expected(s, 2, 8) for s in (4, 5, 6, 7)],
        rtol=1e-6,
    )


@pytest.mark.filterwarnings("ignore:Your input ran out of data")
def test_unknown_epoch_length_counts_steps():
    model = _model()
    dataset = (
        tf.data.Dataset.from_tensor_slices(
            (np.ones((32, 2), "float32"), np.ones((32, 1), "float32"))
        )
        .filter(lambda x, y: True)  # Unknown cardinality.
        .batch(8)
    )
    seen = []

    class _Record(keras.callbacks.Callback):
        # At batch end: Keras also calls batch begin for the batch that
        # finds the dataset exhausted, which never runs.
        def on_train_batch_end(self, batch, logs=None):
            lr = self.model.optimizer.learning_rate
            seen.append(float(keras.ops.convert_to_numpy(lr)))

    model.fit(
        dataset,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[
            kr.callbacks.LinearWarmup(warmup_steps=6, scale=4),
            _Record(),
        ],
    )
    np.testing.assert_allclose(
        seen, [_expected(s, 4, 6) for s in range(8)], rtol=1e-6
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"warmup_epochs": 0}, "Received: warmup_epochs=0"),
        ({"warmup_steps": -3}, "Received: warmup_steps=-3"),
        ({"scale": 0.5}, "Received: scale=0.5"),
        ({"warmup_epochs": "5"}, "Received: warmup_epochs='5'"),
    ],
)
def test_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        kr.callbacks.LinearWarmup(**kwargs)


def test_rejects_schedule_at_train_begin():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    model.compile(keras.optimizers.SGD(schedule), "mse")
    with pytest.raises(TypeError, match="not a schedule"):
        _fit(model, [kr.callbacks.LinearWarmup()], epochs=1)


def test_unknown_steps_without_warmup_steps_raises():
    model = _model()
    dataset = (
        tf.data.Dataset.from_tensor_slices(
            (np.ones((8, 2), "float32"), np.ones((8, 1), "float32"))
        )
        .filter(lambda x, y: True)
        .batch(4)
    )
    with pytest.raises(RuntimeError, match="pass `warmup_steps`"):
        model.fit(
            dataset,
            shuffle=False,
            verbose=0,
            callbacks=[kr.callbacks.LinearWarmup()],
        )


class _Interrupt(keras.callbacks.Callback):
    """Raises at a given batch, as a Ctrl-C in a notebook would."""

    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            raise KeyboardInterrupt


def test_interrupted_warmup_does_not_leak_into_next_fit():
    model = _model()
    with pytest.raises(KeyboardInterrupt):
        _fit(
            model,
            [kr.callbacks.LinearWarmup(warmup_steps=8, scale=2), _Interrupt()],
        )
    # Keras skipped on_train_end: the optimizer holds a warm-up rate.
    assert float(model.optimizer.learning_rate.numpy()) < TARGET
    # A NEW callback still warms up to the original target, not to it.
    probe = _LrProbe()
    _fit(model, [kr.callbacks.LinearWarmup(warmup_steps=8, scale=2), probe])
    np.testing.assert_allclose(probe.rates[0], TARGET / 2, rtol=1e-6)
    np.testing.assert_allclose(probe.rates[8], TARGET, rtol=1e-6)
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(TARGET)
