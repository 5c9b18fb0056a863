"""A memory cap per process decides who trains: ModelParallel does, alone.

One script (`workers/capacity_cap_worker.py`: a 100.7M-parameter MLP,
six `Dense(4096)`, Adam, 4 steps with `BackupAndRestore(save_freq=2)`),
each process in a cgroup v1 memory group of its own with the same hard
limit, `CAP_MB`:

- one device: uncapped it is the reference (its weights, and its peak
  charge, which must be at least 1.5x the cap); capped, the kernel kills it;
- `DataParallel` over 4 processes: every process holds the whole model and
  is killed the same way;
- `ModelParallel` over 4 processes of one device each, a (1, 4) mesh:
  trains under the cap, crashes after step 3 (after the backup of step 2),
  and the restart, still capped, resumes from its sharded backup and ends
  with one device's weights (a corner and the sum of |w| of every weight,
  1e-5).

The group charges what a process allocates and the page cache it fills
(its checkpoint writes), not the libraries other processes already read.
Skips where no writable cgroup v1 memory controller exists.
"""

import signal
import uuid
from pathlib import Path

import numpy as np
import pytest

from tests.multi_worker import harness

pytestmark = pytest.mark.multi_worker

WORKER = harness.REPO_ROOT / "tests/multi_worker/workers/capacity_cap_worker.py"
MEMORY = Path("/sys/fs/cgroup/memory")
CAP_MB = 1600
PROCESSES = 4


def _no_cgroup_reason():
    if not MEMORY.is_dir():
        return f"no cgroup v1 memory controller at {MEMORY}"
    probe = MEMORY / f"kr_probe_{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as error:
        return f"cannot make a memory cgroup under {MEMORY}: {error}"
    return None


class Groups:
    """Memory groups of one run, one per process; removed when done."""

    def __init__(self, name, count, limit_mb=None):
        tag = uuid.uuid4().hex[:8]
        self.paths = [MEMORY / f"kr_{name}_{tag}_{i}" for i in range(count)]
        for path in self.paths:
            path.mkdir()
            if limit_mb:
                (path / "memory.limit_in_bytes").write_text(
                    str(limit_mb * 2**20)
                )

    def env_for(self, index):
        return {"CAP_CGROUP": str(self.paths[index])}

    def oom_kills(self):
        """How many processes the kernel killed in each group for its cap."""
        counts = []
        for path in self.paths:
            text = (path / "memory.oom_control").read_text()
            fields = dict(line.split() for line in text.splitlines())
            counts.append(int(fields.get("oom_kill", 0)))
        return counts

    def remove(self):
        for path in self.paths:
            if path.exists():
                path.rmdir()


def _run(mode, backup, processes=1, limit_mb=CAP_MB, env=None, crash=False):
    """Runs the worker; its results and the OOM kills in each group."""
    groups = Groups(mode, processes, limit_mb)
    try:
        results = harness.run_workers(
            WORKER,
            num_workers=processes,
            replicas_per_worker=1,
            timeout=420,
            args=[mode, str(backup)],
            # One device: no cluster at all.
            env={**(env or {}), **({"TF_CONFIG": ""} if mode == "one" else {})},
            env_for=groups.env_for,
            check=False,
            # A crash in every process ends each on its own; anything
            # else that fails one stops the rest (their peer is gone).
            kill_on_failure=not crash,
        )
        return results, groups.oom_kills()
    finally:
        groups.remove()


@pytest.mark.timeout(900)
def test_only_model_parallel_trains_under_a_cap_one_device_exceeds(tmp_path):
    reason = _no_cgroup_reason()
    if reason:
        pytest.skip(reason)

    (one,), kills = _run("one", tmp_path / "one", limit_mb=None)
    assert one.returncode == 0 and kills == [0], harness.describe([one])
    reference = one.result
    # The cap is one the script on one device exceeds by 1.5x or more.
    assert reference["peak_mb"]["charged"] >= 1.5 * CAP_MB, reference["peak_mb"]

    (capped,), kills = _run("one", tmp_path / "one_capped")
    assert capped.returncode == -signal.SIGKILL, harness.describe([capped])
    assert kills == [1]

    data, kills = _run("data", tmp_path / "data", PROCESSES)
    assert sum(kills) >= 1, harness.describe(data)
    assert all(r.result is None for r in data)

    backup = tmp_path / "model"
    crashed, kills = _run(
        "model", backup, PROCESSES, env={"CAP_CRASH_AFTER": "3"}, crash=True
    )
    assert kills == [0] * PROCESSES
    for r in crashed:
        assert r.returncode == 1, harness.describe(crashed)
        assert "crash after step 3" in r.output
        assert r.result["trained"] == 3
    resumed, kills = _run("model", backup, PROCESSES)
    assert kills == [0] * PROCESSES
    assert not any(r.returncode for r in resumed), harness.describe(resumed)
    for r in resumed:
        # From the backup of step 2: steps 3 and 4.
        assert r.result["trained"] == 2, r.result["trained"]
        # Where it ran: each of the 4 devices holds a quarter of a kernel.
        assert r.result["kernel_blocks"] == [[4096, 1024]] * PROCESSES
        for (corner, total), (want_corner, want_total) in zip(
            r.result["weights"], reference["weights"], strict=True
        ):
            np.testing.assert_allclose(
                corner, want_corner, rtol=1e-5, atol=1e-5
            )
            np.testing.assert_allclose(total, want_total, rtol=1e-5)
    print(
        f"cap {CAP_MB} MB per process; one device uncapped: "
        f"{reference['peak_mb']}; ModelParallel x{PROCESSES} under the cap: "
        f"{[r.result['peak_mb'] for r in resumed]}"
    )
