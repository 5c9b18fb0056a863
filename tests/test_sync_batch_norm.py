"""SyncBatchNorm: converts every BN, trains like one device, saves plainly."""

import inspect
import json
import os
import subprocess
import sys
import warnings
import zipfile

import keras
import numpy as np
import pytest

import keras_replicator as kr
from keras_replicator._src.callbacks import sync_batch_norm
from tests import sync_bn_models
from tests.helpers import assert_weights_close

GLOBAL_BATCH = 16
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(1.0, 2.0, size=(n, *sync_bn_models.INPUT_SHAPE))
    y = x.reshape(n, -1).mean(axis=1, keepdims=True)
    return x.astype("float32"), y.astype("float32")


class _Probe(keras.callbacks.Callback):
    """Records, at train begin, which BN layers are converted."""

    def on_train_begin(self, logs=None):
        layers = sync_batch_norm.batch_norm_layers(self.model)
        self.converted = ["_moments" in vars(layer) for layer in layers]


def _train(name, strategy, callbacks=(), steps_per_execution=1):
    build = sync_bn_models.BUILDERS[name]
    keras.utils.set_random_seed(0)
    initial = build().get_weights()
    with strategy.scope() if strategy else _null():
        model = build()
        model.set_weights(initial)
        model.compile(
            keras.optimizers.SGD(0.05),
            "mse",
            steps_per_execution=steps_per_execution,
        )
    x, y = _data()
    model.fit(
        x,
        y,
        batch_size=GLOBAL_BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
    )
    return model


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Each model trained on one device (plain BN) and on 4 replicas."""
    replicator = kr.LocalReplicator(4)
    tmp = tmp_path_factory.mktemp("sync_bn")
    out = {}
    for name, spe in [("sequential", 1), ("functional", 2), ("subclassed", 1)]:
        probe = _Probe()
        reference = _train(name, None)
        model = _train(
            name, replicator, [kr.callbacks.SyncBatchNorm(), probe], spe
        )
        path = tmp / f"{name}.keras"
        model.save(path)
        out[name] = (model, reference, probe, path)
    return out


@pytest.mark.parametrize("name", ["sequential", "functional", "subclassed"])
def test_converts_every_bn_and_matches_single_device(trained, name):
    model, reference, probe, _ = trained[name]
    expected = {"sequential": 1, "functional": 2, "subclassed": 1}[name]
    assert probe.converted == [True] * expected
    # Moving statistics included: they are weights of the model.
    assert_weights_close(model.get_weights(), reference.get_weights())
    for layer in sync_batch_norm.batch_norm_layers(model):
        replicas = [v.numpy() for v in layer.moving_variance.value.values]
        for value in replicas[1:]:
            np.testing.assert_array_equal(value, replicas[0])


def test_train_end_restores_layers_and_drops_train_function(trained):
    model, *_ = trained["functional"]
    for layer in sync_batch_norm.batch_norm_layers(model):
        assert "_moments" not in vars(layer)
        assert type(layer) is keras.layers.BatchNormalization
    assert model.train_function is None


_LOADER = """
import json, sys
import keras
import numpy as np
sys.path.insert(0, sys.argv[1])
from tests import sync_bn_models  # registers the subclassed model
out = {}
for name, path in json.loads(sys.argv[2]).items():
    model = keras.saving.load_model(path)
    bns = [l for l in model._flatten_layers()
           if isinstance(l, keras.layers.BatchNormalization)]
    x = np.linspace(-1, 1, 2 * 72, dtype="float32").reshape(2, 6, 6, 2)
    out[name] = {
        "classes": [type(l).__module__ + "." + type(l).__name__ for l in bns],
        "moving_mean": [l.moving_mean.numpy().tolist() for l in bns],
        "moving_variance": [l.moving_variance.numpy().tolist() for l in bns],
        "predictions": model.predict(x, verbose=0).tolist(),
    }
assert "keras_replicator" not in sys.modules, "imported keras_replicator"
print("RESULT" + json.dumps(out))
"""


def test_saved_model_loads_in_plain_keras_fresh_process(trained):
    paths = {name: str(entry[3]) for name, entry in trained.items()}
    for path in paths.values():
        with zipfile.ZipFile(path) as archive:
            assert b"keras_replicator" not in archive.read("config.json")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH="")
    proc = subprocess.run(
        [sys.executable, "-c", _LOADER, REPO_ROOT, json.dumps(paths)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd="/",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(s for s in proc.stdout.splitlines() if s.startswith("RESULT"))
    loaded = json.loads(line[len("RESULT") :])
    x = np.linspace(-1, 1, 2 * 72, dtype="float32").reshape(2, 6, 6, 2)
    for name, (model, *_) in trained.items():
        got = loaded[name]
        bns = sync_batch_norm.batch_norm_layers(model)
        assert set(got["classes"]) == {
            "keras.src.layers.normalization.batch_normalization."
            "BatchNormalization"
        }
        for i, layer in enumerate(bns):
            np.testing.assert_allclose(
                got["moving_mean"][i], layer.moving_mean.numpy(), atol=1e-6
            )
            np.testing.assert_allclose(
                got["moving_variance"][i],
                layer.moving_variance.numpy(),
                atol=1e-6,
            )
        # A direct call: predict() of 2 examples on 4 replicas would hand
        # two replicas empty batches, which Conv2D on CPU rejects.
        np.testing.assert_allclose(
            got["predictions"], model(x, training=False), atol=1e-5
        )


def test_model_without_bn_warns_once_and_does_nothing():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    callback = kr.callbacks.SyncBatchNorm()
    callback.set_model(model)
    model.make_train_function()
    train_function = model.train_function
    with pytest.warns(UserWarning, match="found no BatchNormalization") as rec:
        callback.on_train_begin()
        callback.on_train_end()
        callback.on_train_begin()
        callback.on_train_end()
    assert len(rec) == 1
    assert "'sequential" in str(rec[0].message)
    # Nothing touched: the train function is the same object.
    assert model.train_function is train_function
    # And fit runs without a second warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.fit(
            np.ones((4, 3)), np.ones((4, 1)), verbose=0, callbacks=[callback]
        )


def test_keras_still_calls_moments_in_batch_norm():
    # SyncBatchNorm replaces this call's target; a Keras upgrade that
    # renames it must fail here rather than silently train with local BN.
    source = inspect.getsource(keras.layers.BatchNormalization.call)
    assert sync_batch_norm.KERAS_MOMENTS_CALL in source


class _Interrupt(keras.callbacks.Callback):
    """Raises after the first batch, as a Ctrl-C in a notebook would."""

    def on_train_batch_end(self, batch, logs=None):
        raise KeyboardInterrupt


def test_failed_fit_conversion_is_undone_by_the_next_sync_batch_norm():
    replicator = kr.LocalReplicator(2)
    with replicator.scope():
        model = sync_bn_models.BUILDERS["functional"]()
        model.compile(keras.optimizers.SGD(0.05), "mse")
    x, y = _data()
    layers = sync_batch_norm.batch_norm_layers(model)
    with pytest.raises(KeyboardInterrupt):
        model.fit(
            x,
            y,
            batch_size=GLOBAL_BATCH,
            verbose=0,
            callbacks=[kr.callbacks.SyncBatchNorm(), _Interrupt()],
        )
    # Keras skipped on_train_end: the layers are still converted.
    assert all("_moments" in vars(layer) for layer in layers)
    model.fit(
        x,
        y,
        batch_size=GLOBAL_BATCH,
        verbose=0,
        callbacks=[kr.callbacks.SyncBatchNorm()],
    )
    # The next SyncBatchNorm adopted and restored them: plain Keras again.
    assert not any("_moments" in vars(layer) for layer in layers)
