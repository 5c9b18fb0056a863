"""The start-up watchdog: names unreachable peers and ends a stuck process."""

import pathlib
import subprocess
import sys
import time

from keras_replicator._src.cluster import discovery

WATCHDOG = (
    pathlib.Path(__file__).resolve().parents[1]
    / "keras_replicator/_src/cluster/startup_watchdog.py"
)


def _run(body_seconds, timeout_seconds):
    me, dead = discovery.free_port(), discovery.free_port()
    code = (
        "import importlib.util, time\n"
        "spec = importlib.util.spec_from_file_location("
        f"'w', {str(WATCHDOG)!r})\n"
        "w = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(w)\n"
        f"cluster = {{'worker': ['127.0.0.1:{me}', '127.0.0.1:{dead}']}}\n"
        f"with w.bounded_startup(cluster, '127.0.0.1:{me}', "
        f"{timeout_seconds}):\n"
        f"    time.sleep({body_seconds})\n"
        "print('DONE', flush=True)\n"
    )
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    return result, time.monotonic() - start, dead


def test_stuck_start_up_is_ended_naming_the_unreachable_peer():
    result, elapsed, dead = _run(body_seconds=30, timeout_seconds=2)
    assert result.returncode == -9  # SIGKILL: TF would ignore SIGTERM
    assert "DONE" not in result.stdout
    assert f"could not reach: worker:1 at 127.0.0.1:{dead}" in result.stderr
    assert "within 2 s" in result.stderr
    assert elapsed < 20


def test_start_up_in_time_leaves_no_watchdog_behind():
    result, _, _ = _run(body_seconds=0.1, timeout_seconds=3)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "DONE"
    assert "could not reach" not in result.stderr
