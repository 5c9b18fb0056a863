"""Weak scaling over worker processes: 1 vs 2 workers, ours vs plain MWMS.

Each worker is one process with one CPU replica, limited to one thread (set
through the environment before TensorFlow starts), and takes a fixed batch
of 64 examples per step (weak scaling: the global batch is 64 x workers).
For each of
  - `fit`:  `model.fit` under `kr.MultiWorkerReplicator`, and
  - `loop`: a plain `tf.distribute.MultiWorkerMirroredStrategy` custom loop,
it alternates 1-worker and 2-worker runs, measures examples/sec over the
timed steps (until results are fetched), and prints the 2-vs-1 ratios
(median, min, max over pairs; see `_common.py`).

    python benchmarks/multi_worker_scaling.py [--pairs 3] [--steps 40]
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
THREAD_ENV = {
    "OMP_NUM_THREADS": "1",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_NUM_INTEROP_THREADS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "3",
}


def worker(mode, steps, warmup, result_path):
    """One worker process: trains and writes its examples/sec."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    if mode == "fit":
        import keras_replicator as kr

        strategy = kr.MultiWorkerReplicator(replicas_per_worker=1)
    else:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import keras

    workers = strategy.num_replicas_in_sync
    global_batch = PER_WORKER_BATCH * workers
    images = tf.random.stateless_uniform((512, 32, 32, 3), seed=(1, 2))
    labels = tf.random.stateless_uniform(
        (512,), seed=(3, 4), maxval=10, dtype=tf.int32
    )
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    dataset = (
        tf.data.Dataset.from_tensor_slices((images, labels))
        .repeat()
        .batch(global_batch, drop_remainder=True)
        .with_options(options)
    )
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((32, 32, 3)),
                keras.layers.Conv2D(16, 3, activation="relu"),
                keras.layers.Conv2D(32, 3, strides=2, activation="relu"),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(10),
            ]
        )
        optimizer = keras.optimizers.SGD(0.01)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="sum_over_batch_size"
        )
    if mode == "fit":
        model.compile(optimizer, loss_fn)
        model.fit(dataset, steps_per_epoch=warmup, verbose=0)
        start = time.perf_counter()
        # fit returns after its logs are fetched as numbers.
        model.fit(dataset, steps_per_epoch=steps, verbose=0)
        seconds = time.perf_counter() - start
    else:
        iterator = iter(strategy.experimental_distribute_dataset(dataset))

        @tf.function
        def train_step(it):
            def step(x, y):
                with tf.GradientTape() as tape:
                    loss = loss_fn(y, model(x, training=True)) / workers
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
        start = time.perf_counter()
        for _ in range(steps):
            loss = train_step(iterator)
        float(loss)  # wait until the last step's result is fetched
        seconds = time.perf_counter() - start
    with open(result_path, "w") as f:
        json.dump({"rate": steps * global_batch / seconds}, f)


def run_cluster(mode, workers, steps, warmup):
    """Starts `workers` processes; returns the chief's examples/sec."""
    from keras_replicator._src import launch

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
                        "--steps",
                        str(steps),
                        "--warmup",
                        str(warmup),
                        "--result",
                        os.path.join(tmp, f"{i}.json"),
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
        with open(os.path.join(tmp, "0.json")) as f:
            return json.load(f)["rate"]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--worker", choices=("fit", "loop"))
    parser.add_argument("--result")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.warmup, args.result)
        return
    print(_common.machine())
    print(
        f"weak scaling: {PER_WORKER_BATCH} examples per worker per step, "
        "1 CPU replica and 1 thread per worker"
    )
    for mode in ("fit", "loop"):
        rates_2, rates_1, ratios = _common.paired_ratios(
            lambda mode=mode: run_cluster(mode, 2, args.steps, args.warmup),
            lambda mode=mode: run_cluster(mode, 1, args.steps, args.warmup),
            args.pairs,
        )
        name = (
            "model.fit + MultiWorkerReplicator"
            if mode == "fit"
            else ("plain MWMS custom loop")
        )
        print(
            f"{name}: 1 worker {[round(r) for r in rates_1]} ex/s, "
            f"2 workers {[round(r) for r in rates_2]} ex/s"
        )
        print(_common.summary(f"  {name} 2-vs-1 ratio", ratios))


if __name__ == "__main__":
    main()
