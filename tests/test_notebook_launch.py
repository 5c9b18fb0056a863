"""kr.launch from a script: argument checks and failing workers.

The notebook case (a function defined in a kernel's cell, interrupts) is in
tests/multi_worker/test_notebook_launch.py. These workers run no
TensorFlow op, so each launch costs only the import of keras_replicator.
"""

import json
import os
import threading
import time

import pytest

import keras_replicator as kr
from keras_replicator._src.cluster import notebook_launch


def _task_index():
    return json.loads(os.environ["TF_CONFIG"])["task"]["index"]


def _fail_on_worker_1(folder):
    if _task_index() == 1:
        # Once worker 0 is up, so that the test sees it ended.
        deadline = time.monotonic() + 60
        while not os.listdir(folder) and time.monotonic() < deadline:
            time.sleep(0.1)
        raise ValueError("bad data on worker 1")
    with open(os.path.join(folder, str(os.getpid())), "w") as f:
        f.write("up")
    time.sleep(600)


def _exit_without_result():
    os._exit(3)


def _exit_as_the_hang_watchdog_does():
    os._exit(76)


def _index_and_kwarg(scale, *, offset):
    return _task_index() * scale + offset


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        (dict(fn=3), TypeError, "Received: fn=3"),
        (dict(workers=0), ValueError, "Received: workers=0"),
        (dict(ps=-1), ValueError, "Received: ps=-1"),
        (dict(replicas_per_worker=0), ValueError, "replicas_per_worker=0"),
    ],
)
def test_rejects_bad_arguments(kwargs, error, text):
    fn = kwargs.pop("fn", _task_index)
    with pytest.raises(error, match=text):
        kr.launch(fn, **kwargs)


def test_rejects_what_cloudpickle_cannot_send():
    lock = threading.Lock()
    with pytest.raises(TypeError, match="cloudpickle, which failed"):
        kr.launch(lambda: lock.acquire(), workers=1)


@pytest.mark.timeout(120)
def test_returns_values_in_worker_order_with_args_and_kwargs():
    assert kr.launch(_index_and_kwarg, 10, workers=3, offset=1) == [1, 11, 21]


@pytest.mark.timeout(120)
def test_a_worker_error_is_raised_with_its_traceback_and_others_end(
    tmp_path,
):
    start = time.monotonic()
    with pytest.raises(ValueError, match="bad data on worker 1") as info:
        kr.launch(_fail_on_worker_1, str(tmp_path), workers=2)
    assert time.monotonic() - start < 60
    cause = info.value.__cause__
    assert isinstance(cause, notebook_launch.RemoteTraceback)
    assert "worker 1 raised" in str(cause)
    assert "in _fail_on_worker_1" in str(cause)
    pids = [int(p.name) for p in tmp_path.iterdir()]
    assert len(pids) == 1
    assert not [pid for pid in pids if _alive(pid)]


@pytest.mark.timeout(120)
def test_a_worker_that_exits_without_a_result_is_named():
    with pytest.raises(RuntimeError) as info:
        kr.launch(_exit_without_result, workers=2)
    assert "ended without returning a result" in str(info.value)
    assert "Received: exit_code=3" in str(info.value)


@pytest.mark.timeout(120)
def test_a_worker_ended_by_the_hang_watchdog_is_named():
    with pytest.raises(
        RuntimeError, match="The hang watchdog ended it"
    ) as info:
        kr.launch(_exit_as_the_hang_watchdog_does, workers=2)
    assert "Received: exit_code=76" in str(info.value)
