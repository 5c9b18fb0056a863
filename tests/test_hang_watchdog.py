"""The hang watchdog in one process, as a notebook on LocalReplicator sees it.

A fire here must not end the test process, so every test makes the
watchdog take this process for an interactive session: at its timeout it
prints every thread's stack and the loop raises a `RuntimeError` (what a
notebook gets). Real worker processes, the exit code and the launcher's
restart are in `tests/multi_worker/test_hang_watchdog.py`.
"""

import gc
import re
import signal
import sys
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator._src.core import env
from keras_replicator._src.training import hang_backstop
from keras_replicator._src.training import hang_watchdog
from keras_replicator._src.training import preemption

HANG = 2.0
# Longer than HANG: each of these would be a false alarm if it were timed.
SLOW = 3.0
# For tests in which nothing may fire: long enough for the timed parts of a
# loop (a step, an epoch's new iterator) on a machine whose cores are busy.
QUIET = 10.0
# For the test whose untimed parts each outlast the timeout.
UNTIMED_HANG = 6.0


@pytest.fixture(autouse=True)
def interactive(monkeypatch):
    monkeypatch.setattr(hang_watchdog, "interactive", lambda: True)
    # As in a notebook kernel, Ctrl-C raises KeyboardInterrupt, even when
    # pytest was started in the background with SIGINT ignored.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _model(replicator):
    keras.utils.set_random_seed(0)
    with replicator.scope():
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(2), keras.layers.Dense(1)]
        )
        model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def _data(n=64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype("float32")
    return x, x.sum(axis=1, keepdims=True)


class _BlockAt(keras.callbacks.Callback):
    """Never returns from the end of batch `batch` (its step is batch + 1)."""

    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            threading.Event().wait()


def test_a_stuck_callback_ends_the_fit_with_a_clear_error(capfd, monkeypatch):
    # None reads the variable at each loop's start: the whole fit after the
    # fire runs with the watchdog off, so a busy core cannot fire it.
    model = _model(kr.LocalReplicator(2, hang_seconds=None))
    monkeypatch.setenv(env.HANG_SECONDS, str(HANG))
    x, y = _data()
    with pytest.raises(RuntimeError, match="hang watchdog stopped this fit"):
        model.fit(x, y, batch_size=8, callbacks=[_BlockAt(3)], verbose=0)
    err = capfd.readouterr().err
    assert "[keras-replicator watchdog] task local (pid" in err
    # The warning first, then the header and the stuck thread's stack.
    assert "s in fit, step 4 (epoch 1); the slowest step so far" in err
    assert re.search(r" step 4: no progress for \d+ s in fit \(epoch 1\)", err)
    assert "in on_train_batch_end" in err
    assert "interrupting the fit loop" in err
    # The process goes on: the same model trains again.
    monkeypatch.setenv(env.HANG_SECONDS, "0")
    model.fit(x, y, batch_size=8, verbose=0)


class _SignalThenBlockAt(keras.callbacks.Callback):
    """At the end of batch `batch`: a preemption signal, then no return."""

    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            signal.raise_signal(signal.SIGUSR1)
            threading.Event().wait()


def test_a_preemption_signal_no_step_end_acts_on_ends_the_fit(
    capfd, monkeypatch
):
    # A signal during fit is acted on at a step end. A step that never
    # ends (a callback here; a deadlocked collective alike) kept the
    # process deaf to it until the timeout (10 min here). With a signal
    # pending the bound is the stall warning's: 60 s at least (1 s here),
    # 10 times the slowest step.
    monkeypatch.setattr(hang_watchdog, "_WARN_FLOOR_SECONDS", 1.0)
    model = _model(kr.LocalReplicator(2, hang_seconds=600))
    x, y = _data()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="hang watchdog stopped this fit"):
        model.fit(
            x,
            y,
            batch_size=8,
            callbacks=[_SignalThenBlockAt(2)],
            verbose=0,
        )
    assert time.monotonic() - start < 120
    err = capfd.readouterr().err
    assert re.search(
        r"step 3: no progress for \d+ s in fit \(epoch 1\), reaching a "
        r"step end after SIGUSR1 \(a preemption signal waits at most",
        err,
    ), err
    assert "in on_train_batch_end" in err
    # Not delivered again after the fit: the error reported it.
    assert preemption.pending() is None


def test_the_error_chains_the_interrupted_traceback():
    model = _model(kr.LocalReplicator(2, hang_seconds=HANG))
    x, y = _data()
    with pytest.raises(RuntimeError) as info:
        model.fit(x, y, batch_size=8, callbacks=[_BlockAt(0)], verbose=0)
    assert isinstance(info.value.__cause__, KeyboardInterrupt)
    assert f"Received: hang_seconds={HANG:g}" in str(info.value)


class _StuckInTheCollector(keras.callbacks.Callback):
    """At a batch end, waits in garbage-collector callbacks, then blocks.

    Python ignores any exception raised in a `gc.callbacks` callback, an
    interrupt included: the first interrupt lands there while the callback
    sleeps. Then the loop blocks (about 30 s at most, so that a lost
    interrupt fails the test instead of hanging it) until interrupted
    again.
    """

    def __init__(self):
        super().__init__()
        self.swallowed = threading.Event()

    def on_train_batch_end(self, batch, logs=None):
        if batch != 1:
            return

        def sleep_in_the_collector(phase, info):
            if phase == "start" and not self.swallowed.is_set():
                try:
                    time.sleep(0.1)
                except KeyboardInterrupt:
                    self.swallowed.set()
                    raise

        gc.callbacks.append(sleep_in_the_collector)
        try:
            while not self.swallowed.is_set():
                gc.collect(0)
        finally:
            gc.callbacks.remove(sleep_in_the_collector)
        threading.Event().wait(30)


def test_an_interrupt_python_ignores_is_sent_again(capfd):
    model = _model(kr.LocalReplicator(2, hang_seconds=HANG))
    x, y = _data()
    started = time.monotonic()
    stuck = _StuckInTheCollector()
    with pytest.raises(RuntimeError, match="hang watchdog stopped this fit"):
        model.fit(x, y, batch_size=8, callbacks=[stuck], verbose=0)
    assert stuck.swallowed.is_set()
    assert time.monotonic() - started < 25
    err = capfd.readouterr().err
    assert "the interrupt landed where Python ignores exceptions" in err
    assert "sleep_in_the_collector" in err
    # The hook it put in place for the fit is gone.
    assert not isinstance(sys.unraisablehook, hang_watchdog._Resend)


def test_no_false_alarm_for_a_slow_first_step_saves_and_validation(
    tmp_path, capfd
):
    # A 6 s timeout: the timed parts (steps, epoch ends) stay far below it
    # with both cores busy; each untimed part sleeps longer than it.
    model = _model(kr.LocalReplicator(2, hang_seconds=UNTIMED_HANG))
    slept = []

    def slow_once(function, what):
        def slow(*args, **kwargs):
            if what not in slept:
                slept.append(what)
                time.sleep(UNTIMED_HANG + 1)
            return function(*args, **kwargs)

        return slow

    # Traced once each: the first step of fit and of its validation.
    model.train_step = slow_once(model.train_step, "train trace")
    model.test_step = slow_once(model.test_step, "test trace")
    save_weights = model.save_weights
    saves = []

    def slow_save(*args, **kwargs):
        saves.append(1)
        save_weights(*args, **kwargs)
        if len(saves) <= 2:  # the first backup and the first checkpoint
            time.sleep(UNTIMED_HANG + 1)

    model.save_weights = slow_save
    x, y = _data()
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        validation_data=_data(16),
        callbacks=[
            keras.callbacks.BackupAndRestore(str(tmp_path / "backup")),
            keras.callbacks.ModelCheckpoint(
                str(tmp_path / "ckpt.weights.h5"), save_weights_only=True
            ),
        ],
        verbose=0,
    )
    assert slept == ["train trace", "test trace"]
    # Both checkpoints and the first backup: the second, at the training's
    # end, would be deleted unread (Keras' `delete_checkpoint=True`).
    assert len(saves) == 3
    # A stall warning (at half the timeout) may come on a busy machine; the
    # watchdog must not fire.
    err = capfd.readouterr().err
    assert "this process is stuck" not in err
    assert "interrupting the" not in err


@pytest.mark.parametrize("where", ["first step", "save"])
def test_what_is_not_timed_is_bounded_at_five_timeouts(
    where, tmp_path, capfd, monkeypatch
):
    # A first step or a save may wait in a collective for a stuck worker:
    # untimed, but not forever (5 s here). Each replica's trace sleeps 4 s
    # (the replicas trace one after the other); the save blocks.
    # For a save, the step is traced first by a fit with the watchdog off
    # (None reads the variable at each loop's start), so that a slow
    # trace on a busy machine cannot be what fires.
    model = _model(kr.LocalReplicator(2, hang_seconds=None))
    x, y = _data(16)
    if where == "first step":
        train_step = model.train_step

        def slow_trace(data):
            time.sleep(4)
            return train_step(data)

        model.train_step = slow_trace
    else:
        monkeypatch.setenv(env.HANG_SECONDS, "0")
        model.fit(x, y, batch_size=8, verbose=0)
        save_weights = model.save_weights

        def blocked_save(*args, **kwargs):
            save_weights(*args, **kwargs)
            threading.Event().wait()  # Until the watchdog interrupts it.

        model.save_weights = blocked_save
    # A save is timed from step 2's end: 2 s there, so that a busy core
    # stalling step 2 past the timeout cannot be what fires (10 s bound).
    monkeypatch.setenv(env.HANG_SECONDS, "1" if where == "first step" else "2")
    # Kept: a backup deleted at the end is not made at the end.
    backup = keras.callbacks.BackupAndRestore(
        str(tmp_path / "backup"), delete_checkpoint=False
    )
    with pytest.raises(RuntimeError, match="hang watchdog stopped this fit"):
        model.fit(x, y, batch_size=8, callbacks=[backup], verbose=0)
    what = "its first step" if where == "first step" else "a checkpoint save"
    assert f"in {what}, which is given 5 times the timeout" in (
        capfd.readouterr().err
    )


def test_evaluate_and_predict_are_watched(capfd, monkeypatch):
    # The fit that trains first runs with the watchdog off (None reads the
    # variable at each loop's start): a busy core stalling its epoch's end
    # past 2 s must not be what fires.
    model = _model(kr.LocalReplicator(2, hang_seconds=None))
    x, y = _data()
    monkeypatch.setenv(env.HANG_SECONDS, "0")
    model.fit(x, y, batch_size=8, verbose=0)
    monkeypatch.setenv(env.HANG_SECONDS, str(HANG))

    class BlockTest(keras.callbacks.Callback):
        def on_test_batch_end(self, batch, logs=None):
            if batch == 2:
                threading.Event().wait()

    class BlockPredict(keras.callbacks.Callback):
        def on_predict_batch_end(self, batch, logs=None):
            if batch == 2:
                threading.Event().wait()

    with pytest.raises(RuntimeError, match="stopped this evaluate"):
        model.evaluate(x, y, batch_size=8, callbacks=[BlockTest()], verbose=0)
    with pytest.raises(RuntimeError, match="stopped this predict"):
        model.predict(x, batch_size=8, callbacks=[BlockPredict()], verbose=0)
    err = capfd.readouterr().err
    assert re.search(r" step 3: no progress for \d+ s in evaluate", err)
    assert re.search(r" step 3: no progress for \d+ s in predict", err)


def test_replicate_times_each_call_not_the_time_between_calls(capfd):
    replicator = kr.LocalReplicator(2, hang_seconds=HANG)
    delay = [0.0]

    def wait(value):
        time.sleep(delay[0])
        return value

    def step_fn(batch):
        return tf.py_function(wait, [tf.reduce_sum(batch)], tf.float32)

    def input_fn(ctx):
        return tf.data.Dataset.from_tensors(tf.ones([2])).repeat()

    step = replicator.replicate(step_fn, input_fn)
    step()  # traces
    step()
    time.sleep(SLOW)  # the caller's own time between calls
    step()
    # (A stall warning may come on a busy machine; no fire.)
    assert "this process is stuck" not in capfd.readouterr().err
    delay[0] = SLOW
    # Raised when the call returns: Python cannot interrupt TensorFlow.
    with pytest.raises(RuntimeError, match="stopped this replicate"):
        step()
    err = capfd.readouterr().err
    assert re.search(r" step 4: no progress for \d+ s in replicate", err)
    delay[0] = 0.0
    step()  # the step still works


def test_off_and_stock_strategies_are_not_watched(monkeypatch):
    seen = []

    class Look(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(list(hang_watchdog._watchdog.frames))

    x, y = _data(16)
    model = _model(kr.LocalReplicator(2, hang_seconds=0))
    model.fit(x, y, batch_size=8, callbacks=[Look()], verbose=0)
    assert [f.seconds for f in seen[-1]] == [None]
    monkeypatch.setenv(env.HANG_SECONDS, "off")
    model = _model(kr.LocalReplicator(2))
    model.fit(x, y, batch_size=8, callbacks=[Look()], verbose=0)
    assert [f.seconds for f in seen[-1]] == [None]
    model = _model(tf.distribute.get_strategy())
    model.fit(x, y, batch_size=8, callbacks=[Look()], verbose=0)
    assert seen[-1] == []


def test_settings_are_validated(monkeypatch):
    assert hang_watchdog.resolve_seconds() == 600
    for text, seconds in (("30", 30.0), ("0", None), ("off", None)):
        monkeypatch.setenv(env.HANG_SECONDS, text)
        assert hang_watchdog.resolve_seconds() == seconds
    assert hang_watchdog.resolve_seconds(5) == 5.0
    assert hang_watchdog.resolve_seconds(0) is None
    for bad in ("-1", "soon", "inf"):
        monkeypatch.setenv(env.HANG_SECONDS, bad)
        with pytest.raises(ValueError, match=f"Received: '{bad}'"):
            hang_watchdog.resolve_seconds()
    for bad in (-1, True, float("inf"), "600"):
        with pytest.raises(ValueError, match=re.escape(f"={bad!r}")):
            kr.LocalReplicator(2, hang_seconds=bad)
    assert kr.LocalReplicator(2, hang_seconds=30).hang_seconds == 30


def test_the_stall_warning_comes_before_the_timeout():
    # 60 s, or 10 times the slowest step, at most half the timeout.
    assert hang_watchdog.warn_seconds(600, 0.1) == 60
    assert hang_watchdog.warn_seconds(600, 12) == 120
    assert hang_watchdog.warn_seconds(600, 100) == 300
    assert hang_watchdog.warn_seconds(20, 0.1) == 10


def _backstop_in():
    """Seconds until the armed backstop prints the stacks, or None."""
    at = hang_backstop.armed_at()
    return None if at is None else at - time.monotonic()


def _wait_for_disarm():
    # The thread checks every QUIET / 20 s; a busy machine may delay it.
    deadline = time.monotonic() + 10
    while _backstop_in() is not None:
        assert time.monotonic() < deadline, "the backstop stayed armed"
        time.sleep(0.1)


def test_the_backstop_follows_the_watchdog_and_stands_down_with_it(tmp_path):
    # The backstop fires the margin (10 s here) after the watchdog would:
    # the timeout after the last step, 5 timeouts into a first step or a
    # save.
    margin = hang_watchdog.backstop_margin(QUIET)
    assert margin == 10.0
    assert hang_watchdog.backstop_margin(600) == 300.0
    model = _model(kr.LocalReplicator(2, hang_seconds=QUIET))
    seen = {}
    train_step = model.train_step

    def traced(data):
        seen.setdefault("first step", hang_backstop.armed_at())
        return train_step(data)

    model.train_step = traced
    save_weights = model.save_weights

    def save(*args, **kwargs):
        seen.setdefault("save", _backstop_in())
        return save_weights(*args, **kwargs)

    model.save_weights = save

    class Look(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3:
                seen["step"] = _backstop_in()

    x, y = _data()
    started = time.monotonic()
    model.fit(
        x,
        y,
        batch_size=8,
        callbacks=[
            Look(),
            # Kept: a backup deleted at the end is not made at the end.
            keras.callbacks.BackupAndRestore(
                str(tmp_path / "backup"), delete_checkpoint=False
            ),
        ],
        verbose=0,
    )
    untimed = 5 * QUIET + margin
    # From the start of fit, however long tracing took to begin. Each read
    # comes a moment after the deadline moved: up to 10 s on a busy machine
    # (fit's set-up before the watch starts included).
    assert 0 <= seen["first step"] - (started + untimed) < 10
    assert untimed - 5 < seen["save"] <= untimed
    # Moved only when it would move by more than half the margin.
    assert QUIET + margin / 2 - 5 < seen["step"] <= QUIET + margin
    # An interactive process (these tests) only gets the stacks.
    assert not hang_backstop._backstop.ends
    # Outside a loop the watchdog's thread disarms it at its next check.
    _wait_for_disarm()

    def step_fn(batch):
        return tf.reduce_sum(batch)

    def input_fn(ctx):
        return tf.data.Dataset.from_tensors(tf.ones([2])).repeat()

    step = kr.LocalReplicator(2, hang_seconds=QUIET).replicate(
        step_fn, input_fn
    )
    step()
    step()
    _wait_for_disarm()  # between calls: not timed
    model = _model(kr.LocalReplicator(2, hang_seconds=0))
    model.fit(x, y, batch_size=8, callbacks=[Look()], verbose=0)
    assert seen["step"] is None


KERNEL_CELL = """
import gc, threading, time
import keras, numpy as np
import keras_replicator as kr

swallowed = threading.Event()

class StuckInTheCollector(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch != 1:
            return
        def sleep_in_the_collector(phase, info):
            if phase == "start" and not swallowed.is_set():
                try:
                    time.sleep(0.1)
                except KeyboardInterrupt:
                    swallowed.set()
                    raise
        gc.callbacks.append(sleep_in_the_collector)
        try:
            while not swallowed.is_set():
                gc.collect(0)
        finally:
            gc.callbacks.remove(sleep_in_the_collector)
        threading.Event().wait(30)

# 4 s: the first step (a fresh kernel's first trace, on busy cores) may
# take 5 timeouts before the fire would land in it instead of batch 1.
with kr.LocalReplicator(2, hang_seconds=4).scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
x = np.ones((64, 4), "float32")
try:
    model.fit(x, x[:, :1], batch_size=8, callbacks=[StuckInTheCollector()],
              verbose=0)
except RuntimeError as error:
    print("RESULT", type(error.__cause__).__name__, swallowed.is_set())
model.fit(x, x[:, :1], batch_size=8, verbose=0)
print("TRAINS AGAIN")
"""


@pytest.mark.timeout(240)
def test_a_notebook_kernel_gets_the_error_when_the_collector_ate_the_interrupt(
    tmp_path,
):
    # A real Jupyter kernel: the watchdog finds it interactive by itself.
    from tests.multi_worker import harness

    with harness.jupyter_kernel(tmp_path) as (_, client):
        reply, output = harness.execute_cell(client, KERNEL_CELL, timeout=180)
    assert reply["status"] == "ok", output
    assert "RESULT KeyboardInterrupt True" in output, output
    assert "the interrupt landed where Python ignores exceptions" in output
    assert "TRAINS AGAIN" in output
