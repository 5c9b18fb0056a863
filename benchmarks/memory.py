"""Peak memory and step time: sharded optimizer state; ModelParallel.

Two suites (`--suite`):

`model_parallel`: an MLP of four Dense(D) layers on D inputs (D=2048: 16.8M
parameters), Adam, global batch 64, under `keras.distribution.DataParallel`
and `ModelParallel` on the same 4 devices, every kernel laid out
`(None, "model")` on a 1x4 mesh. One process per run; `--pairs` alternating
DataParallel/ModelParallel pairs; reports the median (min, max) of the
per-pair peak-RSS difference and step-time ratio ModelParallel/DataParallel,
and ModelParallel's weights against one device.

    python benchmarks/memory.py --suite model_parallel [--pairs 5]

`sharded_state` (the default):

Trains an MLP (Dense widths W, 2W, 2W, W on W inputs; W=1024 gives 8.4M
parameters) with Adam, global batch 64, under `kr.LocalReplicator(N)` and
`kr.LocalReplicator(N, shard_optimizer_state=True)` for N = 1, 2, 4, and on
one device. Each configuration runs in its own process, so its peak RSS
(`ru_maxrss`) is its own. Prints a table of peak RSS, median step time and
(where TensorFlow's CPU allocator keeps statistics) the peak of live tensor
bytes, checks that the sharded 4-replica weights equal one device's
(1e-5), and then alternates sharded and unsharded 4-replica processes
`--pairs` times and reports the median per-pair step-time ratio
sharded/unsharded (goal >= 0.9).

    python benchmarks/memory.py [--width 1024] [--steps 12] [--pairs 5]
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(__file__))

from _common import label  # noqa: E402
from _common import summary  # noqa: E402

GLOBAL_BATCH = 64


def _worker(args):
    """One configuration in this process; prints a JSON line."""
    import gc
    import resource
    import time

    import keras_replicator as kr

    kr.configure_cpu_replicas(4)
    import keras
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    w = args.width
    x = rng.normal(size=(GLOBAL_BATCH * args.steps, w)).astype("float32")
    y = rng.normal(size=(GLOBAL_BATCH * args.steps, w)).astype("float32")
    if args.distribution != "none":
        _set_distribution(args.distribution)
        scope = contextlib.nullcontext()
    elif args.replicas == 0:
        scope = tf.device("CPU:0")
    else:
        scope = kr.LocalReplicator(
            args.replicas, shard_optimizer_state=args.sharded
        ).scope()
    with scope:
        keras.utils.set_random_seed(1)
        if args.model == "dense4":
            layers = [
                keras.layers.Dense(
                    w, activation="relu" if i < 3 else None, name=f"d{i}"
                )
                for i in range(4)
            ]
        else:
            layers = [
                keras.layers.Dense(2 * w, activation="relu"),
                keras.layers.Dense(2 * w, activation="relu"),
                keras.layers.Dense(w),
            ]
        model = keras.Sequential([keras.Input((w,)), *layers])
        model.compile(keras.optimizers.Adam(1e-3), "mse")

    ends = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.perf_counter())

    model.fit(
        x,
        y,
        batch_size=GLOBAL_BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[Clock()],
    )
    # The first step traces and compiles: not timed.
    step_ms = statistics.median(
        1000 * (b - a) for a, b in zip(ends[:-1], ends[1:], strict=True)
    )
    np.savez(args.out, *model.get_weights())
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {"peak_rss_mb": peak_mb, "step_ms": step_ms}
    gc.collect()  # Tensors only garbage still holds do not count.
    try:
        # TensorFlow's CPU allocator: bytes held by live tensors (all
        # replicas' devices share it), now and at the peak of training.
        info = tf.config.experimental.get_memory_info("CPU:0")
        result["tensors_mb"] = info["current"] / 2**20
        result["tensors_peak_mb"] = info["peak"] / 2**20
    except (ValueError, tf.errors.OpError):
        pass  # An allocator without statistics.
    print(json.dumps(result))


def _set_distribution(name):
    """Keras' DataParallel or ModelParallel (1x4) on 4 devices."""
    import keras

    devices = keras.distribution.list_devices()[:4]
    if name == "data_parallel":
        distribution = keras.distribution.DataParallel(devices=devices)
    else:
        mesh = keras.distribution.DeviceMesh(
            (1, 4), ("batch", "model"), devices
        )
        layout_map = keras.distribution.LayoutMap(mesh)
        # Sequential paths: "sequential/d0/kernel".
        layout_map[r".*/d\d/kernel"] = (None, "model")
        distribution = keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    keras.distribution.set_distribution(distribution)


def _run(width, steps, replicas, sharded, out, model="mlp3", distribution=None):
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        f"--width={width}",
        f"--steps={steps}",
        f"--replicas={replicas}",
        f"--out={out}",
        f"--model={model}",
        f"--distribution={distribution or 'none'}",
    ] + (["--sharded"] if sharded else [])
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def _row(title, result):
    text = (
        f"{title:<28} peak RSS {result['peak_rss_mb']:7.0f} MB  "
        f"step {result['step_ms']:7.1f} ms"
    )
    if "tensors_peak_mb" in result:
        text += f"  tensors peak {result['tensors_peak_mb']:6.0f} MB"
    return text


def _max_difference(a_path, b_path):
    import numpy as np

    a, b = np.load(a_path), np.load(b_path)
    return max(float(np.abs(a[k] - b[k]).max()) for k in a.files)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--replicas", type=int, default=0)
    parser.add_argument("--sharded", action="store_true")
    parser.add_argument("--out", default="")
    parser.add_argument(
        "--suite",
        choices=("sharded_state", "model_parallel"),
        default="sharded_state",
    )
    parser.add_argument("--model", choices=("mlp3", "dense4"), default="mlp3")
    parser.add_argument(
        "--distribution",
        choices=("none", "data_parallel", "model_parallel"),
        default="none",
    )
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    if args.suite == "model_parallel":
        _model_parallel_suite(args)
        return
    w = args.width
    params = w * 2 * w + 4 * w * w + 2 * w * w + 5 * w
    print(label())
    print(
        f"MLP {w}-{2 * w}-{2 * w}-{w} ({params / 1e6:.1f}M parameters), "
        f"Adam, global batch {GLOBAL_BATCH}, {args.steps} steps, "
        "one process per row"
    )
    tmp = tempfile.mkdtemp()

    def out(name):
        return os.path.join(tmp, f"{name}.npz")

    reference = _run(w, args.steps, 0, False, out("one_device"))
    print(_row("one device", reference))
    rows = {}
    for replicas in (1, 2, 4):
        for sharded in (False, True):
            name = f"local{replicas}_{'sharded' if sharded else 'full'}"
            rows[name] = _run(w, args.steps, replicas, sharded, out(name))
            title = f"LocalReplicator({replicas})" + (
                " sharded" if sharded else ""
            )
            print(_row(title, rows[name]))
    full, sharded = rows["local4_full"], rows["local4_sharded"]
    saved = full["peak_rss_mb"] - sharded["peak_rss_mb"]
    print(f"peak RSS saved at 4 replicas: {saved:.0f} MB (goal >= 120)")
    if "tensors_peak_mb" in full:
        print(
            "peak live tensors saved at 4 replicas: "
            f"{full['tensors_peak_mb'] - sharded['tensors_peak_mb']:.0f} MB; "
            "live after training: "
            f"{full['tensors_mb'] - sharded['tensors_mb']:.0f} MB"
        )
    difference = _max_difference(out("local4_sharded"), out("one_device"))
    print(
        "max |weight difference| sharded LocalReplicator(4) vs one device: "
        f"{difference:.2e} (goal <= 1e-5)"
    )
    ratios = []
    for i in range(args.pairs):
        # Alternate which goes first, so drift favours neither. A ratio of
        # step TIMES: sharded over unsharded; rates would be the inverse.
        order = (True, False) if i % 2 else (False, True)
        times = {
            s: _run(w, args.steps, 4, s, out(f"pair{s}"))["step_ms"]
            for s in order
        }
        ratios.append(times[False] / times[True])
    print(
        summary(
            "speed ratio unsharded/sharded step time at 4 replicas "
            "(= sharded rate / unsharded rate)",
            ratios,
        )
    )


def _model_parallel_suite(args):
    """DataParallel vs ModelParallel (1x4) on 4 devices, alternating."""
    import numpy as np

    w = 2048 if args.width == 1024 else args.width
    print(label())
    print(
        f"MLP of 4 Dense({w}) on {w} inputs ({4 * (w * w + w) / 1e6:.1f}M "
        f"parameters), Adam, global batch {GLOBAL_BATCH}, {args.steps} "
        "steps, 4 devices; ModelParallel lays every kernel out "
        '(None, "model") on a 1x4 mesh; one process per run'
    )
    tmp = tempfile.mkdtemp()

    def run(distribution, name):
        return _run(
            w,
            args.steps,
            0,
            False,
            os.path.join(tmp, f"{name}.npz"),
            model="dense4",
            distribution=distribution,
        )

    one = run(None, "one_device")
    print(_row("one device", one))
    saved, ratios = [], []
    for i in range(args.pairs):
        # Alternate which goes first, so drift favours neither.
        order = ("model_parallel", "data_parallel")
        if i % 2:
            order = order[::-1]
        pair = {d: run(d, d) for d in order}
        for d in order:
            print(_row(f"pair {i + 1} {d}", pair[d]))
        saved.append(
            pair["data_parallel"]["peak_rss_mb"]
            - pair["model_parallel"]["peak_rss_mb"]
        )
        ratios.append(
            pair["model_parallel"]["step_ms"] / pair["data_parallel"]["step_ms"]
        )
    print(
        summary(
            "peak RSS DataParallel - ModelParallel (MB, goal >= 400)", saved
        )
    )
    print(
        summary("step time ModelParallel / DataParallel (goal <= 1.5)", ratios)
    )
    difference = _max_difference(
        os.path.join(tmp, "model_parallel.npz"),
        os.path.join(tmp, "one_device.npz"),
    )
    reference = np.load(os.path.join(tmp, "one_device.npz"))
    scale = max(float(np.abs(reference[k]).max()) for k in reference.files)
    print(
        "max |weight difference| ModelParallel vs one device: "
        f"{difference:.2e} (relative {difference / scale:.1e}, goal 1e-5)"
    )


if __name__ == "__main__":
    main()
