"""ModelParallel's step over processes against DataParallel and one device.

An MLP of four Dense(D) layers on D inputs (D=2048: 16.8M parameters),
ReLU between them, Adam, global batch 64, `--steps` steps, run three ways:

  - `model_parallel`: `keras.distribution.ModelParallel` on a (1, N) mesh of
    N processes with one device each (`keras-replicator launch --workers N
    --replicas-per-worker 1`), every kernel laid out `(None, "model")`. At
    16 rows per replica the products move rows (`sharding/contraction.py`):
    each layer all-gathers the rows, all-reduces its output, and in the
    backward pass all-gathers the output gradients; no kernel travels.
  - `model_parallel_kernel`: the same, with every product forced onto the
    other path (`contraction._choose` replaced in the benchmark's worker):
    the kernel is all-gathered in the forward pass and again in the
    backward pass, and the full gradient is all-reduced then cut. What the
    rows path replaced, measured side by side.
  - `data_parallel`: `keras.distribution.DataParallel` over the same N
    processes: whole weights everywhere, one all-reduce of the gradients.
    (It runs on `MultiWorkerReplicator`, whose all-reduce is stock
    `MultiWorkerMirroredStrategy`'s; stock Keras 3 cannot `fit` over
    processes at all, keras-team/keras#20585, and TensorFlow has no model
    parallelism of its own to compare with.)
  - `one_device`: the same model and data in one process, no distribution.

Each process is pinned to its own core when the machine has N cores, and
runs one intra-op and one inter-op thread, so N processes use N cores and
one device uses one. Step time is the median interval between batch ends
after the first (traced) step, the slowest process's. Each of `--pairs`
rounds runs the three distributed modes, in an order rotated each round
(so each ratio is of a pair run side by side); the script prints each run
(with each process's peak RSS), the median (min, max) over rounds of the
ratios of ModelParallel's step time to
DataParallel's, to the kernel path's and to one device's (measured once,
first), and ModelParallel's weights against one device's.

`--dtype-policy mixed_bfloat16` runs every mode under that Keras dtype
policy (float32 weights, 16-bit products). `--optimizer sgd` trains with
SGD(0.05) instead of Adam: the weights' differences from one device are
then the gradients' rounding alone (Adam normalises each gradient by its
own size, so a last-bit difference in a near-zero one can become a whole
step of the learning rate).

    python benchmarks/model_parallel_processes.py [--workers 2] [--pairs 5]
"""

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import label  # noqa: E402
from _common import relu_mlp  # noqa: E402
from _common import run_processes  # noqa: E402
from _common import summary  # noqa: E402

GLOBAL_BATCH = 64
MODES = ("model_parallel", "model_parallel_kernel", "data_parallel")


def _task_index():
    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    if "task" not in config:  # Under mpiexec (benchmarks/transport.py).
        return int(os.environ.get("PMI_RANK", 0))
    return int(config["task"].get("index", 0))


def _worker(args):
    import time

    index = _task_index()
    if len(os.sched_getaffinity(0)) >= args.workers:
        os.sched_setaffinity(0, [sorted(os.sched_getaffinity(0))[index]])
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_replicator  # noqa: F401 - keras.distribution on TF

    keras.config.set_dtype_policy(args.dtype_policy)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    if args.mode == "model_parallel_kernel":
        from keras_replicator._src.sharding import contraction

        contraction._choose = lambda moving, rows, kernel: kernel()
    if args.mode != "one_device":
        keras.distribution.initialize()
        devices = keras.distribution.list_devices()
        if args.mode == "data_parallel":
            distribution = keras.distribution.DataParallel(devices=devices)
        else:
            mesh = keras.distribution.DeviceMesh(
                (1, len(devices)), ("batch", "model"), devices
            )
            layout_map = keras.distribution.LayoutMap(mesh)
            layout_map[r".*/d\d/kernel"] = (None, "model")
            distribution = keras.distribution.ModelParallel(
                layout_map=layout_map, batch_dim_name="batch"
            )
        keras.distribution.set_distribution(distribution)
    w = args.width
    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH * args.steps, w)).astype("float32")
    y = rng.normal(size=(GLOBAL_BATCH * args.steps, w)).astype("float32")
    model = relu_mlp(w, args.optimizer)
    ends = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.perf_counter())

    # A dataset: Keras shards one over processes (arrays it refuses).
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    model.fit(data, epochs=1, verbose=0, callbacks=[Clock()])
    step_ms = statistics.median(
        1000 * (b - a) for a, b in zip(ends[1:-1], ends[2:], strict=True)
    )
    weights = model.get_weights()  # every process: a sharded read gathers
    if index == 0 and args.out:  # No --out: no file (not ".npz" here).
        np.savez(args.out, *weights)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        "RESULT " + json.dumps({"step_ms": step_ms, "peak_rss_mb": peak}),
        flush=True,
    )


def _run(args, mode, out):
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        f"--mode={mode}",
        f"--workers={args.workers}",
        f"--width={args.width}",
        f"--steps={args.steps}",
        f"--out={out}",
        f"--dtype-policy={args.dtype_policy}",
        f"--optimizer={args.optimizer}",
    ]
    processes = 1 if mode == "one_device" else args.workers
    results = run_processes(command, processes)
    return {
        "step_ms": max(r["step_ms"] for r in results),
        "peak_rss_mb": [round(r["peak_rss_mb"]) for r in results],
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument(
        "--mode",
        choices=("one_device", *MODES),
        default="one_device",
    )
    parser.add_argument("--out", default="")
    parser.add_argument("--dtype-policy", default="float32")
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    import numpy as np

    w, n = args.width, args.workers
    pinned = len(os.sched_getaffinity(0)) >= n
    print(label())
    print(
        f"MLP of 4 Dense({w}) on {w} inputs ({4 * (w * w + w) / 1e6:.1f}M "
        f"parameters), {'SGD' if args.optimizer == 'sgd' else 'Adam'}, "
        f"global batch {GLOBAL_BATCH}, {args.steps} steps; "
        f"{n} processes of one device each "
        f"({'one core each' if pinned else 'not pinned: fewer cores'}), "
        f"one thread per process, dtype policy {args.dtype_policy}"
    )
    tmp = tempfile.mkdtemp()

    def out(name):
        return os.path.join(tmp, f"{name}.npz")

    def row(title, result):
        print(
            f"{title:<29} step {result['step_ms']:7.1f} ms  "
            f"peak RSS per process {result['peak_rss_mb']} MB",
            flush=True,
        )

    one = _run(args, "one_device", out("one_device"))
    row("one device", one)
    ratios = {"DataParallel": [], "the kernel path": [], "one device": []}
    for i in range(args.pairs):
        order = MODES[i % 3 :] + MODES[: i % 3]
        runs = {mode: _run(args, mode, out(mode)) for mode in order}
        for mode in order:
            row(f"pair {i + 1} {mode}", runs[mode])
        mp = runs["model_parallel"]["step_ms"]
        ratios["DataParallel"].append(mp / runs["data_parallel"]["step_ms"])
        ratios["the kernel path"].append(
            mp / runs["model_parallel_kernel"]["step_ms"]
        )
        ratios["one device"].append(mp / one["step_ms"])
    for name, values in ratios.items():
        print(summary(f"step time ModelParallel / {name}", values))
    reference = np.load(out("one_device"))
    scale = max(float(np.abs(reference[k]).max()) for k in reference.files)
    # DataParallel's for scale: under a 16-bit policy each replica's own
    # gradients are rounded to 16 bits, and Adam magnifies the difference.
    for mode, name in (
        ("model_parallel", "ModelParallel"),
        ("data_parallel", "DataParallel"),
    ):
        trained = np.load(out(mode))
        difference = max(
            float(np.abs(trained[k] - reference[k]).max())
            for k in reference.files
        )
        print(
            f"max |weight difference| {name} vs one device: "
            f"{difference:.2e} (relative {difference / scale:.1e})"
        )


if __name__ == "__main__":
    main()
