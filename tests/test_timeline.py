"""`kr.callbacks.Timeline` in one process, and the trace's arithmetic.

Over 2 processes on both transports it is
tests/multi_worker/test_timeline.py's.
"""

import json

import keras
import numpy as np
import pytest

import keras_replicator as kr
from keras_replicator._src.callbacks import timeline
from keras_replicator._src.core import trace_events


def _fit(callbacks=()):
    replicator = kr.LocalReplicator(2)
    with replicator.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    x = np.ones((32, 4), "float32")
    model.fit(
        x,
        x[:, :1],
        batch_size=8,
        epochs=2,
        verbose=0,
        callbacks=list(callbacks),
    )


def _steps(path):
    trace = json.loads(path.read_text())
    return [e for e in trace["traceEvents"] if e.get("cat") == "step"]


def test_a_fit_writes_its_steps_and_says_where(tmp_path, capsys):
    path = tmp_path / "trace.json"
    _fit([kr.callbacks.Timeline(path)])
    steps = _steps(path)
    assert [e["name"] for e in steps] == [f"step {i}" for i in range(1, 9)]
    assert [e["args"]["epoch"] for e in steps] == [1] * 4 + [2] * 4
    assert all(e["pid"] == 0 and e["dur"] > 0 for e in steps)
    line = capsys.readouterr().err
    assert f"timeline written to {path}: 1 process, 8 steps." in line


def test_the_environment_adds_a_timeline_to_every_fit(tmp_path, monkeypatch):
    path = tmp_path / "env.json"
    monkeypatch.setenv("KERAS_REPLICATOR_TIMELINE", str(path))
    _fit()
    assert len(_steps(path)) == 8


class _Fails(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 2:
            raise RuntimeError("a failing step")


def test_a_fit_that_raises_stops_the_timeline(tmp_path):
    # Keras ends no callback when `fit` raises: the replicator's `fit`
    # releases the timeline itself, so nothing goes on recording and the
    # next fit's trace holds its own steps only.
    path = tmp_path / "failed.json"
    with pytest.raises(RuntimeError, match="a failing step"):
        _fit([kr.callbacks.Timeline(path), _Fails()])
    assert not trace_events.recording()
    assert not path.exists()
    again = tmp_path / "again.json"
    _fit([kr.callbacks.Timeline(again)])
    assert len(_steps(again)) == 8


@pytest.mark.parametrize("path", ["", None, 3])
def test_a_path_that_is_no_path_is_refused(path):
    with pytest.raises(ValueError, match="Received: path="):
        kr.callbacks.Timeline(path)


def _collective(ts, dur, op="allreduce"):
    return {
        "name": "all-reduce",
        "cat": "collective",
        "ph": "X",
        "ts": ts,
        "dur": dur,
        "args": {"op": op, "bytes": 8},
    }


def _step(ts, dur):
    return {
        "name": "step",
        "cat": "step",
        "ph": "X",
        "ts": ts,
        "dur": dur,
        "args": {},
    }


def test_a_collectives_wait_is_the_latest_arrival_less_its_own():
    # Process 1 computes 3 ms longer: process 0 waits 3 ms in the all-reduce.
    trace = timeline.merge(
        {
            0: [_step(0, 10_000), _collective(5_000, 5_000)],
            1: [_step(0, 10_000), _collective(8_000, 2_000)],
        }
    )
    waits = {
        e["pid"]: e["args"]["wait_us"]
        for e in trace["traceEvents"]
        if e.get("cat") == "collective"
    }
    assert waits == {0: 3_000, 1: 0}
    line = timeline.summary(trace, "t.json")
    assert "Slowest: worker 1, a median step of 10.0 ms, 8.0 ms of it" in line
    assert "(the others: 5.0 ms)" in line
    assert "It waited most on all-reduce allreduce: 0.00 ms" in line
