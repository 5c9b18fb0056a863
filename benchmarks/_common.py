"""Shared pieces of the benchmarks: timing pairs and reporting ratios.

The machine is noisy (two identical epochs on CPU replicas have differed by
4x), so every benchmark alternates A and B runs and reports the median of the
per-pair ratios with their min and max.
"""

import datetime
import os
import platform
import statistics
import subprocess
import time


def cpu_model() -> str:
    """The CPU's model name (Linux), else the machine type."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    return (
        f"{platform.node()}: {cpu_model()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}"
    )


def commit() -> str:
    """`git rev-parse --short HEAD` of this checkout, or "unknown"."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=os.path.dirname(os.path.abspath(__file__)),
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def label() -> str:
    """Date, commit and machine: the line every result is labelled with."""
    return (
        f"date {datetime.date.today().isoformat()}, commit {commit()}, "
        f"machine {machine()}"
    )


def timed(fn):
    """Runs fn() and returns (seconds, result). fn must block on its results."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def paired_ratios(run_a, run_b, pairs):
    """Alternates A and B `pairs` times; returns rates and per-pair ratios.

    run_a and run_b return a rate (higher is better) and must block until
    their work is done.
    """
    rates_a, rates_b, ratios = [], [], []
    for i in range(pairs):
        # Alternate which goes first, so drift favours neither.
        if i % 2:
            b = run_b()
            a = run_a()
        else:
            a = run_a()
            b = run_b()
        rates_a.append(a)
        rates_b.append(b)
        ratios.append(a / b)
    return rates_a, rates_b, ratios


def summary(name, ratios):
    return (
        f"{name}: median {statistics.median(ratios):.3f} "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f}, "
        f"{len(ratios)} pairs)"
    )


def synthetic_images(global_batch):
    """512 random 32x32x3 images with labels, repeated, globally batched.

    DATA sharding is set explicitly, so every worker keeps its share of each
    global batch without TensorFlow's AUTO-policy warning.
    """
    import tensorflow as tf

    images = tf.random.stateless_uniform((512, 32, 32, 3), seed=(1, 2))
    labels = tf.random.stateless_uniform(
        (512,), seed=(3, 4), maxval=10, dtype=tf.int32
    )
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    return (
        tf.data.Dataset.from_tensor_slices((images, labels))
        .repeat()
        .batch(global_batch, drop_remainder=True)
        .with_options(options)
    )


def small_convnet():
    """A tiny conv net (seeded): about 9 ms a step of 64 on one thread here.

    Its steps are so short that a cross-worker all-reduce's latency (about
    2 ms on loopback gRPC here) is a large part of them.
    """
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.Conv2D(32, 3, strides=2, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    )


def cifar_convnet():
    """A CIFAR-10-style conv net (seeded): 4 convolutions, 66k weights.

    Two 32-filter and two 64-filter 3x3 convolutions with max pooling, then
    global average pooling and a 10-way dense layer: about 75 ms a step of
    64 examples on one thread here, the regime of real image models, where
    compute rather than all-reduce latency dominates a step.
    """
    import keras

    keras.utils.set_random_seed(0)
    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            layers.Conv2D(32, 3, padding="same", activation="relu"),
            layers.Conv2D(32, 3, padding="same", activation="relu"),
            layers.MaxPooling2D(),
            layers.Conv2D(64, 3, padding="same", activation="relu"),
            layers.Conv2D(64, 3, padding="same", activation="relu"),
            layers.MaxPooling2D(),
            layers.GlobalAveragePooling2D(),
            layers.Dense(10),
        ]
    )


MODELS = {"cifar": cifar_convnet, "small": small_convnet}


def rss_mb() -> tuple[float, float]:
    """This process's resident memory now and at its peak, in MB (Linux)."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return (
        int(fields["VmRSS"].split()[0]) / 1024,
        int(fields["VmHWM"].split()[0]) / 1024,
    )


def reset_peak() -> None:
    """Starts a new peak: VmHWM becomes the current RSS (Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def run_processes(command, workers, timeout=900, mpiexec=False, env=None):
    """Runs `command` in one process, or N via `keras-replicator launch`.

    Each process prints one `RESULT <json>` line; N > 1 processes get one
    device each (`--replicas-per-worker 1`). With `mpiexec`, the N
    processes are `mpiexec -n N`'s (the mpiexec beside this Python) and
    `env` (added to this environment, without its TF_CONFIG) says how many
    replicas each runs.

    Returns:
        The parsed results, one per process.
    """
    import json
    import sys

    if mpiexec:
        command = [
            os.path.join(os.path.dirname(sys.executable), "mpiexec"),
            "-n",
            str(workers),
            *command,
        ]
        env = {
            **{k: v for k, v in os.environ.items() if k != "TF_CONFIG"},
            **(env or {}),
        }
    elif workers > 1:
        launcher = os.path.join(
            os.path.dirname(sys.executable), "keras-replicator"
        )
        command = [
            launcher,
            "launch",
            "--workers",
            str(workers),
            "--replicas-per-worker",
            "1",
            "--",
            *command,
        ]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
    )
    # Each JSON after its "RESULT ": print() writes the newline apart, so
    # under mpiexec two processes' results can share a line.
    decoder = json.JSONDecoder()
    results = [
        decoder.raw_decode(part)[0] for part in done.stdout.split("RESULT ")[1:]
    ]
    if done.returncode or len(results) != workers:
        raise RuntimeError(
            f"{workers} process(es) failed (exit {done.returncode}):\n"
            + done.stdout[-3000:]
            + done.stderr[-3000:]
        )
    return results


def sharded_mlp(width, layers, processes):
    """`layers` x Dense(`width`), seeded; every kernel `(None, "model")`.

    With several processes, `ModelParallel` on a (1, N) mesh over all of
    their devices is set first. Not compiled.
    """
    import keras

    if processes > 1:
        devices = keras.distribution.list_devices()
        mesh = keras.distribution.DeviceMesh(
            (1, len(devices)), ("batch", "model"), devices
        )
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*kernel"] = (None, "model")
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(
                layout_map=layout_map, batch_dim_name="batch"
            )
        )
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, name=f"d{i}") for i in range(layers)]
    )


def relu_mlp(width, optimizer="adam"):
    """The 16.8M MLP of the speed benchmarks, compiled: seeded, Adam, mse.

    4 x Dense(`width`) on `width` inputs, ReLU between (not after the
    last), Adam(1e-3): `vs_jax.py`, `model_parallel_processes.py`,
    `transport.py` and `profile_step.py` time the same model. Built under
    whatever distribution or scope is current. `optimizer="sgd"`:
    SGD(0.05) instead, whose steps are proportional to the gradients (Adam
    turns a last-bit difference in a near-zero gradient into a whole step).
    """
    import keras

    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((width,))]
        + [
            keras.layers.Dense(
                width, activation="relu" if i < 3 else None, name=f"d{i}"
            )
            for i in range(4)
        ]
    )
    if optimizer == "sgd":
        model.compile(keras.optimizers.SGD(0.05), "mse")
    else:
        model.compile(keras.optimizers.Adam(1e-3), "mse")
    return model
