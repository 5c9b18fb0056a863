"""Scaling plot: examples/sec versus replicas and workers, with the ideal line.

Weak scaling: each replica takes a fixed per-replica batch, so the global batch
grows with the replica count. Local replicas (1, 2, 4 CPU replicas in one
process) are timed in rotation, one epoch each, several rounds, and the median
of each is reported. With `--workers`, 1 and 2 worker processes (one replica
each, one thread each) are timed through `keras-replicator launch`.

Writes `benchmarks/scaling.png` (shown in the README) and prints the numbers.

    python benchmarks/scaling.py [--rounds 5] [--workers]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

PER_REPLICA_BATCH = 32
REPLICA_COUNTS = (1, 2, 4)


def _local_runners():
    import keras
    from _common import timed

    import keras_replicator as kr
    from keras_replicator._src import demo

    (x, y), _ = demo.load_digits_split()
    runners = {}
    for count in REPLICA_COUNTS:
        batch = PER_REPLICA_BATCH * count
        n = len(x) // batch * batch
        replicator = kr.LocalReplicator(count)
        with replicator.scope():
            keras.utils.set_random_seed(0)
            model = demo.build_resnet()
            model.compile(
                keras.optimizers.SGD(0.01), "sparse_categorical_crossentropy"
            )
        model.fit(x[:n], y[:n], batch_size=batch, epochs=1, verbose=0)

        def run(model=model, n=n, batch=batch):
            seconds, _ = timed(
                lambda: model.fit(
                    x[:n], y[:n], batch_size=batch, epochs=1, verbose=0
                )
            )
            return n / seconds

        runners[count] = run
    return runners


WORKER_SCRIPT = """
import json, os, time
import keras
import keras_replicator as kr
from keras_replicator._src import demo
replicator = kr.MultiWorkerReplicator()
(x, y), _ = demo.load_digits_split()
batch = {per_replica} * replicator.num_replicas_in_sync
n = len(x) // batch * batch
with replicator.scope():
    keras.utils.set_random_seed(0)
    model = demo.build_resnet()
    model.compile(keras.optimizers.SGD(0.01), "sparse_categorical_crossentropy")
model.fit(x[:n], y[:n], batch_size=batch, epochs=1, verbose=0)
rates = []
for _ in range({rounds}):
    start = time.perf_counter()
    model.fit(x[:n], y[:n], batch_size=batch, epochs=1, verbose=0)
    rates.append(n / (time.perf_counter() - start))
if replicator.is_chief:
    with open(os.environ["SCALING_OUT"], "w") as f:
        json.dump(rates, f)
"""


def _worker_rates(workers, rounds):
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "worker.py")
        out = os.path.join(tmp, "rates.json")
        with open(script, "w") as f:
            f.write(
                WORKER_SCRIPT.format(
                    per_replica=PER_REPLICA_BATCH, rounds=rounds
                )
            )
        env = dict(
            os.environ,
            SCALING_OUT=out,
            TF_NUM_INTRAOP_THREADS="1",
            TF_NUM_INTEROP_THREADS="1",
        )
        subprocess.run(
            [
                sys.executable,
                "-m",
                "keras_replicator._src.cluster.cli",
                "launch",
                "--workers",
                str(workers),
                "--",
                sys.executable,
                script,
            ],
            check=True,
            env=env,
            timeout=900,
            stdout=subprocess.DEVNULL,
        )
        with open(out) as f:
            return json.load(f)


def plot(series, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in series.items():
        xs = sorted(points)
        ys = [points[k] for k in xs]
        line = ax.plot(xs, ys, "o-", label=label)[0]
        ax.plot(
            xs,
            [ys[0] * k / xs[0] for k in xs],
            "--",
            color=line.get_color(),
            alpha=0.5,
            label=f"{label}: ideal",
        )
    ax.set_xticks(sorted({k for points in series.values() for k in points}))
    ax.set_xlabel("replicas (local) / workers")
    ax.set_ylabel("examples / sec")
    ax.set_title(
        f"Weak scaling, {PER_REPLICA_BATCH} examples per replica per step\n"
        "(2-core CPU machine: the ideal needs one core per replica)"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", action="store_true")
    parser.add_argument("--out", default=os.path.join(HERE, "scaling.png"))
    args = parser.parse_args()
    import keras_replicator as kr

    kr.configure_cpu_replicas(max(REPLICA_COUNTS))
    from _common import machine

    runners = _local_runners()
    rates = {count: [] for count in runners}
    for _ in range(args.rounds):
        for count, run in runners.items():
            rates[count].append(run())
    series = {
        "LocalReplicator (CPU replicas)": {
            k: statistics.median(v) for k, v in rates.items()
        }
    }
    if args.workers:
        series["MultiWorkerReplicator (1 replica/worker)"] = {
            w: statistics.median(_worker_rates(w, args.rounds)) for w in (1, 2)
        }
    print(machine())
    for label, points in series.items():
        base = points[min(points)]
        for k in sorted(points):
            print(
                f"{label:42s} {k}: {points[k]:8.0f} examples/sec "
                f"({points[k] / base:.2f}x)"
            )
    plot(series, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
