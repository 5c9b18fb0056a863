"""`KERAS_REPLICATOR_TIMELINE` over 2 processes, on both transports.

A 2-worker `fit` under `keras-replicator launch` (8 steps, a
`BackupAndRestore` save after step 4) writes one trace that parses as
Chrome's trace format: both processes' rows, each step, each step's
gradient all-reduce with its bytes (the model's 1,153 float32 weights,
once per step at least) and its wait for the other process, and the save.
The chief prints the one line that names the slowest process.
"""

import json

import pytest

from tests.multi_worker import harness

pytestmark = pytest.mark.multi_worker

WORKER = harness.REPO_ROOT / "tests/multi_worker/workers/timeline_worker.py"
STEPS = 8
WEIGHT_BYTES = (16 * 64 + 64 + 64 + 1) * 4


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["grpc", "mpi"])
def test_a_fit_over_two_processes_writes_one_trace(transport, tmp_path):
    pytest.importorskip("mpi4py")
    path = tmp_path / "trace.json"
    proc, results = harness.run_launcher(
        WORKER,
        [str(tmp_path)],
        num_workers=2,
        replicas_per_worker=1,
        env={"KERAS_REPLICATOR_TIMELINE": str(path)},
        timeout=240,
        transport=transport,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert all(r is not None for r in results), output[-3000:]
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {
        e["pid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert names == {0: "worker 0", 1: "worker 1"}
    for pid in (0, 1):
        mine = [e for e in events if e["pid"] == pid]
        steps = sorted(
            (e for e in mine if e["cat"] == "step"), key=lambda e: e["ts"]
        )
        assert [e["name"] for e in steps] == [
            f"step {i}" for i in range(1, STEPS + 1)
        ]
        assert [e["args"]["epoch"] for e in steps] == [1] * 4 + [2] * 4
        collectives = [e for e in mine if e["cat"] == "collective"]
        for step in steps:
            inside = [
                e
                for e in collectives
                if step["ts"] <= e["ts"] <= step["ts"] + step["dur"]
            ]
            reduced = [
                e
                for e in inside
                if e["name"] == "all-reduce"
                and e["args"]["bytes"] >= WEIGHT_BYTES
            ]
            assert reduced, (pid, step["name"], inside)
            for e in inside:
                assert e["args"]["op"], e
                assert 0 <= e["args"]["wait_us"] <= step["dur"], e
        saves = [e for e in mine if e["cat"] == "save"]
        assert [e["name"] for e in saves].count("backup") == 1, saves
    # The one line, from the chief only.
    lines = [line for line in output.splitlines() if "timeline written" in line]
    assert len(lines) == 1, output[-3000:]
    assert "[worker 0]" in lines[0] and "Slowest: worker " in lines[0]
    assert str(path) in lines[0]
