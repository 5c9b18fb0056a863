"""Re-creating a MultiWorkerReplicator, as keras.io's multi-worker guide does.

Workers run `workers/recreate_worker.py` under `keras-replicator launch
--workers 2` while another process keeps a core busy: fit and evaluate,
then three times re-create the replicator with `kr.auto()`, build or
`load_model` under its scope, and fit with a `ModelCheckpoint`.

- With worker 0 (the collective leader) 3 s late to every re-creation:
  before the fix it replaced its collective executor manager after worker
  1's first broadcast had reached it, and both waited forever, every run
  (worker 1 late did not hang: it is not where groups are resolved). The
  run ends, with one device's losses and weights.
- Worker 1 blocked after a re-creation: worker 0 waits in the broadcast of
  its first variable, and the hang watchdog ends it (10 s timeout) with
  its stacks and exit code 76.

`benchmarks/soak_recreate.py` runs the pattern 30 times.
"""

import re
import subprocess
import sys

import numpy as np
import pytest

from keras_replicator._src.core import env as env_names
from tests.multi_worker import harness
from tests.multi_worker import recreate_reference as ref

pytestmark = pytest.mark.multi_worker

WORKER = harness.REPO_ROOT / "tests/multi_worker/workers/recreate_worker.py"


@pytest.fixture(scope="module")
def one_device():
    return ref.reference()


@pytest.fixture
def busy_core():
    """Another process loading a core for the test's duration."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield
    proc.kill()
    proc.wait(timeout=30)


@pytest.mark.timeout(300)
def test_the_guide_pattern_with_a_late_chief_never_deadlocks(
    one_device, busy_core, tmp_path
):
    proc, results = harness.run_launcher(
        WORKER,
        [str(tmp_path)],
        num_workers=2,
        replicas_per_worker=1,
        env={
            "RECREATE_SLOW_WORKER": "0",
            "RECREATE_SLOW_SECONDS": "3",
            # A deadlock ends in a minute with every stack, not at the
            # test's timeout.
            env_names.HANG_SECONDS: "60",
        },
        timeout=240,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-8000:]
    assert "keras-replicator watchdog" not in out, out[-8000:]
    assert out.count("round 3 done") == 2
    for result in results:
        np.testing.assert_allclose(
            result["losses"], one_device["losses"], rtol=1e-5
        )
        for got, want in zip(
            result["weights"], one_device["weights"], strict=True
        ):
            np.testing.assert_allclose(np.array(got), want, atol=1e-5)


@pytest.mark.timeout(240)
def test_a_collective_blocked_at_variable_creation_is_ended(tmp_path):
    proc, _ = harness.run_launcher(
        WORKER,
        [str(tmp_path)],
        num_workers=2,
        replicas_per_worker=1,
        env={
            "RECREATE_BLOCK_WORKER": "1",
            "RECREATE_BLOCK_ROUND": "1",
            env_names.HANG_SECONDS: "10",
        },
        timeout=180,
    )
    out = proc.stdout
    assert "[worker 1] blocking in round 1" in out, out[-8000:]
    assert proc.returncode == 76, out[-8000:]
    # The header (worker 1 never published a state), the stacks, the exit.
    # The idle time is read when the watchdog looks (every second or so):
    # 10 s at least, more on a loaded machine.
    assert re.search(
        r"\[worker 0\] \[keras-replicator watchdog\] task worker:0: no "
        r"progress for 1\d s in the creation of variable 'kernel' \(its "
        r"initial value's broadcast from the chief\) "
        r"\(KERAS_REPLICATOR_HANG_SECONDS=10\); this process is stuck\. "
        r"No report from: worker:1\.",
        out,
    ), out[-8000:]
    assert "in _create_variable" in out
    assert "[worker 0] [keras-replicator watchdog] task worker:0: exiting " in (
        out
    )
    assert "worker 0 was ended by the hang watchdog (exit code 76" in out
