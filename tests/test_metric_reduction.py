"""MetricReduction: exact global logs; what Keras already reduces; position."""

import contextlib
import threading
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator._src.callbacks import metric_reduction

# 34 training examples in global batches of 16: the last batch holds 2,
# which 4 replicas split 1/1/0/0. 18 validation examples in batches of 8:
# the last holds 2 as well.
N_TRAIN, N_VAL, BATCH, VAL_BATCH = 34, 18, 16, 8


class _Recorder(keras.callbacks.Callback):
    """Records every log it sees, in every hook."""

    def __init__(self):
        super().__init__()
        self.train_batches, self.test_batches = [], []
        self.epochs, self.test_ends = [], []
        self.train_ended = None

    def on_train_batch_end(self, batch, logs=None):
        self.train_batches.append(dict(logs))

    def on_test_batch_end(self, batch, logs=None):
        self.test_batches.append(dict(logs))

    def on_test_end(self, logs=None):
        self.test_ends.append(dict(logs))

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(dict(logs))

    def on_train_end(self, logs=None):
        self.train_ended = dict(logs)


def _build():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(3, activation="softmax")]
    )


def _run(strategy, callbacks):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N_TRAIN, 3)).astype("float32")
    y = rng.integers(0, 3, N_TRAIN)
    initial = _build().get_weights()
    scope = strategy.scope() if strategy else contextlib.nullcontext()
    with scope:
        model = _build()
        model.set_weights(initial)
        # Learning rate 0: the weights, and so every exact log value, are
        # the same on one device and on four replicas. (Keras' loss scaling
        # is itself inexact for uneven batches; that is not a log issue.)
        model.compile(
            keras.optimizers.SGD(0.0),
            "sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
    recorder = _Recorder()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        validation_data=(x[:N_VAL], y[:N_VAL]),
        validation_batch_size=VAL_BATCH,
        callbacks=[*callbacks, recorder],
    )
    return recorder


@pytest.fixture(scope="module")
def runs():
    replicator = kr.LocalReplicator(4)
    return {
        "reference": _run(None, []),
        "keras": _run(replicator, []),
        "reduced": _run(replicator, [kr.callbacks.MetricReduction()]),
    }


def _close(a, b):
    return set(a) == set(b) and all(abs(a[k] - b[k]) < 1e-6 for k in a)


def test_what_keras_reduces_on_one_host(runs):
    ref, keras_run = runs["reference"], runs["keras"]
    # Even batches: Keras' batch logs are exact.
    assert _close(keras_run.train_batches[0], ref.train_batches[0])
    # The uneven last batch: the mean of replica means is not.
    assert not _close(keras_run.train_batches[2], ref.train_batches[2])
    assert not _close(keras_run.test_batches[2], ref.test_batches[2])
    # Epoch, validation and evaluation-end logs are read from the global
    # metric state: exact already.
    for got, want in zip(keras_run.epochs, ref.epochs, strict=True):
        assert _close(got, want)
    for got, want in zip(keras_run.test_ends, ref.test_ends, strict=True):
        assert _close(got, want)


def test_batch_and_epoch_logs_exact_with_reduction(runs):
    ref, got = runs["reference"], runs["reduced"]
    for name in ("train_batches", "test_batches", "epochs", "test_ends"):
        pairs = zip(getattr(got, name), getattr(ref, name), strict=True)
        for i, (a, b) in enumerate(pairs):
            assert _close(a, b), (name, i, a, b)
    assert _close(got.train_ended, ref.train_ended)


class _AddsValue(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        logs["added"] = 1.5


def _fit_with(callbacks, n=16):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    recorder = _Recorder()
    model.fit(
        np.ones((n, 2)),
        np.ones((n, 1)),
        batch_size=8,
        verbose=0,
        callbacks=[*callbacks, recorder],
    )
    return recorder


def test_one_worker_leaves_values_added_by_callbacks():
    recorder = _fit_with([_AddsValue(), kr.callbacks.MetricReduction()])
    assert recorder.epochs[0]["added"] == 1.5


@pytest.mark.parametrize(
    "reader",
    [
        lambda: keras.callbacks.EarlyStopping(monitor="loss"),
        lambda: keras.callbacks.ReduceLROnPlateau(monitor="loss"),
        lambda: keras.callbacks.ModelCheckpoint("/tmp/unused.keras"),
    ],
    ids=["early_stopping", "reduce_lr", "checkpoint"],
)
def test_after_log_reader_raises_at_train_begin(reader):
    callback = reader()
    with pytest.raises(
        ValueError,
        match=f"must come before callbacks that read logs.*"
        f"{type(callback).__name__} comes first",
    ):
        _fit_with([callback, kr.callbacks.MetricReduction()])


def test_before_log_reader_is_fine_and_feeds_it():
    stopper = keras.callbacks.EarlyStopping(monitor="loss", patience=5)
    _fit_with([kr.callbacks.MetricReduction(), stopper])
    assert stopper.best is not None


def test_two_reductions_raise():
    with pytest.raises(ValueError, match="one MetricReduction"):
        _fit_with(
            [kr.callbacks.MetricReduction(), kr.callbacks.MetricReduction()]
        )


def test_empty_logs_return_early():
    callback = kr.callbacks.MetricReduction()
    # No model is needed when there is nothing to reduce.
    callback.on_train_batch_end(0, {})
    callback.on_test_batch_end(0, None)
    callback.on_epoch_end(0, {})
    callback.on_test_end({})
    callback.on_train_end(None)


class _ThreadCollective:
    """An all-reduce over threads that fails like TF on unequal shapes."""

    def __init__(self, workers):
        self._barrier = threading.Barrier(workers, timeout=30)
        self._vectors = {}
        self.shapes = []

    def __call__(self, strategy, vector):
        name = threading.current_thread().name
        self._vectors[name] = vector
        self._barrier.wait()
        vectors = list(self._vectors.values())
        shapes = sorted({v.shape for v in vectors})
        self._barrier.wait()
        self.shapes.append(shapes)
        if len(shapes) > 1:
            raise tf.errors.InvalidArgumentError(
                None, None, f"Shape mismatch in the collective: {shapes}"
            )
        return np.sum(vectors, axis=0)


def _reduce_on_two_workers(monkeypatch, logs_per_worker):
    """Runs `on_epoch_end` as two workers would, each with its own logs."""
    collective = _ThreadCollective(len(logs_per_worker))
    monkeypatch.setattr(metric_reduction, "_sum_over_workers", collective)
    strategy = types.SimpleNamespace(num_workers=len(logs_per_worker))
    model = types.SimpleNamespace(distribute_strategy=strategy)
    outcomes = {}

    def worker(index, logs):
        callback = kr.callbacks.MetricReduction()
        callback.set_model(model)
        try:
            callback.on_epoch_end(0, logs)
            outcomes[index] = logs
        except Exception as e:  # noqa: BLE001 - recorded for the test
            outcomes[index] = e

    threads = [
        threading.Thread(target=worker, args=(i, logs), name=f"worker{i}")
        for i, logs in enumerate(logs_per_worker)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return [outcomes[i] for i in range(len(threads))], collective


@pytest.mark.parametrize(
    "logs_per_worker",
    [
        [{"a": 1.0}, {"a": 1.0, "b": 2.0}],
        [{"loss": 1.0}, {"loss": 1.0, "a": 2.0}],
        [{"a": 1.0}, {"b": 1.0}],
    ],
    ids=["one_and_two_keys", "none_and_one_key", "same_count_other_name"],
)
def test_workers_with_different_keys_raise_before_exchanging_values(
    monkeypatch, logs_per_worker
):
    outcomes, collective = _reduce_on_two_workers(monkeypatch, logs_per_worker)
    for index, outcome in enumerate(outcomes):
        assert isinstance(outcome, RuntimeError), outcome
        message = str(outcome)
        assert "same log keys on every worker" in message
        assert f"Received: logs={sorted(logs_per_worker[index])}" in message
    # Only the fixed-size check ran; no collective saw unequal shapes.
    assert collective.shapes == [[(5,)], [(5,)]]


def test_workers_with_the_same_keys_average_by_examples(monkeypatch):
    outcomes, collective = _reduce_on_two_workers(
        monkeypatch, [{"loss": 1.0, "a": 1.0}, {"loss": 2.0, "a": 3.0}]
    )
    # `loss` is not a metric here (no batch ran), so both are averaged.
    assert outcomes == [{"loss": 1.5, "a": 2.0}] * 2
    assert collective.shapes == [[(5,)], [(5,)], [(2,)], [(2,)]]
