"""A save returns on every process once the chief has closed the file.

4 processes, one device each, a JAX-style script: `save_weights(p)` then
`load_weights(p)` on every process, 10 times in a row (the weights change
each time, so a stale or half-written file shows), then `fit` with a
`ModelCheckpoint` and `load_weights` of its file right after, on every
process: under `ModelParallel` on a (1, 4) mesh, under `DataParallel`, and
under a `MultiWorkerReplicator`. Before, a process other than the chief
returned from `save_weights` while the chief still wrote and its
`load_weights` failed on the file's lock (`BlockingIOError: unable to lock
file`). The trained weights equal one device's. A save by the chief alone
ends in a clear error within the collective timeout; a chief that writes
for longer than that timeout is waited for (under `ModelParallel` between
its reads of sharded values too), and a chief's failed write fails the
others at once. One process group for every check.
"""

import keras
import numpy as np
import pytest

from tests.helpers import assert_weights_close
from tests.multi_worker import harness

WORKER = """
import os, sys, time
import keras, numpy as np, tensorflow as tf
from tensorflow.python.eager import context
import keras_replicator as kr
from tests.multi_worker import harness
from tests.multi_worker.test_chief_saves import build, data

out = sys.argv[1]
keras.distribution.initialize()
devices = keras.distribution.list_devices()
mesh = keras.distribution.DeviceMesh((1, 4), ("batch", "model"), devices)
layout_map = keras.distribution.LayoutMap(mesh)
layout_map[".*h/kernel"] = (None, "model")
x, y = data()
examples = tf.data.Dataset.from_tensor_slices((x, y))
report = {}
for name in ("model_parallel", "data_parallel", "replicator"):
    scope = None
    batches = examples.batch(8)
    if name == "model_parallel":
        keras.distribution.set_distribution(keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"))
    elif name == "data_parallel":
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=devices))
    else:
        keras.distribution.set_distribution(None)
        replicator = kr.MultiWorkerReplicator()
        batches = replicator.distribute(examples, 8)
        scope = replicator.scope()
        scope.__enter__()
    model = build()
    base = model.get_weights()
    path = os.path.join(out, name + ".weights.h5")
    loaded = []
    for i in range(10):
        model.set_weights([w + i for w in base])
        model.save_weights(path)
        model.set_weights([np.zeros_like(w) for w in base])
        model.load_weights(path)
        loaded.append(all(
            np.array_equal(a, w + i)
            for a, w in zip(model.get_weights(), base)))
    model.set_weights(base)
    if name == "model_parallel":
        # The chief writes for longer than the collective timeout (5 s)
        # before its read of the sharded h/kernel, which every process
        # joins: the others wait for the file (at least 600 s).
        strategy = tf.distribute.get_strategy()
        strategy._collective_timeout_seconds = 5
        from keras.src.saving import saving_lib
        save_state = saving_lib._save_state
        if strategy.is_chief:
            def slow_before_h(saveable, *args, **kwargs):
                if getattr(saveable, "name", None) == "h":
                    time.sleep(8)
                return save_state(saveable, *args, **kwargs)
            saving_lib._save_state = slow_before_h
        slow = os.path.join(out, "slow_model_parallel.weights.h5")
        started = time.monotonic()
        model.save_weights(slow)
        report["slow_model_parallel_waited"] = time.monotonic() - started
        saving_lib._save_state = save_state
        strategy._collective_timeout_seconds = None
        model.set_weights([np.zeros_like(w) for w in base])
        model.load_weights(slow)
        report["slow_model_parallel_loaded"] = all(
            np.array_equal(a, w) for a, w in zip(model.get_weights(), base))
        model.set_weights(base)
    checkpoint = os.path.join(out, name + ".checkpoint.weights.h5")
    model.fit(batches, epochs=2, verbose=0,
              callbacks=[keras.callbacks.ModelCheckpoint(
                  checkpoint, save_weights_only=True)])
    trained = model.get_weights()
    model.set_weights([np.zeros_like(w) for w in base])
    model.load_weights(checkpoint)
    report[name] = {
        "loaded": loaded,
        "checkpoint": [w.tolist() for w in model.get_weights()],
        "trained": [w.tolist() for w in trained],
    }
    if scope is not None:
        scope.__exit__(None, None, None)
keras.distribution.set_distribution(None)
# The replicator's model (its save gathers nothing), with a short
# collective timeout.
strategy = model.distribute_strategy
strategy._collective_timeout_seconds = 5
# The chief writes for longer than the collective timeout (5 s): the others
# wait for the file (a file's bound, at least 600 s), and load it.
from keras.src.saving import saving_lib
save_state = saving_lib._save_state
if strategy.is_chief:
    def slow_save_state(*args, **kwargs):
        saving_lib._save_state = save_state  # once: it calls itself
        time.sleep(8)
        return save_state(*args, **kwargs)
    saving_lib._save_state = slow_save_state
slow = os.path.join(out, "slow.weights.h5")
model.set_weights([w * 2 for w in base])
started = time.monotonic()
model.save_weights(slow)
report["slow_waited"] = time.monotonic() - started
model.set_weights([np.zeros_like(w) for w in base])
model.load_weights(slow)
report["slow_loaded"] = all(
    np.array_equal(a, w * 2) for a, w in zip(model.get_weights(), base))
saving_lib._save_state = save_state
# The chief's write fails: the others raise its error at once, not at the
# end of a file's bound.
if strategy.is_chief:
    def failing_save_state(*args, **kwargs):
        saving_lib._save_state = save_state
        raise OSError("No space left on device (a test)")
    saving_lib._save_state = failing_save_state
started = time.monotonic()
try:
    model.save_weights(os.path.join(out, "failed.weights.h5"))
except (OSError, RuntimeError) as error:
    report["failed"] = [
        type(error).__name__, str(error), time.monotonic() - started]
saving_lib._save_state = save_state
# The chief saves alone: a clear error within the collective timeout.
if strategy.is_chief:
    try:
        model.save_weights(os.path.join(out, "alone.weights.h5"))
    except RuntimeError as error:
        report["alone"] = str(error)
context.context().wait_at_barrier("test/after_alone", 120_000)
harness.write_result(report)
"""


def data():
    """32 examples: 8 features, 2 targets."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8)).astype("float32")
    return x, x[:, :2] * 0.5 - 1.0


def build():
    """A small compiled model with fixed weights (the same everywhere)."""
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, name="h"),
            keras.layers.Dense(2, name="o"),
        ]
    )
    model.compile(keras.optimizers.SGD(0.05), "mse")
    rng = np.random.default_rng(1)
    model.set_weights(
        [
            rng.normal(size=w.shape).astype("float32") * 0.3
            for w in model.get_weights()
        ]
    )
    return model


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    out = tmp_path_factory.mktemp("saves")
    return harness.run_workers(
        WORKER,
        num_workers=4,
        replicas_per_worker=1,
        timeout=420,
        args=[str(out)],
    ), out


@pytest.mark.multi_worker
@pytest.mark.timeout(540)
def test_save_then_load_on_every_process_ten_times(workers):
    results, _ = workers
    for r in results:
        for name in ("model_parallel", "data_parallel", "replicator"):
            assert r.result[name]["loaded"] == [True] * 10, (name, r.index)
        assert "unable to lock file" not in r.output


@pytest.mark.multi_worker
@pytest.mark.timeout(540)
def test_checkpoint_is_complete_when_fit_returns(workers):
    results, out = workers
    x, y = data()
    model = build()
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    expected = model.get_weights()
    for r in results:
        for name in ("model_parallel", "data_parallel", "replicator"):
            got = r.result[name]
            assert_weights_close(got["trained"], expected)
            assert_weights_close(got["checkpoint"], expected)
    # Only the chief wrote, each file once.
    # (The failed save's file, if Keras left one, aside.)
    written = [p.name for p in out.iterdir() if p.name != "failed.weights.h5"]
    assert sorted(written) == sorted(
        [
            f"{name}{suffix}"
            for name in ("model_parallel", "data_parallel", "replicator")
            for suffix in (".weights.h5", ".checkpoint.weights.h5")
        ]
        + ["slow.weights.h5", "slow_model_parallel.weights.h5"]
    )


@pytest.mark.multi_worker
@pytest.mark.timeout(540)
@pytest.mark.parametrize("save", ["slow", "slow_model_parallel"])
def test_the_others_wait_for_a_chief_writing_past_the_timeout(workers, save):
    """A whole save that takes longer than the collective timeout is waited
    for (a file's bound), not failed on the processes that do not write;
    under ModelParallel also where they wait between the chief's reads of
    sharded values, which every process joins."""
    results, out = workers
    for r in results:
        assert r.result[f"{save}_loaded"] is True, r.index
        # Each waited the chief's write out, past the 5 s collective bound.
        assert r.result[f"{save}_waited"] > 7, r.index
    assert (out / f"{save}.weights.h5").exists()


@pytest.mark.multi_worker
@pytest.mark.timeout(540)
def test_a_failed_chief_write_fails_every_process_at_once(workers):
    results, _ = workers
    kind, message, seconds = results[0].result["failed"]
    assert kind == "OSError" and "No space left" in message
    for r in results[1:]:
        kind, message, seconds = r.result["failed"]
        assert kind == "RuntimeError", r.index
        assert "whose write failed" in message and "No space left" in message
        assert "failed.weights.h5" in message
        # At once: not at the end of the 600 s a file's wait may take.
        assert seconds < 60, seconds


@pytest.mark.multi_worker
@pytest.mark.timeout(540)
def test_a_save_by_the_chief_alone_fails_clearly(workers):
    results, _ = workers
    chief = results[0].result
    assert "not under `if chief:`" in chief["alone"]
    assert "alone.weights.h5" in chief["alone"]
    assert all("alone" not in r.result for r in results[1:])
