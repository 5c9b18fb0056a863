"""`keras.distribution.initialize()` with no arguments, under every launcher.

On JAX a script calls `initialize()` and the launcher's environment says
who the processes are; here the same call must find the cluster wherever
our discovery does, with no TF_CONFIG and no cluster code in the script:

- under `mpiexec -n 2` (PyPI's mpich; the ranks exchange addresses with
  mpi4py),
- as two tasks of a Slurm job step on one node (emulated: two real local
  processes with the variables `srun` sets, ports derived from the job id).

`keras-replicator launch` is test_distribution_gemma.py's, and
`kr.launch(fn, workers=2)` from a Jupyter kernel test_notebook_launch.py's.

Each run is 2 processes x 2 CPU replicas training `distribution_reference`
under keras.distribution; both processes must end with one device's
history and weights. One one-device reference serves every test.
"""

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.multi_worker import distribution_reference
from tests.multi_worker import harness

pytestmark = pytest.mark.multi_worker

WORKER = (
    harness.REPO_ROOT
    / "tests/multi_worker/workers/distribution_discovery_worker.py"
)
DEVICES = [f"/job:worker/task:{t}/cpu:{i}" for t in range(2) for i in range(2)]
# Seconds one run of 2 processes may take (each starts TensorFlow; the
# machine may be loaded); the pytest timeouts add room for the reference.
RUN_TIMEOUT = 150
# Output that means a port was taken between our probe and the bind.
PORT_CLASH = ("Address already in use", "Failed to add port")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return distribution_reference.one_device_run(
        tmp_path_factory.mktemp("distribution_launchers")
    )


def _launcher_free_env(extra):
    """This environment without any cluster, plus `extra`.

    No TF_CONFIG, Slurm, MPI or Keras cluster variables leak in from the
    caller: the cluster must come from what the launcher sets alone.
    """
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CONFIG", harness.RESULT_ENV, "KERAS_REPLICATOR_PORT")
        and not k.startswith(
            ("SLURM_", "PMI_", "PMIX_", "OMPI_", "KERAS_DISTRIBUTION_")
        )
    }
    env.update(
        PYTHONPATH=str(harness.REPO_ROOT),
        TF_CPP_MIN_LOG_LEVEL="3",
        KERAS_REPLICATOR_CPU_REPLICAS="2",
    )
    env.update(extra)
    return env


def _run_group(commands, envs, out_dir, timeout=RUN_TIMEOUT):
    """Runs `commands[i]` with `envs[i]`, each in its own session.

    Waits at most `timeout` s, ends every process as soon as one fails,
    and returns `(exit codes, output of each)`; a code of None means the
    process was still running when the group was ended (the timeout
    passed, or another process failed) and was killed.
    """
    logs = [Path(out_dir) / f"output{i}.txt" for i in range(len(commands))]
    procs = []
    try:
        for command, env, log in zip(commands, envs, logs, strict=True):
            with open(log, "w") as out:
                procs.append(
                    subprocess.Popen(
                        [str(c) for c in command],
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        cwd=harness.REPO_ROOT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes) or any(
                c not in (None, 0) for c in codes
            ):
                break
            time.sleep(0.1)
        codes = [p.poll() for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    return codes, [log.read_text(errors="replace") for log in logs]


def _describe(codes, outputs, tail=3000):
    def state(code):
        if code is None:
            return "killed while running (timeout, or another one failed)"
        return f"exit code {code}"

    return "\n".join(
        f"--- process {i}: {state(c)} ---\n{out[-tail:]}"
        for i, (c, out) in enumerate(zip(codes, outputs, strict=True))
    )


def _read_ranks(out_dir, codes, outputs):
    """Both ranks' results; fails with the output tails if a run failed."""
    why = _describe(codes, outputs)
    assert codes == [0] * len(codes), f"exit codes {codes}:\n{why}"
    results = []
    for rank in range(2):
        path = Path(out_dir) / f"rank{rank}.json"
        assert path.exists(), f"no result from process {rank}:\n{why}"
        results.append(json.loads(path.read_text()))
    return results


def _check_discovered(results, reference):
    for rank, got in enumerate(results):
        what = f"process {rank}"
        assert got["num_processes"] == 2, (what, got["num_processes"])
        assert got["process_id"] == rank, (what, got["process_id"])
        assert got["devices"] == DEVICES, (what, got["devices"])
        # The launcher's variables alone: initialize() wrote no TF_CONFIG.
        assert got["tf_config"] is None, (what, got["tf_config"])
        assert got["replicator"] == "ProcessReplicator", (
            what,
            got["replicator"],
        )
        distribution_reference.assert_matches(got, reference, 1e-5, what)


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_initialize_under_mpiexec_matches_one_device(reference, tmp_path):
    """`mpiexec -n 2`: PMI variables, addresses exchanged with mpi4py."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    assert mpiexec.exists(), (
        f"mpiexec not found at {mpiexec}: install the dev extra (PyPI mpich)"
    )
    command = [
        mpiexec,
        "-n",
        "2",
        sys.executable,
        WORKER,
        reference["init"],
        tmp_path,
    ]
    codes, outputs = _run_group([command], [_launcher_free_env({})], tmp_path)
    results = _read_ranks(tmp_path, codes, outputs)
    _check_discovered(results, reference)
    # One host: the ranks exchanged loopback addresses.
    for rank, got in enumerate(results):
        assert all(w.startswith("127.0.0.1:") for w in got["workers"]), (
            rank,
            got["workers"],
        )


def _slurm_ports(job_id, tasks):
    from keras_replicator._src.cluster import discovery

    base = (
        discovery.SLURM_PORT_BASE
        + (job_id % 1000) * discovery.SLURM_PORTS_PER_JOB
    )
    return list(range(base, base + tasks))


def _free_slurm_job_id(tasks):
    """A job id whose derived ports (discovery's scheme) are free now.

    The ports are probed on every interface, all held at once, as the
    tasks' servers will bind them.
    """
    start = random.randrange(1000)
    for offset in range(1000):
        job_id = 700000 + (start + offset) % 1000
        with contextlib.ExitStack() as stack:
            try:
                for port in _slurm_ports(job_id, tasks):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("", port))
            except OSError:
                continue
        return job_id
    raise AssertionError(f"no job id in 700000..700999 has {tasks} free ports")


def _slurm_task_env(job_id, rank):
    """What `srun -n 2` on one node named localhost sets for task `rank`.

    Node lists name hosts as Slurm knows them; `localhost` is a name that
    resolves on every machine, as a node's name resolves on a cluster.
    """
    return _launcher_free_env(
        {
            "SLURM_JOB_ID": str(job_id),
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": str(rank),
            "SLURM_NTASKS": "2",
            "SLURM_NNODES": "1",
            "SLURM_NODEID": "0",
            "SLURM_LOCALID": str(rank),
            "SLURM_STEP_NODELIST": "localhost",
            "SLURM_STEP_TASKS_PER_NODE": "2",
            "SLURM_JOB_NODELIST": "localhost",
            "SLURM_TASKS_PER_NODE": "2",
        }
    )


@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
def test_initialize_as_slurm_tasks_matches_one_device(reference, tmp_path):
    """Two tasks of a one-node Slurm job step: no exchange, derived ports."""
    for attempt in range(2):
        job_id = _free_slurm_job_id(2)
        out_dir = tmp_path / f"attempt{attempt}"
        out_dir.mkdir()
        command = [sys.executable, WORKER, reference["init"], out_dir]
        codes, outputs = _run_group(
            [command, command],
            [_slurm_task_env(job_id, rank) for rank in range(2)],
            out_dir,
        )
        clash = any(m in out for out in outputs for m in PORT_CLASH)
        if not clash or attempt == 1:
            break
    results = _read_ranks(out_dir, codes, outputs)
    _check_discovered(results, reference)
    # The node list's host, the ports derived from the job id.
    workers = [f"localhost:{p}" for p in _slurm_ports(job_id, 2)]
    for rank, got in enumerate(results):
        assert got["workers"] == workers, (rank, got["workers"], job_id)
