"""Runs a chief script against real worker and ps processes on loopback.

The parameter-server counterpart of `harness.run_workers`: it starts
`num_ps` parameter servers and `num_workers` workers (each a bare
TensorFlow server, `async_ps.SERVE_COMMAND`), then the chief running the
test's script with `TF_CONFIG`, waits at most `timeout` seconds for the
chief, and kills every process in `finally`.

The chief gets the servers' process ids in `KERAS_REPLICATOR_WORKER_PIDS`
and `KERAS_REPLICATOR_PS_PIDS` (comma-separated), so a fault test can kill
one at an exact step from a callback. It reports numbers with
`harness.write_result`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.multi_worker import harness

WORKER_PIDS_ENV = "KERAS_REPLICATOR_WORKER_PIDS"
PS_PIDS_ENV = "KERAS_REPLICATOR_PS_PIDS"


@dataclasses.dataclass
class ChiefResult:
    """What the chief did, and the servers' output for error messages."""

    returncode: int | None
    output: str
    result: Any
    seconds: float
    timed_out: bool
    server_output: str

    def describe(self) -> str:
        """The chief's exit, its output and the servers', for errors."""
        state = "timed out" if self.timed_out else f"exit {self.returncode}"
        return (
            f"--- chief: {state} after {self.seconds:.0f}s ---\n"
            f"{self.output[-6000:]}\n--- servers ---\n"
            f"{self.server_output[-3000:]}"
        )


def pids(env_name: str) -> list[int]:
    """Called in the chief: the worker or ps process ids."""
    return [int(p) for p in os.environ[env_name].split(",")]


def run_chief(
    script: str,
    num_workers: int = 2,
    num_ps: int = 1,
    timeout: float = 240,
    env: Mapping[str, str] | None = None,
) -> ChiefResult:
    """Starts the cluster, runs `script` (Python source) as its chief.

    Args:
        script: The chief's Python source.
        num_workers: Worker tasks.
        num_ps: Parameter-server tasks.
        timeout: Seconds until the chief is killed.
        env: Extra environment variables for the chief.

    Returns:
        A `ChiefResult`.
    """
    from keras_replicator._src.cluster import config as cluster_lib
    from keras_replicator._src.replicators import async_ps

    ports = iter(harness.free_ports(1 + num_workers + num_ps))
    cluster = {
        "chief": [f"127.0.0.1:{next(ports)}"],
        "worker": [f"127.0.0.1:{next(ports)}" for _ in range(num_workers)],
        "ps": [f"127.0.0.1:{next(ports)}" for _ in range(num_ps)],
    }

    def task_env(job, index, result_path):
        config = cluster_lib.parse_tf_config(
            {"cluster": cluster, "task": {"type": job, "index": index}}
        )
        out = dict(os.environ)
        out.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        out["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(harness.REPO_ROOT), out.get("PYTHONPATH")) if p
        )
        out[harness.RESULT_ENV] = result_path
        out["TF_CONFIG"] = config.to_json()
        return out

    procs: dict[str, subprocess.Popen] = {}
    with tempfile.TemporaryDirectory(prefix="kr_async_") as tmp:
        tmp = Path(tmp)
        result_path = tmp / "result.json"
        chief_path = tmp / "chief.py"
        chief_path.write_text(script)
        logs = {}
        start = time.monotonic()
        timed_out = False
        try:
            for job, count in (("ps", num_ps), ("worker", num_workers)):
                for i in range(count):
                    name = f"{job}{i}"
                    logs[name] = tmp / f"{name}.txt"
                    with open(logs[name], "w") as out:
                        procs[name] = _start(
                            list(async_ps.SERVE_COMMAND),
                            task_env(job, i, str(result_path)),
                            out,
                        )
            chief_env = task_env("chief", 0, str(result_path))
            chief_env[WORKER_PIDS_ENV] = ",".join(
                str(procs[f"worker{i}"].pid) for i in range(num_workers)
            )
            chief_env[PS_PIDS_ENV] = ",".join(
                str(procs[f"ps{i}"].pid) for i in range(num_ps)
            )
            chief_env.update(env or {})
            logs["chief"] = tmp / "chief.txt"
            with open(logs["chief"], "w") as out:
                procs["chief"] = _start(
                    [sys.executable, str(chief_path)], chief_env, out
                )
            try:
                procs["chief"].wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
        finally:
            for proc in procs.values():
                harness._kill(proc)
        seconds = time.monotonic() - start
        result = None
        if result_path.exists():
            result = json.loads(result_path.read_text())
        servers = "\n".join(
            f"[{name}] {logs[name].read_text(errors='replace')[-1500:]}"
            for name in logs
            if name != "chief"
        )
        return ChiefResult(
            returncode=procs["chief"].returncode if "chief" in procs else None,
            output=logs["chief"].read_text(errors="replace")
            if "chief" in logs
            else "",
            result=result,
            seconds=seconds,
            timed_out=timed_out,
            server_output=servers,
        )


def _start(command, env, out) -> subprocess.Popen:
    return subprocess.Popen(
        command,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=str(harness.REPO_ROOT),
        # Own process group, so `harness._kill` ends it and its children.
        start_new_session=True,
    )
