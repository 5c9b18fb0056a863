"""Weak scaling over worker processes: 1 vs 2 workers, ours vs plain MWMS.

Each worker is one process with one CPU replica, limited to one thread (set
through the environment before TensorFlow starts), and takes a fixed batch
of 64 examples per step (weak scaling: the global batch is 64 x workers).
Four modes:
  - `fit`:  `model.fit` under `kr.MultiWorkerReplicator` (Keras' default
    `steps_per_execution=1`);
  - `fit_spe`: the same with `steps_per_execution=10` (fewer Python round
    trips per step; the same all-reduces);
  - `loop`: a plain `tf.distribute.MultiWorkerMirroredStrategy` custom loop;
  - `solo`: the same step with no strategy and no communication, each
    process training on its own, their clocks started together (a file
    barrier). Its 2-vs-1 ratio is the ceiling the machine allows at that
    moment: two busy processes do not get twice the CPU of one.
Each pair runs every mode with 1 and 2 workers back to back (the order
alternates between pairs), so the modes see the same load; it measures
examples/sec over the timed steps (until results are fetched) and prints
the 2-vs-1 ratios (median, min, max over pairs; see `_common.py`).

Two models (`--model`): `cifar` (default), a CIFAR-10-style conv net of
about 75 ms a step here, where compute dominates as in real image models;
and `small`, a tiny conv net of about 9 ms a step, where the latency of a
loopback all-reduce (about 2 ms, two per step) caps any synchronous method.

`fit` gets two rows: the whole call, and its steps (from the call to the
end of its last step, so set-up is in and teardown is out). The two differed
by seconds until session 3: deleting the distributed iterator at the end of
`fit` stalled on a lost wake-up of tf.data's autotune thread (see
`keras_replicator/_src/patches/iterator_teardown.py`); the rows now show what
remains between them.

    python benchmarks/multi_worker_scaling.py [--pairs 5] [--model cifar]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402

PER_WORKER_BATCH = 64
_MODES = ("fit", "fit_spe", "loop", "solo")
# Rows of the report; a `fit` run gives two (see worker()).
_ROWS = ("fit", "fit_steps", "fit_spe", "loop", "solo")
# Keras' `steps_per_execution` for the `fit_spe` mode.
SPE = 10
_NAMES = {
    "fit": "model.fit + MultiWorkerReplicator, whole call",
    "fit_steps": "model.fit + MultiWorkerReplicator, its steps",
    "fit_spe": f"model.fit(steps_per_execution={SPE}), whole call",
    "loop": "plain MWMS custom loop",
    "solo": "no communication (ceiling)",
}
THREAD_ENV = {
    "OMP_NUM_THREADS": "1",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_NUM_INTEROP_THREADS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "3",
}


def worker(mode, model_name, steps, warmup, result_path, cluster_size):
    """One worker process: trains and writes its examples/sec."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    if mode in ("fit", "fit_spe"):
        import keras_replicator as kr

        strategy = kr.MultiWorkerReplicator(replicas_per_worker=1)
    elif mode == "loop":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        # No cluster: each process trains alone on its own 64 examples.
        strategy = tf.distribute.get_strategy()
    import keras

    workers = strategy.num_replicas_in_sync
    global_batch = PER_WORKER_BATCH * workers
    dataset = _common.synthetic_images(global_batch)
    with strategy.scope():
        model = _common.MODELS[model_name]()
        optimizer = keras.optimizers.SGD(0.01)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="sum_over_batch_size"
        )
    rates = {}
    if mode == "fit_spe":
        model.compile(optimizer, loss_fn, steps_per_execution=SPE)
        model.fit(dataset, steps_per_epoch=warmup, verbose=0)
        start = time.perf_counter()
        model.fit(dataset, steps_per_epoch=steps, verbose=0)
        seconds = time.perf_counter() - start
    elif mode == "fit":
        model.compile(optimizer, loss_fn)
        model.fit(dataset, steps_per_epoch=warmup, verbose=0)
        clock = _step_clock()
        start = time.perf_counter()
        # fit returns after its logs are fetched as numbers.
        model.fit(dataset, steps_per_epoch=steps, verbose=0, callbacks=[clock])
        seconds = time.perf_counter() - start
        # From fit's start to the end of its last step (Keras fetches each
        # step's logs as numbers, so the step has finished): what `fit`
        # costs without its teardown, for comparison with the loop.
        rates["fit_steps"] = steps * global_batch / (clock.last - start)
    else:
        iterator = iter(strategy.experimental_distribute_dataset(dataset))

        @tf.function
        def train_step(it):
            def step(x, y):
                with tf.GradientTape() as tape:
                    # The Keras loss object already scales by
                    # 1/num_replicas_in_sync inside strategy.run.
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

        for _ in range(warmup):
            train_step(iterator)
        float(train_step(iterator))
        if mode == "solo":
            # Independent processes would start their clocks apart (one
            # imports TensorFlow faster) and overlap less than the
            # synchronous modes do, overstating the ceiling: start together.
            _barrier(os.path.dirname(result_path), cluster_size)
        start = time.perf_counter()
        for _ in range(steps):
            loss = train_step(iterator)
        float(loss)  # wait until the last step's result is fetched
        seconds = time.perf_counter() - start
    rates[mode] = steps * global_batch / seconds
    with open(result_path, "w") as f:
        json.dump(rates, f)


def _barrier(directory, workers, timeout=120):
    """Waits until `workers` processes have reached it (files in directory)."""
    open(os.path.join(directory, f"ready-{os.getpid()}"), "w").close()
    deadline = time.monotonic() + timeout
    while sum(n.startswith("ready-") for n in os.listdir(directory)) < workers:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier: fewer than {workers} workers came")
        time.sleep(0.001)


def _step_clock():
    """A Keras callback noting when the last training step ended.

    Made here rather than at import: keras may only be imported once the
    worker has set its thread limits.
    """
    import keras

    class StepClock(keras.callbacks.Callback):
        last = None

        def on_train_batch_end(self, batch, logs=None):
            self.last = time.perf_counter()

    return StepClock()


def _rate(mode, rates):
    """A cluster's examples/sec from its workers' own rates."""
    if mode == "solo":
        # Independent processes: their throughputs add up.
        return sum(rates)
    # Synchronous: every worker's rate already counts the global batch.
    return rates[0]


def run_cluster(mode, model_name, workers, steps, warmup):
    """Starts `workers` processes; returns the cluster's examples/sec."""
    from keras_replicator._src.cluster import launch

    with tempfile.TemporaryDirectory() as tmp:
        ports = launch.free_ports(workers)
        procs = []
        for i in range(workers):
            env = launch.worker_environ(ports, i, replicas_per_worker=1)
            env.update(THREAD_ENV)
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--worker",
                        mode,
                        "--model",
                        model_name,
                        "--steps",
                        str(steps),
                        "--warmup",
                        str(warmup),
                        "--result",
                        os.path.join(tmp, f"{i}.json"),
                        "--workers",
                        str(workers),
                    ],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
            )
        try:
            for proc in procs:
                _, err = proc.communicate(timeout=600)
                if proc.returncode:
                    raise RuntimeError(err.decode()[-3000:])
        finally:
            for proc in procs:
                proc.kill()
        rates = []
        for i in range(workers):
            with open(os.path.join(tmp, f"{i}.json")) as f:
                rates.append(json.load(f))
        return {row: _rate(mode, [r[row] for r in rates]) for row in rates[0]}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument(
        "--model", choices=sorted(_common.MODELS), default="cifar"
    )
    parser.add_argument(
        "--steps", type=int, help="timed steps (default: 100 cifar, 300 small)"
    )
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--worker", choices=_MODES)
    parser.add_argument("--result")
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 100 if args.model == "cifar" else 300
    if args.worker:
        worker(
            args.worker,
            args.model,
            args.steps,
            args.warmup,
            args.result,
            args.workers,
        )
        return
    print(_common.machine())
    print(
        f"weak scaling, {args.model} conv net: {PER_WORKER_BATCH} examples "
        f"per worker per step, 1 CPU replica and 1 thread per worker, "
        f"{args.steps} timed steps after {args.warmup}"
    )
    results = {row: ([], [], []) for row in _ROWS}
    for i in range(args.pairs):
        # Interleave the modes within a pair so that they see the same load,
        # and alternate which of 1 and 2 workers goes first (as
        # _common.paired_ratios does), so drift favours neither.
        for mode in _MODES:
            rate = {}
            for workers in (2, 1) if i % 2 else (1, 2):
                rate[workers] = run_cluster(
                    mode, args.model, workers, args.steps, args.warmup
                )
            for row in rate[1]:
                rates_1, rates_2, ratios = results[row]
                rates_1.append(rate[1][row])
                rates_2.append(rate[2][row])
                ratios.append(rate[2][row] / rate[1][row])
    for row in _ROWS:
        rates_1, rates_2, ratios = results[row]
        print(
            f"{_NAMES[row]}: 1 worker {[round(r) for r in rates_1]} ex/s, "
            f"2 workers {[round(r) for r in rates_2]} ex/s"
        )
        print(_common.summary(f"  {_NAMES[row]} 2-vs-1 ratio", ratios))


if __name__ == "__main__":
    main()
