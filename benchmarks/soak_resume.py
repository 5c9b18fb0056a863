"""Soak check: preempted at random steps, resumed, always exactly.

Each cycle trains the preemption tests' model (3 epochs of 8 steps) on
`replicator.distribute(..., shuffle_seed=1)` data with a plain
`BackupAndRestore` fit (`tests/multi_worker/workers/preempt_worker.py`):

1. the run is started; once it reaches a random step, SIGTERM goes to it
   (to the one process, or, on 2 workers, to the launcher or to a random
   worker); it must exit with code 75 and leave a backup;
2. the same command is started again and must train the rest and end
   with one device's weights (1e-5).

One device's weights: one device trained on the global batches that the
configuration's input pipelines yield (`kr.data.shard`'s input function
for each pipeline, iterated as `fit` does), computed here.

Configurations: `local` is one process with `LocalReplicator(2)`;
`workers` is `keras-replicator launch --workers 2` (1 replica each). While
it runs, `--load` processes keep the cores busy. Every subprocess has a
bounded timeout. Not part of the test suite (it takes tens of minutes):

    python benchmarks/soak_resume.py --cycles 30 --configs local,workers
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import _common  # noqa: E402

from tests.multi_worker import harness  # noqa: E402
from tests.multi_worker import preempt_reference as ref  # noqa: E402

WORKER = REPO / "tests/multi_worker/workers/preempt_worker.py"
PREEMPTED = 75
CONFIGS = ("local", "workers")
# Pipelines (workers) and replicas of each configuration.
TOPOLOGY = {"local": (1, 2), "workers": (2, 2)}
BASE_ENV = {
    "KERAS_REPLICATOR_PREEMPTION_CHECK_SECONDS": "0.05",
    "TF_CPP_MIN_LOG_LEVEL": "3",
    "PYTHONPATH": str(REPO),
    "PREEMPT_DATA": "distribute",
    "PREEMPT_SLOW": "0.2",
}


def one_device_weights(config):
    """One device's weights on the batches `config`'s pipelines yield."""
    import numpy as np
    import tensorflow as tf

    import keras_replicator as kr

    pipelines, replicas = TOPOLOGY[config]
    model = ref.build(tf.distribute.get_strategy())
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ref.STEPS_PER_EPOCH * ref.GLOBAL_BATCH, 5))
    y = x @ rng.normal(size=(5, 1))
    examples = (x.astype("float32"), y.astype("float32"))
    input_fn = kr.data.shard(
        tf.data.Dataset.from_tensor_slices(examples),
        ref.GLOBAL_BATCH,
        shuffle_seed=1,
    )
    datasets = [
        input_fn(tf.distribute.InputContext(pipelines, i, replicas))
        for i in range(pipelines)
    ]
    # `fit` makes one iterator to build the model, then one per epoch and
    # one (unused) at each epoch's end: a seeded shuffle draws its order
    # per iterator, so the epochs train on the 2nd, 4th and 6th orders.
    made = [[iter(d) for d in datasets] for _ in range(2 * ref.EPOCHS)]
    iterators = [None] + made[1::2]
    per_pipeline = replicas // pipelines
    xs, ys = [], []
    for epoch in iterators[1:]:
        # A step takes `per_pipeline` per-replica batches from every
        # pipeline: worker order, then each worker's replicas in order.
        batches = [list(it) for it in epoch]
        for step in range(len(batches[0]) // per_pipeline):
            parts = [
                b
                for pipeline in batches
                for b in pipeline[
                    step * per_pipeline : (step + 1) * per_pipeline
                ]
            ]
            xs.append(np.concatenate([p[0] for p in parts]))
            ys.append(np.concatenate([p[1] for p in parts]))
    assert len(xs) == ref.TOTAL_STEPS, len(xs)
    model.fit(
        np.concatenate(xs),
        np.concatenate(ys),
        batch_size=ref.GLOBAL_BATCH,
        shuffle=False,
        verbose=0,
    )
    return model.get_weights()


def _command(config, backup):
    if config == "local":
        return [sys.executable, str(WORKER), str(backup)]
    return harness.launch_command(WORKER, [str(backup)], 2, 1)


def _env(config, extra=None):
    env = {**os.environ, **BASE_ENV, **(extra or {})}
    if config == "local":
        env["PREEMPT_REPLICATOR"] = "local"
    return env


def cycle(config, folder, stop_at, target, timeout):
    """One preemption at `stop_at` and one resume; returns a report dict."""
    backup = folder / "backup"
    marks = [folder / f"mark{i}" for i in range(TOPOLOGY[config][0])]
    first = harness.Background(
        _command(config, backup),
        folder,
        "first",
        _env(
            config,
            {
                "PREEMPT_MARK": str(folder / "mark{index}"),
                "PREEMPT_MARK_STEP": str(stop_at),
            },
        ),
    )
    deadline = time.monotonic() + timeout
    while not all(m.exists() for m in marks):
        if first.proc.poll() is not None or time.monotonic() > deadline:
            first.kill()
            return {"ok": False, "why": "no mark", "log": first.output()}
        time.sleep(0.05)
    time.sleep(0.05)
    if config == "local" or target == "launcher":
        first.proc.send_signal(signal.SIGTERM)
    else:
        pid = int(marks[int(target)].read_text())
        os.kill(pid, signal.SIGTERM)
    code = first.wait(timeout=timeout)
    if code == 0:
        # The run ended before the stop it agreed on (a last step).
        second = first
        saved = None
    elif code == 128 + signal.SIGTERM and "preempted" not in first.output():
        # Workers check about every 50 ms of steps, so a signal in the last
        # steps can come after the last check: the fit ends (its backup is
        # deleted at the end), then the signal is delivered again and ends
        # the worker, as documented. The restart trains from the start.
        saved = "end (restarted from the start)"
        second = harness.Background(
            _command(config, backup), folder, "second", _env(config)
        )
        code = second.wait(timeout=timeout)
        if code != 0:
            why = f"restart exit {code}"
            return {"ok": False, "why": why, "log": second.output()}
    elif code != PREEMPTED:
        return {"ok": False, "why": f"exit {code}", "log": first.output()}
    else:
        saved = ref.backup_step(backup)
        second = harness.Background(
            _command(config, backup), folder, "second", _env(config)
        )
        code = second.wait(timeout=timeout)
        if code != 0:
            why = f"resume exit {code}"
            return {"ok": False, "why": why, "log": second.output()}
    return {"ok": True, "saved": saved, "result": second.result(0)}


def _max_diff(result, expected):
    import numpy as np

    return max(
        float(np.max(np.abs(np.array(a) - e)))
        for a, e in zip(result["weights"], expected, strict=True)
    )


def soak(config, cycles, rng, timeout, log):
    expected = one_device_weights(config)
    exact = 0
    for n in range(1, cycles + 1):
        stop_at = rng.randint(1, ref.TOTAL_STEPS - 1)
        target = rng.choice(["launcher", "0", "1"])
        with tempfile.TemporaryDirectory() as tmp:
            start = time.monotonic()
            out = cycle(config, Path(tmp), stop_at, target, timeout)
            seconds = time.monotonic() - start
            if out["ok"]:
                diff = _max_diff(out["result"], expected)
                out["ok"] = diff <= 1e-5
                out["why"] = f"max |weight - one device| {diff:.2e}"
        exact += out["ok"]
        to = "the process" if config == "local" else target
        if to in ("0", "1"):
            to = f"worker {to}"
        log(
            f"{config} cycle {n}: SIGTERM to {to} at step {stop_at}, saved "
            f"at {out.get('saved')}, {out['why']}: "
            f"{'exact' if out['ok'] else 'NOT EXACT'} ({seconds:.0f} s)"
        )
        if not out["ok"] and "log" in out:
            log(out["log"][-3000:])
    return exact


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=30)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument(
        "--load", type=int, default=2, help="busy processes (default 2)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--timeout", type=float, default=300, help="seconds per subprocess"
    )
    args = parser.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS:
            parser.error(
                f"--configs takes {CONFIGS}. Received: configs={args.configs}"
            )
    if args.cycles < 1:
        parser.error(f"--cycles must be >= 1. Received: cycles={args.cycles}")
    rng = random.Random(args.seed)
    import keras_replicator as kr

    # One device here; the runs split their own CPUs.
    kr.configure_cpu_replicas(1)
    busy = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(args.load)
    ]
    counts = {}
    try:
        print(_common.label(), flush=True)
        print(f"{args.load} busy processes load the cores", flush=True)
        for config in configs:
            counts[config] = soak(
                config,
                args.cycles,
                rng,
                args.timeout,
                lambda line: print(line, flush=True),
            )
    finally:
        for proc in busy:
            proc.kill()
            proc.wait(timeout=30)
    for config, exact in counts.items():
        print(f"{config}: {exact}/{args.cycles} exact cycles", flush=True)
    print(json.dumps(counts), flush=True)
    return 0 if all(v == args.cycles for v in counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
