"""The harness' zygote starts workers as `python script` would."""

import os
import signal

import pytest

from tests.multi_worker import harness

WORKER = """
import os, signal, sys, tempfile
import numpy as np
from tests.multi_worker import harness

harness.write_result({
    "argv": sys.argv[1:],
    "path0": sys.path[0],
    "tmp": tempfile.gettempdir(),
    "mark": os.environ.get("ZYGOTE_TEST_MARK"),
    "seed": int(np.random.randint(1 << 30)),
    "session": os.getsid(0) == os.getpid(),
})
print("to stdout")
print("to stderr", file=sys.stderr)
if sys.argv[1] == "signal":
    os.kill(os.getpid(), signal.SIGTERM)
sys.exit(int(sys.argv[2]))
"""


@pytest.mark.multi_worker
@pytest.mark.timeout(120)
def test_a_zygote_worker_is_a_fresh_python_process(tmp_path):
    dirs = [tmp_path / "w0", tmp_path / "w1"]
    for d in dirs:
        d.mkdir()
    results = harness.run_workers(
        WORKER,
        num_workers=2,
        replicas_per_worker=1,
        args=["exit", "3"],
        env={"ZYGOTE_TEST_MARK": "yes"},
        env_for=lambda i: {"TMPDIR": str(dirs[i])},
        check=False,
        kill_on_failure=False,
        transport="grpc",
    )
    assert [r.returncode for r in results] == [3, 3]
    for r, d in zip(results, dirs, strict=True):
        assert r.result["argv"] == ["exit", "3"]
        assert r.result["mark"] == "yes"
        # TMPDIR is read again, not the zygote's own.
        assert r.result["tmp"] == str(d)
        assert r.result["session"]
        assert os.path.basename(r.result["path0"]).startswith("kr_workers_")
        assert "to stdout" in r.output and "to stderr" in r.output
    # Each worker draws its own NumPy seed, as a fresh process does.
    assert results[0].result["seed"] != results[1].result["seed"]


@pytest.mark.multi_worker
@pytest.mark.timeout(120)
def test_a_signal_and_a_raise_end_a_zygote_worker_as_they_end_python():
    killed = harness.run_workers(
        WORKER,
        num_workers=1,
        replicas_per_worker=1,
        args=["signal", "0"],
        check=False,
        transport="grpc",
    )
    assert killed[0].returncode == -signal.SIGTERM
    raised = harness.run_workers(
        "raise ValueError('from the worker')\n",
        num_workers=1,
        replicas_per_worker=1,
        check=False,
        transport="grpc",
    )
    assert raised[0].returncode == 1
    assert "ValueError: from the worker" in raised[0].output


@pytest.mark.multi_worker
@pytest.mark.timeout(120)
def test_run_python_runs_code_in_its_directory_with_its_own_streams(tmp_path):
    code = (
        "import os, sys; print(os.getcwd(), sys.argv[1:]); "
        "print('err', file=sys.stderr); sys.exit(4)"
    )
    result = harness.run_python(["-c", code, "a"], cwd=tmp_path)
    assert result.returncode == 4
    assert result.stdout.split() == [str(tmp_path), "['a']"]
    assert result.stderr.strip().splitlines()[-1] == "err"


@pytest.mark.multi_worker
@pytest.mark.timeout(120)
def test_run_python_sees_only_its_own_python_path(tmp_path):
    # Without the repository on its PYTHONPATH, the repository's `tests`
    # package is not importable, as in a fresh `python`; the package is.
    code = (
        "import importlib.util as u, keras_replicator; "
        "print(u.find_spec('tests') is None)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    alone = harness.run_python(["-c", code], env=env, cwd=tmp_path)
    assert alone.returncode == 0, alone.stderr
    assert alone.stdout.split()[-1] == "True"
    env["PYTHONPATH"] = str(harness.REPO_ROOT)
    with_repo = harness.run_python(["-c", code], env=env, cwd=tmp_path)
    assert with_repo.stdout.split()[-1] == "False", with_repo.stderr
