"""`keras-replicator launch -- python quickstart.py` from a fresh shell.

In a shell where the virtual environment is not active, `python` is the
system's (no Keras); the launcher runs the workers on its own interpreter
instead, says so on stderr, and hides TensorFlow's C++ start-up logs.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest

from keras_replicator._src.cluster import tf_logs
from tests.multi_worker import harness

# The README's quickstart, printing the last epoch's loss.
QUICKSTART = """\
import keras
import numpy as np
import keras_replicator as kr

replicator = kr.auto()
with replicator.scope():
    model = keras.Sequential([keras.Input((8,)),
                              keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
rng = np.random.default_rng(0)
x, y = rng.random((256, 8)), rng.random((256, 1))
history = model.fit(x, y, batch_size=64, epochs=2, verbose=0)
print(type(replicator).__name__, "loss", history.history["loss"][-1])
"""
LOSS = re.compile(r"^\[worker (\d)\] MultiWorkerReplicator loss (\S+)$", re.M)


def _fresh_shell_env():
    """This environment as a new shell has it: the venv's bin not on PATH."""
    venv_bin = os.path.dirname(os.path.abspath(sys.executable))
    path = os.pathsep.join(
        p
        for p in os.environ.get("PATH", "").split(os.pathsep)
        if p and os.path.abspath(p) != venv_bin
    )
    env = dict(os.environ, PATH=path, PYTHONPATH=str(harness.REPO_ROOT))
    for name in ("VIRTUAL_ENV", tf_logs.LEVEL_ENV, "TF_CONFIG"):
        env.pop(name, None)
    return env


@pytest.mark.multi_worker
def test_launch_trains_with_the_launchers_python_from_a_fresh_shell(
    tmp_path,
):
    (tmp_path / "quickstart.py").write_text(QUICKSTART)
    env = _fresh_shell_env()
    system_python = shutil.which("python", path=env["PATH"])
    result = subprocess.run(
        [
            *harness.command_line(),
            "launch",
            "--workers",
            "2",
            "--",
            "python",
            "quickstart.py",
        ],
        capture_output=True,
        text=True,
        # The launcher's workers die with it (its reaper) at the timeout.
        timeout=420,
        cwd=tmp_path,
        env=env,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    note = (
        f"[launch] `python` is {system_python}"
        if system_python
        else "[launch] `python` is not on PATH"
    )
    assert result.stderr.splitlines()[0].startswith(note), result.stderr
    assert f"the workers run {sys.executable}" in result.stderr
    losses = dict(LOSS.findall(result.stdout))
    assert sorted(losses) == ["0", "1"], result.stdout[-4000:]
    # One cluster: both workers trained the same model on the same data.
    assert float(losses["0"]) == pytest.approx(float(losses["1"]))
    startup = tf_logs.StartupLogFilter()
    shown = [line for line in output.splitlines() if not startup.keep(line)]
    assert not shown, shown
    assert "cuInit" not in output
