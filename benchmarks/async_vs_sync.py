"""Asynchronous vs synchronous training: 2 workers, the same model and batch.

- `async`: `model.fit` under `kr.AsyncReplicator` on a loopback cluster of a
  chief (the coordinator), 2 workers and 1 parameter server. Each step runs
  on one worker with a batch of 64 and updates the variables on its own.
- `sync`: `model.fit` under `kr.MultiWorkerReplicator` on 2 workers, one CPU
  replica each. Each step takes 64 examples on each worker (128 in all) and
  all-reduces the gradients.

Both count a step as one update of the variables and report updates/sec and
examples/sec over the timed steps (after a warm-up fit that compiles), so a
step of `sync` carries twice the examples of a step of `async`. Workers get
one intra-op thread each. The two modes alternate within each pair (which
goes first alternates too) and the script prints the median of the per-pair
async/sync ratios with min and max (see `_common.py`).

    python benchmarks/async_vs_sync.py [--pairs 5] [--steps 200]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common  # noqa: E402

BATCH = 64
WORKERS = 2
THREAD_ENV = {
    "OMP_NUM_THREADS": "1",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "3",
}


def train(mode, steps, warmup, result_path):
    """The chief (async) or a worker (sync): trains, writes its rate."""
    import keras

    import keras_replicator as kr

    if mode == "async":
        strategy = kr.AsyncReplicator()
        global_batch = BATCH
    else:
        strategy = kr.MultiWorkerReplicator(replicas_per_worker=1)
        global_batch = BATCH * strategy.num_workers
    dataset = _common.synthetic_images(global_batch)
    with strategy.scope():
        model = _common.small_convnet()
        model.compile(
            keras.optimizers.SGD(0.01),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    model.fit(dataset, steps_per_epoch=warmup, verbose=0)
    start = time.perf_counter()
    # Both fits return once every step ran (async: after coordinator.join).
    model.fit(dataset, steps_per_epoch=steps, verbose=0)
    seconds = time.perf_counter() - start
    with open(result_path, "w") as f:
        json.dump({"updates": steps / seconds, "batch": global_batch}, f)


def run_cluster(mode, steps, warmup):
    """Starts one cluster; returns (updates/sec, examples/sec)."""
    from keras_replicator._src.cluster import config as cluster_lib
    from keras_replicator._src.cluster import launch
    from keras_replicator._src.replicators import async_ps

    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        me = [sys.executable, __file__, "--train", mode, "--result", result]
        me += ["--steps", str(steps), "--warmup", str(warmup)]
        # Sync workers all report the same rate; only worker 0's is read.
        other = [*me[:5], result + ".other", *me[6:]]
        if mode == "async":
            ports = iter(launch.free_ports(2 + WORKERS))
            cluster = {
                "chief": [f"127.0.0.1:{next(ports)}"],
                "worker": [f"127.0.0.1:{next(ports)}" for _ in range(WORKERS)],
                "ps": [f"127.0.0.1:{next(ports)}"],
            }
            tasks = [("chief", 0, me)]
            tasks += [("worker", i, async_ps.SERVE_COMMAND) for i in (0, 1)]
            tasks += [("ps", 0, async_ps.SERVE_COMMAND)]
        else:
            hosts = [f"127.0.0.1:{p}" for p in launch.free_ports(WORKERS)]
            cluster = {"worker": hosts}
            tasks = [("worker", 0, me), ("worker", 1, other)]
        procs = []
        try:
            for job, index, argv in tasks:
                env = dict(os.environ, **THREAD_ENV)
                env["TF_CONFIG"] = cluster_lib.parse_tf_config(
                    {"cluster": cluster, "task": {"type": job, "index": index}}
                ).to_json()
                procs.append(
                    subprocess.Popen(
                        list(argv),
                        env=env,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE,
                        start_new_session=True,
                    )
                )
            # The first task trains (the chief, or sync worker 0).
            trainers = procs if mode == "sync" else procs[:1]
            for proc in trainers:
                _, err = proc.communicate(timeout=600)
                if proc.returncode:
                    raise RuntimeError(err.decode()[-3000:])
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
        with open(result) as f:
            data = json.load(f)
        return data["updates"], data["updates"] * data["batch"]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--train", choices=("async", "sync"))
    parser.add_argument("--result")
    args = parser.parse_args()
    if args.train:
        train(args.train, args.steps, args.warmup, args.result)
        return
    print(_common.machine())
    print(
        f"{WORKERS} workers, batch {BATCH} per worker step, 1 intra-op "
        f"thread per worker, {args.steps} timed steps per fit"
    )
    runs = {"async": [], "sync": []}
    for i in range(args.pairs):
        for mode in ("sync", "async") if i % 2 else ("async", "sync"):
            runs[mode].append(run_cluster(mode, args.steps, args.warmup))
    for mode, name in (("async", "async (2 workers + 1 ps)"), ("sync", "sync")):
        print(
            f"{name}: updates/sec {[round(u, 1) for u, _ in runs[mode]]}, "
            f"examples/sec {[round(e) for _, e in runs[mode]]}"
        )
    pairs = list(zip(runs["async"], runs["sync"], strict=True))
    print(
        _common.summary(
            "updates/sec async/sync", [a[0] / s[0] for a, s in pairs]
        )
    )
    print(
        _common.summary(
            "examples/sec async/sync", [a[1] / s[1] for a, s in pairs]
        )
    )


if __name__ == "__main__":
    main()
