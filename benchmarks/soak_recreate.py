"""Soak check: re-creating a MultiWorkerReplicator never deadlocks.

Runs keras.io's multi-worker guide pattern (`tests/multi_worker/workers/
recreate_worker.py`: fit and evaluate, then three times re-create the
replicator with `kr.auto()`, build or `load_model` under its scope, fit
with a `ModelCheckpoint`) under `keras-replicator launch --workers 2`,
`--runs` times in a row (default 30), while another process keeps a core
busy. A run that does not end within `--timeout` seconds (default 240) is
a deadlock; the hang watchdog's timeout is left at its default (600 s),
longer than that, so a deadlock shows as a timeout, not a restart. Every
run must also end with one device's losses and weights (1e-5).

Usage, from the repository root:

    .venv/bin/python benchmarks/soak_recreate.py [--runs 30]

It prints one line per run and a summary with the date, commit and
machine.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import _common  # noqa: E402

WORKER = ROOT / "tests/multi_worker/workers/recreate_worker.py"


def _command(folder: str) -> list[str]:
    cli = Path(sys.executable).parent / "keras-replicator"
    launcher = (
        [str(cli)]
        if cli.exists()
        else [sys.executable, "-m", "keras_replicator._src.cli.main"]
    )
    return [
        *launcher,
        "launch",
        "--workers",
        "2",
        "--replicas-per-worker",
        "1",
        "--",
        sys.executable,
        str(WORKER),
        folder,
    ]


def _exact(results, reference) -> bool:
    for result in results:
        if result is None:
            return False
        if not np.allclose(result["losses"], reference["losses"], rtol=1e-5):
            return False
        pairs = zip(result["weights"], reference["weights"], strict=True)
        for got, want in pairs:
            if not np.allclose(np.array(got), want, atol=1e-5, rtol=0):
                return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=240.0)
    args = parser.parse_args()

    from tests.multi_worker import recreate_reference

    reference = recreate_reference.reference()
    load = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    ok = deadlocked = failed = 0
    seconds = []
    try:
        for run in range(1, args.runs + 1):
            with tempfile.TemporaryDirectory(prefix="soak_recreate_") as tmp:
                env = {
                    **os.environ,
                    "PYTHONPATH": str(ROOT),
                    "TF_CPP_MIN_LOG_LEVEL": "3",
                    "KERAS_REPLICATOR_RESULT": os.path.join(
                        tmp, "result_{index}.json"
                    ),
                }
                start = time.monotonic()
                try:
                    proc = subprocess.run(
                        _command(tmp),
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=args.timeout,
                        cwd=ROOT,
                    )
                    code = proc.returncode
                    tail = proc.stdout[-3000:]
                except subprocess.TimeoutExpired as error:
                    code = None
                    out = error.stdout or b""
                    if isinstance(out, bytes):
                        out = out.decode(errors="replace")
                    tail = out[-3000:]
                took = time.monotonic() - start
                paths = [Path(tmp) / f"result_{i}.json" for i in (0, 1)]
                results = [
                    json.loads(p.read_text()) if p.exists() else None
                    for p in paths
                ]
            if code is None:
                deadlocked += 1
                verdict = f"DEADLOCK (no end in {args.timeout:.0f} s)"
            elif code == 0 and _exact(results, reference):
                ok += 1
                seconds.append(took)
                verdict = "ok, one device's numbers"
            else:
                failed += 1
                verdict = f"FAILED (exit code {code})"
            print(f"run {run:2d}: {verdict}, {took:.0f} s", flush=True)
            if code != 0:
                print(tail, flush=True)
    finally:
        load.kill()
        load.wait()
    print(
        f"\n{ok}/{args.runs} runs ended with one device's numbers, "
        f"{deadlocked} deadlocked, {failed} failed; median "
        f"{np.median(seconds) if seconds else 0:.0f} s a run. "
        f"{time.strftime('%Y-%m-%d')}, commit {_common.commit()}, "
        f"{_common.machine()}; another process kept a core busy."
    )
    return 0 if ok == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
