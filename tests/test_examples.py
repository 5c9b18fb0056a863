"""The paper's three workloads: each example's --smoke run, end to end.

Each runs as its own process (as a user runs it), with a bounded timeout,
and prints a final `RESULT {json}` line that the test checks.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _smoke(name, *args, timeout=180):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), "--smoke", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.timeout(200)
def test_resnet_smoke_learns():
    result = _smoke("resnet.py", "--accumulation-steps", "2")
    assert result["initial_accuracy"] < 0.3
    assert result["final_accuracy"] > 0.8


@pytest.mark.timeout(200)
def test_sngan_smoke_moves_samples_onto_the_modes():
    result = _smoke("sngan.py")
    # Generated points start ~1.7 from the nearest mode (the ring's radius
    # is 2) and must end much closer, spread over most modes.
    assert result["final_mode_distance"] < 0.6 * result["initial_mode_distance"]
    assert result["final_modes"] >= 6


@pytest.mark.timeout(200)
def test_d4pg_smoke_return_improves():
    pytest.importorskip("gymnasium")
    result = _smoke("d4pg.py")
    # Random-ish start: about -1000 or worse; must gain several hundred.
    assert result["final_return"] > result["initial_return"] + 300
