"""The MPI transport against TensorFlow's gRPC, on the same mpiexec processes.

Every run is `mpiexec -n N python benchmarks/transport.py --worker ...`
with one replica per process (KERAS_REPLICATOR_CPU_REPLICAS=1), once with
KERAS_REPLICATOR_TRANSPORT=grpc (TensorFlow's collectives over gRPC) and
once with =mpi (mpi4py, `mpi_collectives.py`), alternating which goes
first each round, so each ratio is of a pair run side by side. Measured:

  1. `allreduce`: the all-reduce of one float32 tensor between 2
     processes, per size (4 KB to 256 MB): raw mpi4py `Allreduce` in place
     on a NumPy array (measured in the MPI run), and the replicator's
     `ReplicaContext.all_reduce` inside a `tf.function` (gRPC or MPI),
     each call blocked on with `.numpy()` of one element of the sum.
     Ratios: MPI / raw mpi4py and gRPC / MPI (time per call).
  2. `fit`: the MLP of benchmarks/model_parallel_processes.py (4 x
     Dense(2048) on 2048 inputs, ReLU between, 16.8M parameters, Adam,
     global batch 64) under `kr.auto()` (MultiWorkerReplicator) over 2
     processes; step time after the first (traced) step; the last loss of
     both runs printed side by side (they must agree).
  3. `model_parallel`: the same MLP under `keras.distribution.ModelParallel`
     on a (1, N) mesh of N processes, hidden kernels `(None, "model")`
     (model_parallel_processes.py's worker), for N = 2 and 4; and one
     device's step for reference.

Each process runs one intra-op and one inter-op thread (pinned to its own
core when there are as many cores as processes). The printed ratios are
the median (min, max) over rounds of the per-pair ratios.

    python benchmarks/transport.py [--quick] [--rounds 3] [--sizes 4KB 1MB]
        [--parts allreduce fit model_parallel]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import label  # noqa: E402
from _common import relu_mlp  # noqa: E402
from _common import run_processes  # noqa: E402
from _common import summary  # noqa: E402
from _common import timed  # noqa: E402

TRANSPORTS = ("grpc", "mpi")
PARTS = ("allreduce", "fit", "model_parallel")
SIZES = ("4KB", "64KB", "1MB", "16MB", "67MB", "256MB")
QUICK_SIZES = ("4KB", "1MB", "16MB")
GLOBAL_BATCH = 64
# Seconds each all-reduce size is timed for, at least (and 3 calls).
SECONDS_PER_SIZE = 2.0


def _bytes(size: str) -> int:
    units = {"KB": 2**10, "MB": 2**20}
    if size == "67MB":  # 16.8M float32: the MLP's gradients.
        return 4 * (4 * (2048 * 2048 + 2048))
    return int(size[:-2]) * units[size[-2:]]


def _rank() -> int:
    return int(os.environ.get("PMI_RANK", 0))


def _one_thread(processes):
    import tensorflow as tf

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= processes:
        os.sched_setaffinity(0, [cores[_rank()]])
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)


def _seconds_per_call(call):
    """Median seconds of one blocking call(), repeated for SECONDS_PER_SIZE.

    The ranks must agree on how many calls they make (each is a collective),
    so the count is rank 0's, from a first timed call, broadcast.
    """
    from mpi4py import MPI

    call()  # Warm up (and trace).
    first, _ = timed(call)
    calls = int(min(50, max(3, SECONDS_PER_SIZE / max(first, 1e-6))))
    calls = MPI.COMM_WORLD.bcast(calls, root=0)
    return statistics.median(timed(call)[0] for _ in range(calls))


def _allreduce_worker(args):
    import numpy as np
    import tensorflow as tf
    from mpi4py import MPI

    import keras_replicator as kr

    _one_thread(2)
    replicator = kr.auto()
    result = {"rank": _rank(), "transport": replicator.transport, "sizes": {}}
    for size in args.sizes:
        count = _bytes(size) // 4
        times = {}
        if replicator.transport == "mpi":
            array = np.ones(count, np.float32)
            times["raw"] = _seconds_per_call(
                lambda a=array: MPI.COMM_WORLD.Allreduce(
                    MPI.IN_PLACE, a, MPI.SUM
                )
            )
            del array
        with replicator.scope():
            value = tf.Variable(tf.ones([count]))

        def step(v=value):
            total = tf.distribute.get_replica_context().all_reduce(
                "SUM", tf.identity(v)
            )
            # One element: depends on the whole sum, moves 4 bytes back.
            return total[0]

        compiled = tf.function(lambda s=step: replicator.run(s))
        times["replicator"] = _seconds_per_call(
            lambda c=compiled: replicator.experimental_local_results(c())[
                0
            ].numpy()
        )
        result["sizes"][size] = times
        del value
    print("RESULT " + json.dumps(result), flush=True)


def _fit_worker(args):
    import time

    import keras
    import numpy as np
    import tensorflow as tf

    import keras_replicator as kr

    _one_thread(2)
    replicator = kr.auto()
    w = args.width
    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH * args.steps, w)).astype("float32")
    y = rng.normal(size=(GLOBAL_BATCH * args.steps, w)).astype("float32")
    with replicator.scope():
        model = relu_mlp(w)
    ends, losses = [], []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.perf_counter())
            losses.append(float(logs["loss"]))

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    data = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .batch(GLOBAL_BATCH)
        .with_options(options)
    )
    model.fit(data, epochs=1, verbose=0, callbacks=[Clock()])
    step_ms = statistics.median(
        1000 * (b - a) for a, b in zip(ends[1:-1], ends[2:], strict=True)
    )
    print(
        "RESULT "
        + json.dumps(
            {
                "rank": _rank(),
                "transport": replicator.transport,
                "step_ms": step_ms,
                "loss": losses[-1],
            }
        ),
        flush=True,
    )


def _model_parallel_worker(args):
    import model_parallel_processes

    args.mode = "model_parallel" if args.workers > 1 else "one_device"
    args.dtype_policy = "float32"
    model_parallel_processes._worker(args)


def _run(args, part, transport, workers, out=""):
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        f"--parts={part}",
        f"--workers={workers}",
        f"--width={args.width}",
        f"--steps={args.steps}",
        f"--out={out}",
        "--sizes",
        *args.sizes,
    ]
    env = {
        "KERAS_REPLICATOR_CPU_REPLICAS": "1",
        "KERAS_REPLICATOR_TRANSPORT": transport,
    }
    results = run_processes(
        command, workers, timeout=args.timeout, mpiexec=True, env=env
    )
    # The chief's (mpiexec interleaves the ranks' lines).
    chief = min(results, key=lambda r: r.get("rank", 0))
    if part == "model_parallel":
        chief["step_ms"] = max(r["step_ms"] for r in results)
    elif chief["transport"] != transport:
        raise RuntimeError(f"Asked for {transport}, ran {chief['transport']}")
    return chief


def _rounds(args, part, workers):
    """`args.rounds` pairs of runs, alternating which transport goes first."""
    pairs = []
    for i in range(args.rounds):
        order = TRANSPORTS if i % 2 == 0 else TRANSPORTS[::-1]
        runs = {t: _run(args, part, t, workers, args.out) for t in order}
        pairs.append(runs)
    return pairs


def _allreduce(args):
    print("\n1. all-reduce of one float32 tensor, 2 processes (ms per call)")
    pairs = _rounds(args, "allreduce", 2)
    print(f"{'size':>6} {'raw mpi4py':>11} {'MPI':>9} {'gRPC':>9}")
    for size in args.sizes:
        for i, runs in enumerate(pairs):
            raw = runs["mpi"]["sizes"][size]["raw"]
            mpi = runs["mpi"]["sizes"][size]["replicator"]
            grpc = runs["grpc"]["sizes"][size]["replicator"]
            print(
                f"{size:>6} {1000 * raw:11.3f} {1000 * mpi:9.3f} "
                f"{1000 * grpc:9.3f}  (round {i + 1})"
            )
    for size in args.sizes:
        print(
            summary(
                f"{size} MPI / raw mpi4py",
                [
                    r["mpi"]["sizes"][size]["replicator"]
                    / r["mpi"]["sizes"][size]["raw"]
                    for r in pairs
                ],
            )
        )
        print(
            summary(
                f"{size} gRPC / MPI",
                [
                    r["grpc"]["sizes"][size]["replicator"]
                    / r["mpi"]["sizes"][size]["replicator"]
                    for r in pairs
                ],
            )
        )


def _steps(args, part, workers, title):
    pairs = _rounds(args, part, workers)
    for i, runs in enumerate(pairs):
        line = f"{title} round {i + 1}: " + ", ".join(
            f"{t} {runs[t]['step_ms']:.1f} ms/step" for t in TRANSPORTS
        )
        if part == "fit":
            line += ", last loss " + ", ".join(
                f"{t} {runs[t]['loss']:.6g}" for t in TRANSPORTS
            )
        print(line, flush=True)
    print(
        summary(
            f"{title} step MPI / gRPC",
            [r["mpi"]["step_ms"] / r["grpc"]["step_ms"] for r in pairs],
        )
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", nargs="+", default=None)
    parser.add_argument("--parts", nargs="+", default=list(PARTS))
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.sizes is None:
        args.sizes = list(QUICK_SIZES if args.quick else SIZES)
    if args.steps is None:
        args.steps = 6 if args.quick else 20
    if args.quick:
        args.rounds = min(args.rounds, 1)
        args.width = min(args.width, 512)
        args.timeout = min(args.timeout, 120)
    if args.worker:
        part = args.parts[0]
        if part == "allreduce":
            _allreduce_worker(args)
        elif part == "fit":
            _fit_worker(args)
        else:
            _model_parallel_worker(args)
        return
    args.out = os.path.join(tempfile.mkdtemp(), "weights.npz")
    print(label())
    print(
        f"mpiexec processes of one replica each; {args.rounds} round(s), "
        "gRPC and MPI alternating; MLP of 4 Dense("
        f"{args.width}) ({4 * (args.width**2 + args.width) / 1e6:.1f}M "
        f"parameters), global batch {GLOBAL_BATCH}, {args.steps} steps",
        flush=True,
    )
    if "allreduce" in args.parts:
        _allreduce(args)
    if "fit" in args.parts:
        print("\n2. fit under kr.auto() (MultiWorkerReplicator), 2 processes")
        _steps(args, "fit", 2, "fit 2 processes")
    if "model_parallel" in args.parts:
        print("\n3. ModelParallel, mesh (1, N), kernels (None, 'model')")
        one = _run(args, "model_parallel", "grpc", 1, args.out)
        print(f"one device: {one['step_ms']:.1f} ms/step", flush=True)
        for n in (2, 4):
            _steps(args, "model_parallel", n, f"ModelParallel {n} processes")


if __name__ == "__main__":
    main()
