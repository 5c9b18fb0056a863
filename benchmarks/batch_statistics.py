"""The cost of one device's batch statistics (the default) in `fit`.

Under the replicators' `fit`, `BatchNormalization` normalizes over the
global batch by default (one all-reduce per layer and step,
`patches/batch_statistics.py`); `sync_batch_norm=False` keeps each
replica's own statistics, as stock tf.distribute. This times both, side by
side, on two models with plain `keras.layers.BatchNormalization`:

- the demo's ResNet (`keras-replicator demo`'s 5 BN layers, in float32),
  digits-sized 8x8 inputs, global batch 64;
- keras.io's "Image classification from scratch" convnet at the tests'
  size (tests/keras_io_convnet.py: 8 BN layers), 32x32x3, global batch 16;

in one process (`LocalReplicator(2)`, the two runs alternating epochs)
and over 2 processes of one replica each, over gRPC (`keras-replicator
launch`) and over MPI (`mpiexec`): each launch times one setting, and the
launches alternate (default then off), `--pairs` times. It prints each
setting's median seconds per step and the median of the per-pair ratios
default / off, with min and max.

    python benchmarks/batch_statistics.py [--pairs 3] [--parts local grpc mpi]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

MODELS = ("demo_resnet", "keras_io_convnet")
EPOCHS = 4  # The first traces; the others are timed.


def _data(name):
    import numpy as np

    rng = np.random.default_rng(0)
    if name == "demo_resnet":
        x = rng.uniform(size=(64 * 16, 8, 8, 1)).astype("float32")
        return x, rng.integers(0, 10, len(x)), 64
    x = rng.uniform(0, 255, size=(16 * 16, 32, 32, 3)).astype("float32")
    return x, rng.integers(0, 2, len(x)).astype("float32"), 16


def _build(name):
    import keras

    if name == "demo_resnet":
        from keras_replicator._src.cli import demo

        # The demo's topology with plain Keras layers (the demo itself uses
        # CrossReplicaBatchNormalization, global under every setting).
        saved = demo.CrossReplicaBatchNormalization
        demo.CrossReplicaBatchNormalization = keras.layers.BatchNormalization
        try:
            model = demo.build_resnet()
        finally:
            demo.CrossReplicaBatchNormalization = saved
        model.compile(
            keras.optimizers.Adam(3e-3), "sparse_categorical_crossentropy"
        )
        return model
    from tests import keras_io_convnet

    model = keras_io_convnet.make_model((32, 32, 3), 2, dropout=0.0)
    keras_io_convnet.compile_model(model)
    return model


class _EpochTimes:
    def __init__(self):
        import keras

        class Callback(keras.callbacks.Callback):
            def on_epoch_begin(cb, epoch, logs=None):
                cb.start = time.perf_counter()

            def on_epoch_end(cb, epoch, logs=None):
                self.seconds.append(time.perf_counter() - cb.start)

        self.seconds = []
        self.callback = Callback()


def _step_seconds(replicator, name, epochs=EPOCHS):
    """Median seconds per step of `epochs - 1` timed epochs of `fit`."""
    import keras

    keras.utils.set_random_seed(0)
    x, y, batch = _data(name)
    with replicator.scope():
        model = _build(name)
    times = _EpochTimes()
    model.fit(
        x,
        y,
        batch_size=batch,
        epochs=epochs,
        verbose=0,
        shuffle=False,
        callbacks=[times.callback],
    )
    return statistics.median(times.seconds[1:]) / (len(x) // batch)


def _local(pairs):
    import keras_replicator as kr

    kr.configure_cpu_replicas(2)
    out = {}
    for name in MODELS:
        default, off, ratios = [], [], []
        for _ in range(pairs):
            a = _step_seconds(kr.LocalReplicator(2), name)
            b = _step_seconds(
                kr.LocalReplicator(2, sync_batch_norm=False), name
            )
            default.append(a)
            off.append(b)
            ratios.append(a / b)
        out[name] = (default, off, ratios)
    return out


def _worker(setting):
    import keras_replicator as kr

    replicator = kr.MultiWorkerReplicator(sync_batch_norm=setting == "default")
    result = {name: _step_seconds(replicator, name) for name in MODELS}
    if replicator.is_chief:
        print("RESULT " + json.dumps(result), flush=True)


def _launch(transport, setting):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CONFIG",) and not k.startswith("PMI_")
    }
    env["PYTHONPATH"] = ROOT
    env["KERAS_REPLICATOR_CPU_REPLICAS"] = "1"
    script = [sys.executable, os.path.abspath(__file__), "--worker", setting]
    bindir = os.path.dirname(sys.executable)
    if transport == "mpi":
        argv = [os.path.join(bindir, "mpiexec"), "-n", "2", *script]
    else:
        argv = [
            os.path.join(bindir, "keras-replicator"),
            "launch",
            "--workers",
            "2",
            "--replicas-per-worker",
            "1",
            "--",
            *script,
        ]
    with tempfile.TemporaryDirectory() as cwd:
        proc = subprocess.run(
            argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=900
        )
    for line in proc.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])


def _processes(transport, pairs):
    runs = {name: ([], [], []) for name in MODELS}
    for _ in range(pairs):
        a = _launch(transport, "default")
        b = _launch(transport, "off")
        for name in MODELS:
            runs[name][0].append(a[name])
            runs[name][1].append(b[name])
            runs[name][2].append(a[name] / b[name])
    return runs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--parts", nargs="+", default=["local", "grpc", "mpi"])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args.worker)
    from _common import label

    print(label())
    print(
        f"fit, {EPOCHS - 1} timed epochs per run, {args.pairs} alternating "
        "pairs; s/step medians; ratio = default (global statistics) / "
        "sync_batch_norm=False (per replica), median of per-pair ratios "
        "(min, max)"
    )
    for part in args.parts:
        where = {
            "local": "one process, LocalReplicator(2)",
            "grpc": "2 processes x 1 replica, gRPC (launch)",
            "mpi": "2 processes x 1 replica, MPI (mpiexec)",
        }[part]
        runs = (
            _local(args.pairs)
            if part == "local"
            else _processes(part, args.pairs)
        )
        for name, (default, off, ratios) in runs.items():
            print(
                f"{where:42s} {name:17s} default "
                f"{statistics.median(default):.4f}"
                f"  off {statistics.median(off):.4f}  ratio "
                f"{statistics.median(ratios):.3f} ({min(ratios):.3f}, "
                f"{max(ratios):.3f})",
                flush=True,
            )


if __name__ == "__main__":
    main()
