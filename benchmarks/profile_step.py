"""Where a training step's time goes: TensorFlow's profiler, per op type.

The step of `vs_jax.py` (an MLP of four Dense(2048), Adam, global batch 64,
on 4 CPU devices of one process), one case per run: `one_device`,
`data_parallel` or `model_parallel` (a 1x4 mesh); or its keras-hub Gemma,
`gemma_one_device` or `gemma_model_parallel` (Gemma's own layout map).
After two warm-up epochs (tracing), one epoch of `--steps` steps runs under
`tf.profiler.experimental` (the host tracer: every op the executor runs,
and the collective executor's threads); the XSpace it writes is read back
and summed:

- the wall time per step, and how much of it the executor's compute
  threads spent in ops (`ExecutorState::Process`: dispatch included);
- per op type, its count per step and its summed time per step on the
  compute threads and on the collective threads. A collective's time is
  from its start to its end: waiting for the slowest device is part of it.

Durations on the collective threads overlap (one thread per pending
collective), so they add up to more than the wall time.

    python benchmarks/profile_step.py [--case model_parallel] [--steps 10]
"""

import argparse
import collections
import glob
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

import vs_jax  # noqa: E402
from _common import label  # noqa: E402
from _common import relu_mlp  # noqa: E402


def _profile(case, steps, folder):
    import keras_replicator as kr

    kr.configure_cpu_replicas(vs_jax.DEVICES)
    import keras
    import numpy as np
    import tensorflow as tf

    if case.startswith("gemma"):
        model, x, y, batch = vs_jax._gemma(
            argparse.Namespace(case=case, steps=steps, jit=False)
        )
    else:
        if case != "one_device":
            keras.distribution.set_distribution(vs_jax._distribution(case))
        rng = np.random.default_rng(0)
        batch = vs_jax.GLOBAL_BATCH
        x = rng.normal(size=(batch * steps, vs_jax.WIDTH)).astype("float32")
        y = rng.normal(size=(batch * steps, vs_jax.WIDTH)).astype("float32")
        model = relu_mlp(vs_jax.WIDTH)
    fit = dict(batch_size=batch, shuffle=False, verbose=0)
    model.fit(x, y, epochs=2, **fit)
    tf.profiler.experimental.start(folder)
    start = time.perf_counter()
    model.fit(x, y, epochs=1, **fit)
    seconds = time.perf_counter() - start
    tf.profiler.experimental.stop()
    return seconds / steps


def _summary(folder, steps):
    """Per (thread kind, op type): [count, picoseconds], and compute busy."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    (path,) = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    (host,) = [p for p in space.planes if p.name == "/host:CPU"]
    names = host.event_metadata
    ops = collections.defaultdict(lambda: [0, 0])
    busy = collections.Counter()
    for line in host.lines:
        kind = line.name.split("/")[0]
        if kind not in ("tf_Compute", "collective_ops"):
            continue
        for event in line.events:
            name = names[event.metadata_id].name
            if name == "ExecutorState::Process":
                busy[line.name] += event.duration_ps
            if ":" not in name:
                continue
            entry = ops[(kind, name.rsplit(":", 1)[1])]
            entry[0] += 1
            entry[1] += event.duration_ps
    return ops, busy


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--case",
        choices=vs_jax.CASES,
        default="model_parallel",
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kr_profile_") as folder:
        seconds = _profile(args.case, args.steps, folder)
        ops, busy = _summary(folder, args.steps)
    ms = 1e3 / args.steps / 1e12
    print(label())
    print(f"case {args.case}: {seconds * 1e3:.1f} ms per step (profiled)")
    for thread, ps in sorted(busy.items()):
        print(f"  compute thread {thread}: {ps * ms:.1f} ms in ops per step")
    print(f"{'ms/step':>9} {'count/step':>10}  thread kind / op type")
    ranked = sorted(ops.items(), key=lambda kv: -kv[1][1])[: args.top]
    for (kind, op), (count, ps) in ranked:
        print(f"{ps * ms:9.1f} {count / args.steps:10.1f}  {kind} / {op}")
    total = sum(count for count, _ in ops.values()) / args.steps
    print(f"ops run per step: {total:.0f}")


if __name__ == "__main__":
    main()
