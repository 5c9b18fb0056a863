"""What a person reads: one 2-worker `fit` under each launcher.

The script (workers/output_script.py: 3 epochs, `BatchNormalization`,
`BackupAndRestore`) runs as a user leaves it: no `TF_CPP_MIN_LOG_LEVEL`.
Besides Keras' progress bar and the script's own lines, under plain
`mpiexec` it prints at most 5 lines (no TensorFlow C++ start-up logs, no
coordination-service barrier lines, Keras' warnings once, not once per
worker); under `keras-replicator launch`, over gRPC and over MPI, every
line names its worker (`[worker i] `) or is the launcher's (`[launch] `).
"""

import os
import re
import subprocess
import sys

import pytest

from tests.multi_worker import harness

pytestmark = pytest.mark.multi_worker

SCRIPT = harness.REPO_ROOT / "tests/multi_worker/workers/output_script.py"
# Keras' progress bar: the epoch headers and the bar's redrawn line.
_PROGRESS = re.compile(r"^(Epoch \d+/\d+|.*━.*|\s*\d+/\d+ .*step.*)$")
_PREFIX = re.compile(r"^\[(worker [01]|launch)\] ")


def _user_env():
    """The environment a user's shell has: no cluster, no log level set."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CONFIG", "TF_CPP_MIN_LOG_LEVEL", harness.RESULT_ENV)
        and not k.startswith(("SLURM_", "PMI_", "PMIX_", "OMPI_"))
        and not k.startswith("KERAS_REPLICATOR_")
    }
    env["PYTHONPATH"] = str(harness.REPO_ROOT)
    env["KERAS_REPLICATOR_CPU_REPLICAS"] = "1"
    return env


def _run(argv, tmp_path):
    # Bytes, not text: text mode would turn the bar's "\r" into newlines.
    result = subprocess.run(
        [*map(str, argv), str(tmp_path / "backup")],
        capture_output=True,
        timeout=300,
        env=_user_env(),
        cwd=tmp_path,
    )
    output = (result.stdout + result.stderr).decode(errors="replace")
    assert result.returncode == 0, output[-4000:]
    # Lines end at "\n" only: the progress bar redraws after a "\r".
    return output.split("\n")


def _others(lines, prefixed):
    """The lines besides the progress bar and the script's own."""
    out = []
    for line in lines:
        text = _PREFIX.sub("", line) if prefixed else line
        if not text.strip() or _PROGRESS.match(text):
            continue
        if text.startswith("SCRIPT: "):
            continue
        out.append(line)
    return out


def _launch(transport):
    return [
        *harness.command_line(),
        "launch",
        "--workers",
        "2",
        "--replicas-per-worker",
        "1",
        "--transport",
        transport,
        "--",
        sys.executable,
        SCRIPT,
    ]


@pytest.mark.timeout(400)
def test_plain_mpiexec_prints_at_most_five_lines_besides_the_bar(tmp_path):
    lines = _run([*harness.mpiexec_command(2), SCRIPT], tmp_path)
    others = _others(lines, prefixed=False)
    text = "\n".join(lines)
    assert len(others) <= 5, "\n".join(others)
    assert lines.count("SCRIPT: done") == 2, text[-3000:]
    assert sum("Epoch 3/3" in line for line in lines) == 1, text[-3000:]
    assert not [line for line in lines if "I0000" in line or "E0000" in line]
    assert "Barrier(" not in text
    # Keras' warning, once (the chief's), attributed to Keras' own code.
    shuffle = [line for line in others if "`shuffle=True` was passed" in line]
    assert len(shuffle) == 1, "\n".join(others)
    assert "/keras/src/" in shuffle[0], shuffle[0]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("transport", ["grpc", "mpi"])
def test_launch_names_the_worker_on_every_line(transport, tmp_path):
    lines = _run(_launch(transport), tmp_path)
    text = "\n".join(lines)
    for line in filter(None, lines):
        assert _PREFIX.match(line), f"unprefixed line {line!r}\n{text[-3000:]}"
    for worker in (0, 1):
        assert f"[worker {worker}] SCRIPT: done" in lines, text[-3000:]
    others = _others(lines, prefixed=True)
    assert len(others) <= 5, "\n".join(others)
    assert sum("Epoch 3/3" in line for line in lines) == 1, text[-3000:]
    assert "Barrier(" not in text
