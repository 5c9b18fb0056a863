"""Packed gradient all-reduce vs one all-reduce per tensor.

The gradient list is ResNet-50's: its 161 trainable tensors, 25.6M floats
(102 MB). A: the packed all-reduce `optimizer.all_reduce_mean` (gradients
packed into ~32 MiB collectives; `wrap_optimizer` itself reduces through
`gradients.wrapped_gradients`). B: one `ReplicaContext.all_reduce`
per tensor. Measured on 4 local CPU replicas, then on 2 worker processes on
loopback (1 replica each), in one run; A and B alternate and the median of
per-pair ratios A/B is reported (> 1: packing is faster).

Also measures the two ways to build `kr.broadcast` on 4 replicas (an all-sum
of the source's value and zeros, vs all_gather then index).

    python benchmarks/allreduce.py [--pairs 6] [--skip-workers]
"""

import argparse
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(__file__))

WORKER_FLAG = "--worker"


def resnet50_shapes():
    import keras

    model = keras.applications.ResNet50(weights=None)
    return [tuple(w.shape) for w in model.trainable_weights]


def make_runners(strategy, shapes, bytes_per_pack=32 * 2**20):
    """Two rates (calls/sec): packed all-reduce and one per tensor."""
    import tensorflow as tf
    from _common import timed

    import keras_replicator as kr
    from keras_replicator._src.training import optimizer as optimizer_lib

    with strategy.scope():
        grads = [tf.Variable(tf.ones(s) * 0.5) for s in shapes]

    def first_elements(reduced):
        # Depends on every result, so no collective is pruned, but moves
        # almost nothing back to the host.
        return tf.add_n([tf.reshape(r, [-1])[0] for r in reduced])

    def packed():
        return first_elements(
            optimizer_lib.all_reduce_mean(grads, bytes_per_pack=bytes_per_pack)
        )

    def per_tensor():
        return first_elements([kr.all_mean(g) for g in grads])

    def runner(fn):
        compiled = tf.function(lambda: strategy.run(fn))
        compiled()  # Trace and warm up.

        def run(calls=3):
            seconds, _ = timed(
                lambda: [
                    strategy.experimental_local_results(compiled())[0].numpy()
                    for _ in range(calls)
                ]
            )
            return calls / seconds

        return run

    return runner(packed), runner(per_tensor)


def broadcast_runners(strategy, size=1_000_000):
    import tensorflow as tf
    from _common import timed

    import keras_replicator as kr

    with strategy.scope():
        value = tf.Variable(tf.ones([size]))

    def by_sum():
        return kr.broadcast(value * 1.0, source_replica=1)[0]

    def by_gather():
        gathered = kr.all_gather(value[None] * 1.0, axis=0)
        return gathered[1][0]

    def runner(fn):
        compiled = tf.function(lambda: strategy.run(fn))
        compiled()

        def run(calls=20):
            seconds, _ = timed(
                lambda: [
                    strategy.experimental_local_results(compiled())[0].numpy()
                    for _ in range(calls)
                ]
            )
            return calls / seconds

        return run

    return runner(by_sum), runner(by_gather)


def report(title, rates_a, rates_b, ratios, name_a, name_b):
    import statistics

    from _common import summary

    print(f"## {title}")
    print(f"{name_a:32s} calls/sec median {statistics.median(rates_a):.2f}")
    print(f"{name_b:32s} calls/sec median {statistics.median(rates_b):.2f}")
    print(summary("ratio A/B", ratios))
    sys.stdout.flush()


def local(args, shapes):
    from _common import paired_ratios

    import keras_replicator as kr

    replicator = kr.LocalReplicator(4)
    packed, per_tensor = make_runners(replicator, shapes)
    report(
        "4 local replicas: ResNet-50 gradients",
        *paired_ratios(packed, per_tensor, args.pairs),
        "A packed (wrap_optimizer)",
        "B one all-reduce per tensor",
    )
    by_sum, by_gather = broadcast_runners(replicator)
    report(
        "4 local replicas: broadcast of 1M floats",
        *paired_ratios(by_sum, by_gather, args.pairs),
        "A all-sum of value-or-zeros",
        "B all_gather then index",
    )


def worker(args):
    import keras_replicator as kr

    replicator = kr.MultiWorkerReplicator()
    from _common import paired_ratios

    packed, per_tensor = make_runners(replicator, resnet50_shapes())
    rates = paired_ratios(packed, per_tensor, args.pairs)
    if replicator.is_chief:
        report(
            "2 workers x 1 replica (loopback gRPC): ResNet-50 gradients",
            *rates,
            "A packed (wrap_optimizer)",
            "B one all-reduce per tensor",
        )


def spawn_workers(args):
    from keras_replicator._src.cluster import launch

    ports = launch.free_ports(2)
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, WORKER_FLAG, "--pairs", str(args.pairs)],
            env=launch.worker_environ(ports, i, replicas_per_worker=1),
            stdout=subprocess.PIPE if i == 0 else subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for i in range(2)
    ]
    try:
        out, _ = procs[0].communicate(timeout=args.timeout)
        for p in procs[1:]:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    print(out, end="")
    if any(p.returncode for p in procs):
        raise SystemExit(f"a worker failed: {[p.returncode for p in procs]}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--skip-workers", action="store_true")
    parser.add_argument(WORKER_FLAG, action="store_true", help="internal")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    import keras_replicator as kr

    kr.configure_cpu_replicas(4)
    from _common import machine

    shapes = resnet50_shapes()
    floats = sum(int(__import__("math").prod(s)) for s in shapes)
    print(f"Machine: {machine()}")
    print(f"Gradients: {len(shapes)} tensors, {floats / 1e6:.1f}M floats")
    local(args, shapes)
    if not args.skip_workers:
        spawn_workers(args)


if __name__ == "__main__":
    main()
