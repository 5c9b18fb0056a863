"""Per-process memory under ModelParallel, one device per process.

An MLP of `--layers` Dense(`--width`) layers on `--width` inputs (6 x 4096:
100.7M parameters), Adam, every kernel laid out `(None, "model")` on a
(1, N) mesh, trained `--steps` steps at global batch 16. N = 1 is one
device in one process (no distribution); N > 1 is
`keras-replicator launch --workers N --replicas-per-worker 1`, so each
process is one device and its peak RSS is one device's footprint.

Each process reports its RSS above the import (after
`keras.distribution.initialize()`, and for a keras-hub model after
`import keras_hub`, which costs 144 MB on every process at any N; the
report also gives each ratio with that import counted in the stage, as
before 2026-11-28), current and peak, at each stage:
after building the model, after building the optimizer's slots, and after
`fit`. Peaks are per stage (`/proc/self/clear_refs`). The script prints
every process's numbers, each stage's median over the processes against
one device, and the ideal `4 bytes x parameters x (1 weight + 2 Adam
slots + 1 gradient) / N` for `fit`.

    python benchmarks/capacity.py [--workers 1,4] [--width 4096] [--layers 6]

With `--model gemma`: a keras-hub `GemmaCausalLM` of 100.9M parameters
(vocabulary 33000, 4 layers, hidden 1024, 8 heads of 128, MLP 8192),
built from a config and saved with `save_to_preset` into a temporary
directory by a process of its own (no download); each run then loads it
with `GemmaCausalLM.from_preset(directory)` under Gemma's own layout map
(`GemmaBackbone.get_layout_map`) on a (1, N) mesh, and trains one step.
Stages: after `from_preset` (`load`), after the step (`fit`). Whether the
loaded weights equal the preset's (a checksum per variable, reported by
process 0, against one device) is a second run of each N, which loads and
reads every whole value: reads a training script does not make, whose
memory would otherwise count in `fit`.

With `--model mistral` or `--model gemma3` and `--auto`: the same for a
keras-hub model that ships no layout map, a `MistralCausalLM` of 107.5M
parameters (vocabulary 32000, untied logits, 4 layers, hidden 1024, 8
heads, MLP 2048) or a `Gemma3CausalLM` of 100.9M (vocabulary 33000, 4
layers, hidden 1024, 8 heads of 128, MLP 4096), laid out by
`kr.auto_layout_map(mesh)` (`--auto` with `--model gemma` replaces
Gemma's own map by it too).

`--hub-config key=value,...` overrides the keras-hub config (integers),
for example issue 59's Gemma of 117.5M parameters: `--model gemma
--hub-config vocabulary_size=32768,num_layers=8,intermediate_dim=4096`.
`--transport mpi` runs the N > 1 processes under `mpiexec -n N` (the one
beside this Python) with `KERAS_REPLICATOR_TRANSPORT=mpi`, one device each;
the default is `grpc` (`keras-replicator launch`).

Last stage: `save` (every process calls `save_weights` with one path; the
chief gathers and writes one variable at a time, the others join the
gathers).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(__file__))

from _common import label  # noqa: E402
from _common import reset_peak  # noqa: E402
from _common import rss_mb  # noqa: E402
from _common import run_processes  # noqa: E402
from _common import sharded_mlp  # noqa: E402

STAGES = {
    "mlp": ("build", "slots", "fit", "save"),
    "gemma": ("load", "fit", "save"),
    "mistral": ("load", "fit", "save"),
    "gemma3": ("load", "fit", "save"),
}
HUB = ("gemma", "mistral", "gemma3")
GEMMA = dict(
    vocabulary_size=33000,
    num_layers=4,
    num_query_heads=8,
    num_key_value_heads=8,
    hidden_dim=1024,
    intermediate_dim=8192,
    head_dim=128,
    dtype="float32",
)
MISTRAL = dict(
    vocabulary_size=32000,
    num_layers=4,
    num_query_heads=8,
    num_key_value_heads=8,
    hidden_dim=1024,
    intermediate_dim=2048,
    dtype="float32",
)
GEMMA3 = dict(
    vocabulary_size=33000,
    image_size=16,
    num_layers=4,
    num_query_heads=8,
    num_key_value_heads=8,
    hidden_dim=1024,
    intermediate_dim=4096,
    head_dim=128,
    dtype="float32",
)


def _hub_classes(name):
    """(backbone class, causal LM class, config) of a keras-hub model."""
    import keras_hub

    models = keras_hub.models
    return {
        "gemma": (models.GemmaBackbone, models.GemmaCausalLM, GEMMA),
        "mistral": (models.MistralBackbone, models.MistralCausalLM, MISTRAL),
        "gemma3": (models.Gemma3Backbone, models.Gemma3CausalLM, GEMMA3),
    }[name]


def _worker(args):
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_replicator  # noqa: F401 - keras.distribution on TF

    if args.workers > 1:
        keras.distribution.initialize()
    out = {}
    if args.model in HUB:
        # keras-hub's import is an import too (144 MB here, the same at
        # any N): the baseline holds it. Before 2026-11-28 it counted in
        # `load`; the report still gives that figure, from `hub_import`.
        before, _ = rss_mb()
        _hub_classes(args.model)
        out["hub_import"] = round(rss_mb()[0] - before)
    base, _ = rss_mb()
    reset_peak()

    def stage(name):
        now, peak = rss_mb()
        out[name] = [round(now - base), round(peak - base)]
        reset_peak()
        if args.tensors:
            info = tf.config.experimental.get_memory_info("CPU:0")
            out[name + " tensors"] = [info["current"] >> 20, info["peak"] >> 20]
            tf.config.experimental.reset_memory_stats("CPU:0")

    if args.model in HUB:
        _hub(args, stage, out)
        return
    model = sharded_mlp(args.width, args.layers, args.workers)
    stage("build")
    model.compile(keras.optimizers.Adam(1e-4), "mse")
    model.optimizer.build(model.trainable_variables)
    stage("slots")
    x = (
        np.random.default_rng(0)
        .normal(size=(16 * args.steps, args.width))
        .astype("float32")
    )
    data = tf.data.Dataset.from_tensor_slices((x, x)).batch(16)
    model.fit(data, epochs=1, verbose=0)
    stage("fit")
    _save(model, args, stage)
    out["parameters"] = model.count_params()
    print("RESULT " + json.dumps(out), flush=True)


def _hub(args, stage, out):
    """Loads the preset under its layout map (or the automatic one)."""
    import keras
    import numpy as np

    import keras_replicator as kr

    backbone_class, lm_class, _ = _hub_classes(args.model)
    if args.workers > 1:
        devices = keras.distribution.list_devices()
        mesh = keras.distribution.DeviceMesh(
            (1, len(devices)), ("batch", "model"), devices
        )
        if args.auto:
            layout_map = kr.auto_layout_map(mesh)
        else:
            layout_map = backbone_class.get_layout_map(mesh)
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(
                layout_map=layout_map, batch_dim_name="batch"
            )
        )
    model = lm_class.from_preset(args.preset, preprocessor=None)
    stage("load")
    if args.verify:
        # A run of its own: every process reads every whole value (a
        # collective under ModelParallel), which a script that trains does
        # not, and the memory it leaves would count in `fit`.
        out["checksums"] = [
            float(np.asarray(w.numpy(), "float64").sum()) for w in model.weights
        ]
        print("RESULT " + json.dumps(out), flush=True)
        return
    model.compile(
        keras.optimizers.Adam(1e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    tokens = np.random.default_rng(0).integers(1, 1000, size=(4, 17))
    x = {
        "token_ids": tokens[:, :-1].astype("int32"),
        "padding_mask": np.ones((4, 16), "bool"),
    }
    import tensorflow as tf

    data = tf.data.Dataset.from_tensors((x, tokens[:, 1:]))
    history = model.fit(data, epochs=1, verbose=0)
    stage("fit")
    _save(model, args, stage)
    out["loss"] = history.history["loss"][-1]
    out["parameters"] = model.count_params()
    print("RESULT " + json.dumps(out), flush=True)


def _save(model, args, stage):
    """Every process saves to one path; the chief writes, value by value."""
    model.save_weights(os.path.join(args.save_dir, "model.weights.h5"))
    stage("save")


def _save_preset(directory, name, overrides):
    """Process of its own: a model from its config, saved as a preset."""
    import keras

    backbone_class, lm_class, config = _hub_classes(name)
    keras.utils.set_random_seed(0)
    backbone = backbone_class(**{**config, **overrides})
    model = lm_class(backbone=backbone, preprocessor=None)
    model.save_to_preset(directory)


def _run(args, workers, verify=False):
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        "--workers",
        str(workers),
        "--width",
        str(args.width),
        "--layers",
        str(args.layers),
        "--steps",
        str(args.steps),
        "--model",
        args.model,
        "--preset",
        str(args.preset),
        *(["--verify"] if verify else []),
        *(["--auto"] if args.auto else []),
        *(["--tensors"] if args.tensors else []),
        "--save-dir",
        str(args.save_dir),
    ]
    if args.transport == "mpi" and workers > 1:
        env = {
            "KERAS_REPLICATOR_TRANSPORT": "mpi",
            "KERAS_REPLICATOR_CPU_REPLICAS": "1",
        }
        return run_processes(command, workers, mpiexec=True, env=env)
    return run_processes(command, workers)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--workers", default="1,4")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--model", choices=tuple(STAGES), default="mlp")
    parser.add_argument(
        "--auto",
        action="store_true",
        help="lay a keras-hub model out with kr.auto_layout_map (mistral "
        "and gemma3 have no map of their own)",
    )
    parser.add_argument("--preset", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--verify", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--save-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--tensors",
        action="store_true",
        help="also report TensorFlow's own tensor bytes per stage (its BFC "
        "allocator, TF_CPU_ALLOCATOR_USE_BFC=true, in every process)",
    )
    parser.add_argument("--save-preset", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--hub-config",
        default="",
        help="key=value,... integers overriding the keras-hub model's config",
    )
    parser.add_argument("--transport", choices=("grpc", "mpi"), default="grpc")
    args = parser.parse_args()
    try:
        overrides = {
            key: int(value)
            for key, value in (
                item.split("=") for item in args.hub_config.split(",") if item
            )
        }
    except ValueError:
        parser.error(
            "--hub-config takes key=value pairs of integers, comma-separated. "
            f"Received: --hub-config {args.hub_config}"
        )
    if args.model in ("mistral", "gemma3") and not args.auto:
        parser.error(
            f"keras-hub's {args.model} has no layout map: pass --auto. "
            f"Received: --model {args.model}"
        )
    if args.save_preset:
        _save_preset(args.save_preset, args.model, overrides)
        return
    if args.tensors:
        # Read by TensorFlow when it starts, in every process.
        os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    if args.worker:
        args.workers = int(args.workers)
        _worker(args)
        return
    counts = [int(n) for n in args.workers.split(",")]
    print(label())
    with tempfile.TemporaryDirectory(prefix="kr_capacity_") as tmp:
        args.save_dir = tmp
        if args.model in HUB:
            args.preset = os.path.join(tmp, args.model)
            subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--save-preset",
                    args.preset,
                    "--model",
                    args.model,
                    "--hub-config",
                    args.hub_config,
                    *(["--auto"] if args.auto else []),
                ],
                check=True,
                timeout=900,
            )
        runs = {n: _run(args, n) for n in counts}
        if args.model in HUB:
            for n in counts:
                runs[n][0]["checksums"] = _run(args, n, verify=True)[0][
                    "checksums"
                ]
    stages = STAGES[args.model]
    one = runs.get(1)
    parameters = runs[counts[0]][0]["parameters"]
    print(f"parameters: {parameters / 1e6:.1f}M")
    for n, results in runs.items():
        for i, r in enumerate(results):
            print(
                f"N={n} process {i}: "
                + ", ".join(f"{s} {r[s][0]}/{r[s][1]} MB" for s in stages)
                + " (now/peak above the import)"
                + (
                    f"; keras-hub's import {r['hub_import']} MB"
                    if "hub_import" in r
                    else ""
                )
            )
            if args.tensors:
                print(
                    f"N={n} process {i} tensors: "
                    + ", ".join(
                        f"{s} {r[s + ' tensors'][0]}/{r[s + ' tensors'][1]} MB"
                        for s in stages
                    )
                    + " (now/peak, TensorFlow's allocator)"
                )
        if one is None or n == 1:
            continue
        if "checksums" in results[0]:
            same = results[0]["checksums"] == one[0]["checksums"]
            print(
                f"N={n} loaded weights equal one device's: {same}; loss "
                f"{results[0]['loss']:.6f} (one device "
                f"{one[0]['loss']:.6f})"
            )
        for s in stages:
            peak = statistics.median(r[s][1] for r in results)
            ratio = [r[s][1] / one[0][s][1] for r in results]
            line = (
                f"N={n} {s}: peak median {peak:.0f} MB = "
                f"{statistics.median(ratio):.2f} of one device "
                f"(min {min(ratio):.2f}, max {max(ratio):.2f})"
            )
            if "hub_import" in one[0]:
                # The same, with keras-hub's import counted in the stage.
                old = [
                    (r[s][1] + r["hub_import"])
                    / (one[0][s][1] + one[0]["hub_import"])
                    for r in results
                ]
                line += (
                    f"; with keras-hub's import in it: "
                    f"{statistics.median(old):.2f}"
                )
            print(line)
        if args.model in HUB:
            continue
        ideal = 4 * parameters * 4 / n / 2**20
        print(
            f"N={n} fit ideal: 4 B x {parameters / 1e6:.1f}M x (weight + 2 "
            f"slots + gradient) / {n} = {ideal:.0f} MB, plus transients"
        )


if __name__ == "__main__":
    main()
