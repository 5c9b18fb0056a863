"""Weak scaling over any worker counts: fit, loop, ceiling, one process.

For each worker count W (`--workers 1,2,4,8`), with 64 examples per worker
per step (weak scaling: the global batch is 64 x W), four modes:

  - `fit`: `model.fit` under `kr.MultiWorkerReplicator`, W processes of one
    CPU replica and one thread each;
  - `loop`: a plain `tf.distribute.MultiWorkerMirroredStrategy` custom loop,
    the same W processes;
  - `solo`: the same step with no strategy and no communication, W
    independent processes whose clocks start together (a file barrier);
    their summed rate is the ceiling the machine allows;
  - `local`: the one-process layout, `kr.LocalReplicator(W)` in ONE process
    with W threads (inter-op; one intra-op thread per op), `model.fit`.

Each worker process is pinned to its own core (`os.sched_setaffinity`), and
the one process of `local` to W cores, when this machine has at least W
usable cores; otherwise nothing is pinned and the output says so.

Timing: `fit` and `local` run one `fit` call of warm-up + timed steps; the
clock runs from the end of the last warm-up step to the end of the last
step, each taken when that step's logs are numbers (a Keras callback
marked `async_safe`, so Keras keeps dispatching its batch callbacks off
the training thread as it does without it). `loop` and `solo` run their
warm-up steps, fetch a loss, start the clock, run the timed steps and stop
it after fetching the last loss. So every clock stops only once the
results exist, and no mode's clock holds set-up or tracing.

A pair runs every mode at every W once, alternating the order of W and of
`fit`/`loop` between pairs, so drift favours none. It prints examples/sec
(median over pairs), efficiency (examples/sec over W x the same mode's
one-worker examples/sec in the same pair; median), and per-pair ratios
fit/loop and local/fit with their median, min and max; the first line
labels the run with date, commit and machine. `--plot PATH` writes a PNG of
examples/sec against W with the ideal line (the README embeds
`benchmarks/scaling.png`).

    python benchmarks/multi_worker_scaling.py --workers 1,2 --pairs 8
    python benchmarks/multi_worker_scaling.py --workers 1,2,4,8 \\
        --plot benchmarks/scaling.png
    python benchmarks/multi_worker_scaling.py --smoke  # minutes, no numbers
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402

PER_WORKER_BATCH = 64
MODES = ("fit", "loop", "solo", "local")
NAMES = {
    "fit": "model.fit + MultiWorkerReplicator",
    "loop": "plain MWMS custom loop",
    "solo": "no communication (ceiling)",
    "local": "one process, LocalReplicator(W)",
}
_BASE_ENV = {"OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}


def _thread_env(mode, workers):
    """One thread per worker; the one-process layout gets W inter-op threads."""
    inter = workers if mode == "local" else 1
    return dict(
        _BASE_ENV,
        TF_NUM_INTRAOP_THREADS="1",
        TF_NUM_INTEROP_THREADS=str(inter),
    )


def worker(args):
    """One process: trains, writes its examples/sec to `args.result`."""
    if args.cpus:
        # Before TensorFlow starts its threads: they inherit the mask.
        os.sched_setaffinity(0, [int(c) for c in args.cpus.split(",")])
    import tensorflow as tf

    inter = args.workers if args.worker == "local" else 1
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(inter)
    import keras_replicator as kr

    if args.worker == "fit":
        strategy = kr.MultiWorkerReplicator(replicas_per_worker=1)
    elif args.worker == "local":
        strategy = kr.LocalReplicator(args.workers)
    elif args.worker == "loop":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        # No cluster: each process trains alone on its own 64 examples.
        strategy = tf.distribute.get_strategy()
    import keras

    global_batch = PER_WORKER_BATCH * strategy.num_replicas_in_sync
    dataset = _common.synthetic_images(global_batch)
    with strategy.scope():
        model = _common.MODELS[args.model]()
        optimizer = keras.optimizers.SGD(0.01)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="sum_over_batch_size"
        )
    if args.worker in ("fit", "local"):
        model.compile(optimizer, loss_fn)
        clock = _step_clock(args.warmup - 1, args.warmup + args.steps - 1)
        model.fit(
            dataset,
            steps_per_epoch=args.warmup + args.steps,
            verbose=0,
            callbacks=[clock],
        )
        seconds = clock.stop - clock.start
    else:
        seconds = _custom_loop(
            args, strategy, dataset, model, optimizer, loss_fn
        )
    with open(args.result, "w") as f:
        json.dump({"rate": args.steps * global_batch / seconds}, f)


def _custom_loop(args, strategy, dataset, model, optimizer, loss_fn):
    """Runs the warm-up and timed steps; returns the timed seconds."""
    import tensorflow as tf

    iterator = iter(strategy.experimental_distribute_dataset(dataset))

    @tf.function
    def train_step(it):
        def step(x, y):
            with tf.GradientTape() as tape:
                # tf.distribute's convention, under stock strategies and
                # ours alike in `strategy.run`: the Loss object divides by
                # the replica count and the optimizer sums the shares.
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(
                zip(grads, model.trainable_variables, strict=True)
            )
            return loss

        x, y = next(it)
        return strategy.reduce(
            "SUM", strategy.run(step, args=(x, y)), axis=None
        )

    for _ in range(args.warmup):
        loss = train_step(iterator)
    float(loss)
    if args.worker == "solo":
        # Independent processes would start their clocks apart (one
        # imports TensorFlow faster) and overlap less than the synchronous
        # modes do, overstating the ceiling: start together.
        _barrier(os.path.dirname(args.result), args.workers)
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = train_step(iterator)
    float(loss)  # the clock stops once the last step's result exists
    return time.perf_counter() - start


def _barrier(directory, workers, timeout=120):
    """Waits until `workers` processes have reached it (files in directory)."""
    open(os.path.join(directory, f"ready-{os.getpid()}"), "w").close()
    deadline = time.monotonic() + timeout
    while sum(n.startswith("ready-") for n in os.listdir(directory)) < workers:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier: fewer than {workers} workers came")
        time.sleep(0.001)


def _step_clock(first, last):
    """A Keras callback stamping when steps `first` and `last` have results.

    Keras hands `on_train_batch_end` the step's logs as Python numbers, so
    the step's results exist when it runs. `async_safe` keeps Keras'
    asynchronous batch-callback dispatch on, as in a `fit` without this
    callback. Made here rather than at import: keras may only be imported
    once the worker has set its thread limits.
    """
    import keras

    class StepClock(keras.callbacks.Callback):
        async_safe = True
        start = stop = None

        def on_train_batch_end(self, batch, logs=None):
            if batch == first:
                self.start = time.perf_counter()
            elif batch == last:
                self.stop = time.perf_counter()

    return StepClock()


def usable_cores():
    """The cores this process may run on, in order."""
    return sorted(os.sched_getaffinity(0))


def run(mode, workers, args, cores):
    """Runs one mode at `workers`; returns its examples/sec."""
    from keras_replicator._src.cluster import launch

    pinned = len(cores) >= workers
    processes = 1 if mode == "local" else workers
    with tempfile.TemporaryDirectory() as tmp:
        ports = launch.free_ports(processes)
        procs = []
        for i in range(processes):
            if mode in ("fit", "loop"):
                env = launch.worker_environ(ports, i, replicas_per_worker=1)
            else:
                env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
            env.update(_thread_env(mode, workers))
            if not pinned:
                cpus = ""
            elif mode == "local":
                cpus = ",".join(map(str, cores[:workers]))
            else:
                cpus = str(cores[i])
            argv = [sys.executable, os.path.abspath(__file__)]
            argv += ["--worker", mode, "--model", args.model]
            argv += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
            argv += ["--workers", str(workers), "--cpus", cpus]
            argv += ["--result", os.path.join(tmp, f"{i}.json")]
            procs.append(
                subprocess.Popen(
                    argv,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
            )
        try:
            for proc in procs:
                _, err = proc.communicate(timeout=900)
                if proc.returncode:
                    raise RuntimeError(
                        f"{mode} with {workers} worker(s) failed:\n"
                        + err.decode()[-3000:]
                    )
        finally:
            for proc in procs:
                proc.kill()
        rates = []
        for i in range(processes):
            with open(os.path.join(tmp, f"{i}.json")) as f:
                rates.append(json.load(f)["rate"])
    # Independent processes add up; a synchronous worker's rate already
    # counts the global batch (every worker reports the same).
    return sum(rates) if mode == "solo" else rates[0]


def measure(args, counts, cores):
    """Runs the pairs; returns {mode: {workers: [rate per pair]}}."""
    rates = {mode: {w: [] for w in counts} for mode in MODES}
    for pair in range(args.pairs):
        # Alternate the order of worker counts and of fit/loop per pair.
        order = counts if pair % 2 == 0 else counts[::-1]
        modes = MODES if pair % 2 == 0 else ("loop", "fit", "local", "solo")
        for workers in order:
            for mode in modes:
                rate = run(mode, workers, args, cores)
                rates[mode][workers].append(rate)
                print(
                    f"  pair {pair + 1}/{args.pairs}: {mode} x{workers} "
                    f"{rate:.0f} ex/s",
                    flush=True,
                )
    return rates


def _spread(values):
    return (
        f"median {statistics.median(values):.3f} (min {min(values):.3f}, "
        f"max {max(values):.3f}, {len(values)} pairs)"
    )


def report(rates, counts):
    """Prints the table and the per-pair ratios."""
    median = statistics.median
    header = "| workers | " + " | ".join(NAMES[m] for m in MODES)
    header += " | efficiency " + " / ".join(MODES) + " |"
    print()
    print("examples/sec (median over pairs); efficiency = examples/sec over")
    print("W x the same mode's 1-worker examples/sec in the same pair (median)")
    print(header)
    print("|---" * (len(MODES) + 2) + "|")
    for w in counts:
        cells = [f"{median(rates[m][w]):.0f}" for m in MODES]
        eff = []
        for m in MODES:
            one = rates[m][1]
            eff.append(
                median(
                    r / (w * o) for r, o in zip(rates[m][w], one, strict=True)
                )
            )
        print(
            f"| {w} | "
            + " | ".join(cells)
            + " | "
            + " / ".join(f"{e:.2f}" for e in eff)
            + " |"
        )
    print()
    for w in counts:
        fit_loop = [
            f / lp
            for f, lp in zip(rates["fit"][w], rates["loop"][w], strict=True)
        ]
        local_fit = [
            lc / f
            for lc, f in zip(rates["local"][w], rates["fit"][w], strict=True)
        ]
        per_pair = [round(r, 3) for r in fit_loop]
        print(f"{w} worker(s): fit/loop per pair {per_pair}")
        print(f"  fit/loop {_spread(fit_loop)}")
        print(f"  one process/fit {_spread(local_fit)}")


def plot(rates, counts, path, title):
    """Writes examples/sec against workers, with the ideal line, to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for mode in MODES:
        ys = [statistics.median(rates[mode][w]) for w in counts]
        ax.plot(counts, ys, "o-", label=NAMES[mode])
    one = statistics.median(rates["solo"][1])
    ax.plot(
        counts,
        [one * w for w in counts],
        "k--",
        alpha=0.5,
        label="ideal: W x one worker",
    )
    ax.set_xticks(counts)
    ax.set_xlabel("workers W (one process: W replicas)")
    ax.set_ylabel("examples / sec")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def parse_counts(text):
    try:
        counts = sorted({int(w) for w in text.split(",") if w.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError(
            f"must be positive integers separated by commas, e.g. 1,2,4,8. "
            f"Received: {text!r}"
        )
    # Efficiency needs the one-worker rate of every mode.
    return sorted({1, *counts})


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--workers", type=parse_counts, default=[1, 2])
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument(
        "--model", choices=sorted(_common.MODELS), default="cifar"
    )
    parser.add_argument(
        "--steps", type=int, help="timed steps (default: 100 cifar, 300 small)"
    )
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--plot", metavar="PATH", help="write a PNG plot")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="1 pair of a few small steps: checks the script runs, in about "
        "a minute; its numbers mean nothing",
    )
    # Internal: one worker process.
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--cpus", default="", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.workers = args.workers[-1]
        worker(args)
        return
    if args.smoke:
        args.pairs, args.model, args.steps, args.warmup = 1, "small", 5, 2
    if args.steps is None:
        args.steps = 100 if args.model == "cifar" else 300
    if args.warmup < 1 or args.steps < 1 or args.pairs < 1:
        parser.error("--warmup, --steps and --pairs must be at least 1")
    counts = args.workers
    cores = usable_cores()
    print(_common.label())
    pinning = (
        "each worker process pinned to its own core"
        if len(cores) >= counts[-1]
        else f"NOT pinned at {counts[-1]} workers: only {len(cores)} usable "
        f"cores (pinned where W <= {len(cores)})"
    )
    setup = (
        f"weak scaling, {args.model} conv net, {PER_WORKER_BATCH} examples "
        f"per worker per step, one thread per worker; {pinning}; "
        f"{args.steps} timed steps after {args.warmup}; {args.pairs} pairs"
    )
    print(setup, flush=True)
    rates = measure(args, counts, cores)
    report(rates, counts)
    if args.plot:
        title = (
            f"{_common.label()}\n{args.model} conv net, {PER_WORKER_BATCH} "
            "examples per worker per step, one thread per worker"
            + (
                ""
                if len(cores) >= counts[-1]
                else f", unpinned above {len(cores)}"
            )
        )
        plot(rates, counts, args.plot, title)


if __name__ == "__main__":
    main()
