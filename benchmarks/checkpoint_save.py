"""Sharded checkpoints against whole saves, one device per process.

An MLP of `--layers` Dense(`--width`) layers (6 x 4096: 100.7M parameters),
Adam, every kernel laid out `(None, "model")` on a (1, N) mesh; N = 1 is
one device in one process, N > 1 is `keras-replicator launch --workers N
--replicas-per-worker 1`. Each process, after warm-up steps, runs
`--rounds` rounds, each alternating:

- A: `--steps` training steps with no save (median step time);
- B: `kr.save_checkpoint` (asynchronous), then `--steps` steps while it
  writes (median step time), then `wait()`. The step-time ratio B/A is the
  stall an asynchronous save costs; the time `save_checkpoint` takes to
  return is the copy to host memory.

Then, once each: a whole `model.save_weights` (every process calls it, the
chief writes; its time is a full stall), and a sharded save waited for at
once, with the process's peak RSS during it above the RSS before it
(`/proc/self/clear_refs`), against the bytes of its own blocks.

    python benchmarks/checkpoint_save.py [--workers 1,2,4] [--width 4096]

`--backups`: `fit` of `--backup-steps` steps with
`BackupAndRestore(save_freq=3)` against the same `fit` without backups,
`--rounds` rounds of three fits (no backup; Keras' default, the backup
deleted at the end, so that a save still in flight then is abandoned;
`delete_checkpoint=False`, every save written) on N processes (the
26.2M-parameter MLP the 1.25x target is set on is `--width 2560 --layers
4`; the 25.2M one of the earlier runs `--width 2048 --layers 6`), and the
bytes each process wrote against a whole `.weights.h5` of the model.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(__file__))

from _common import label  # noqa: E402
from _common import reset_peak  # noqa: E402
from _common import rss_mb  # noqa: E402
from _common import run_processes  # noqa: E402
from _common import sharded_mlp  # noqa: E402


def _process_index():
    config = json.loads(os.environ.get("TF_CONFIG", "{}"))
    return int(config.get("task", {}).get("index", 0))


def _model(args):
    import keras

    model = sharded_mlp(args.width, args.layers, args.workers)
    model.compile(keras.optimizers.Adam(1e-4), "mse")
    return model


def _data(args, steps):
    import numpy as np
    import tensorflow as tf

    x = (
        np.random.default_rng(0)
        .normal(size=(16 * steps, args.width))
        .astype("float32")
    )
    return tf.data.Dataset.from_tensor_slices((x, x)).batch(16)


def _step_times(model, data):
    """Median step time of one `fit` epoch over `data`, in seconds."""
    import keras

    ends = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.perf_counter())

    model.fit(data, epochs=1, verbose=0, callbacks=[Clock()])
    return statistics.median(
        b - a for a, b in zip(ends, ends[1:], strict=False)
    )


def _worker(args):
    import keras

    import keras_replicator as kr

    if args.workers > 1:
        keras.distribution.initialize()
    model = _model(args)
    data = _data(args, args.steps + 1)
    model.fit(_data(args, 2), epochs=1, verbose=0)  # traces
    process = _process_index()
    out = {
        "process": process,
        "parameters": model.count_params(),
        "rounds": [],
    }
    directory = os.path.join(args.out, "sharded")
    for _ in range(args.rounds):
        plain = _step_times(model, data)
        started = time.perf_counter()
        handle = kr.save_checkpoint(model, directory)
        returned = time.perf_counter() - started
        during = _step_times(model, data)
        handle.wait()
        out["rounds"].append(
            {"plain": plain, "during": during, "returned": returned}
        )
    whole_path = os.path.join(args.out, "whole.weights.h5")
    started = time.perf_counter()
    model.save_weights(whole_path)
    out["whole_seconds"] = time.perf_counter() - started
    before, _ = rss_mb()
    reset_peak()
    started = time.perf_counter()
    kr.save_checkpoint(model, directory).wait()
    out["sharded_seconds"] = time.perf_counter() - started
    _, peak = rss_mb()
    out["save_peak_rise_mb"] = peak - before
    with open(os.path.join(directory, "index.json")) as f:
        index = json.load(f)
    name = f"process-{process}.bin"
    own = sum(
        b["nbytes"]
        for entry in index["variables"].values()
        for b in entry["blocks"]
        if b["file"].endswith("/" + name)
    )
    out["own_blocks_mb"] = own / 2**20
    if process == 0:
        out["whole_file_mb"] = os.path.getsize(whole_path) / 2**20
    print("RESULT " + json.dumps(out), flush=True)


def _backups_worker(args):
    import keras

    import keras_replicator  # noqa: F401 - keras.distribution on TF

    if args.workers > 1:
        keras.distribution.initialize()
    process = _process_index()
    model = _model(args)
    data = _data(args, args.backup_steps)
    model.fit(_data(args, 2), epochs=1, verbose=0)  # traces
    backup = os.path.join(args.out, "backup")
    out = {"process": process, "pairs": []}
    written = []

    def timed(*callbacks):
        started = time.perf_counter()
        model.fit(data, epochs=1, verbose=0, callbacks=list(callbacks))
        return time.perf_counter() - started

    for _ in range(args.rounds):
        plain = timed()
        # Keras' default: the backup is deleted at the fit's end.
        deleted = timed(keras.callbacks.BackupAndRestore(backup, save_freq=3))
        kept = timed(
            keras.callbacks.BackupAndRestore(
                backup, save_freq=3, delete_checkpoint=False
            )
        )
        out["pairs"].append([plain, deleted, kept])
        if process == 0:
            written = _written_by(backup, args.workers, args.backup_steps // 3)
            shutil.rmtree(backup, ignore_errors=True)
    whole = os.path.join(args.out, "whole.weights.h5")
    model.save_weights(whole)
    if process == 0:
        out["written_mb"] = [n / 2**20 for n in written]
        out["saves"] = args.backup_steps // 3
        out["whole_file_mb"] = os.path.getsize(whole) / 2**20
    print("RESULT " + json.dumps(out), flush=True)


def _written_by(backup, workers, saves):
    """Bytes each process wrote over the fit: its last save's x saves.

    Read by process 0 once its fit ended (the fit's end waits for the
    backup, whose index is committed after every process wrote).
    """
    index_path = os.path.join(backup, "sharded", "index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            index = json.load(f)
        per = [0] * workers
        for entry in index["variables"].values():
            for block in entry["blocks"]:
                k = int(block["file"].rsplit("process-", 1)[1].split(".")[0])
                per[k] += block["nbytes"]
        return [saves * n for n in per]
    whole = os.path.join(backup, "latest.weights.h5")
    return [saves * os.path.getsize(whole)] + [0] * (workers - 1)


def _run(args, workers, out):
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        f"--workers={workers}",
        f"--width={args.width}",
        f"--layers={args.layers}",
        f"--steps={args.steps}",
        f"--rounds={args.rounds}",
        f"--backup-steps={args.backup_steps}",
        f"--out={out}",
    ] + (["--backups"] if args.backups else [])
    results = run_processes(command, workers, timeout=1800)
    return sorted(results, key=lambda r: r["process"])


def _spread(values):
    return (
        f"median {statistics.median(values):.2f} "
        f"(min {min(values):.2f}, max {max(values):.2f})"
    )


def _report(workers, results):
    ratios = [r["during"] / r["plain"] for p in results for r in p["rounds"]]
    returned = [r["returned"] for p in results for r in p["rounds"]]
    plain = [r["plain"] for p in results for r in p["rounds"]]
    print(
        f"N={workers}: {results[0]['parameters'] / 1e6:.1f}M parameters; "
        f"step {statistics.median(plain):.3f} s without a save"
    )
    print(f"  step during an async sharded save / without: {_spread(ratios)}")
    print(f"  async save returns after (copy to host), s: {_spread(returned)}")
    print(
        "  whole save_weights, s (a full stall): "
        + _spread([p["whole_seconds"] for p in results])
    )
    print(
        "  sharded save waited for at once, s: "
        + _spread([p["sharded_seconds"] for p in results])
    )
    for k, p in enumerate(results):
        print(
            f"  process {k}: peak RSS during a sharded save "
            f"+{p['save_peak_rise_mb']:.0f} MB; own blocks "
            f"{p['own_blocks_mb']:.0f} MB (bound: blocks + 64 MB)"
        )
    print(f"  whole file: {results[0]['whole_file_mb']:.0f} MB")


def _report_backups(workers, results):
    for column, what in (
        (1, "deleted at the end (Keras' default)"),
        (2, "kept (delete_checkpoint=False)"),
    ):
        ratios = [r[column] / r[0] for p in results for r in p["pairs"]]
        print(
            f"N={workers}: fit with BackupAndRestore(save_freq=3) / without, "
            f"backup {what}: {_spread(ratios)}"
        )
    plain = [r[0] for p in results for r in p["pairs"]]
    print(f"  fit of the plain run, s: {_spread(plain)}")
    whole = results[0]["whole_file_mb"]
    saves = results[0]["saves"]
    for k, mb in enumerate(results[0]["written_mb"]):
        print(
            f"  process {k} wrote {mb:.0f} MB in {saves} backups: "
            f"{mb / saves / whole:.2f} of a whole save ({whole:.0f} MB) each"
        )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backups", action="store_true")
    parser.add_argument("--backup-steps", type=int, default=12)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.workers = int(args.workers)
        (_backups_worker if args.backups else _worker)(args)
        return
    print(label())
    print(" ".join(sys.argv))
    for workers in (int(n) for n in args.workers.split(",")):
        with tempfile.TemporaryDirectory(prefix="kr_checkpoint_") as out:
            results = _run(args, workers, out)
        (_report_backups if args.backups else _report)(workers, results)


if __name__ == "__main__":
    main()
