"""One Keras script, side by side: this project (TensorFlow) and Keras on JAX.

The model: an MLP of four Dense(2048) layers on 2048 inputs (16.8M
parameters), Adam, global batch 64, on 4 CPU devices of one process
(`kr.configure_cpu_replicas(4)` here, `XLA_FLAGS=
--xla_force_host_platform_device_count=4` on JAX). Cases:

- `one_device`: no distribution;
- `data_parallel`: `keras.distribution.DataParallel` on the 4 devices;
- `model_parallel`: `keras.distribution.ModelParallel` on a 1x4 mesh,
  every kernel laid out `(None, "model")`;
- `gemma_one_device`, `gemma_data_parallel` and `gemma_model_parallel`:
  keras-hub's `GemmaCausalLM` built from a small config (`GEMMA`: 2
  layers, hidden 256, 4 heads of 64, MLP 1024, vocabulary 8192; 3.4M
  parameters, no download), Adam, a batch of 8 sequences of 32 tokens, on
  one device, under `DataParallel` on the 4 devices (what running a
  replica's whole step on each device costs, for reference) and under
  `ModelParallel` with Gemma's own `get_layout_map` on a 1x4 mesh.
  They need keras-hub in both environments, and are skipped (saying so)
  where it is missing.

Each (case, backend) runs in its own process, the same script under
`KERAS_BACKEND=tensorflow` and `KERAS_BACKEND=jax`; the backends alternate
(which goes first swaps every round), `--rounds` times. Prints each one's
median seconds per step (the first step, which traces and compiles, is not
timed), and a second `fit`'s wall time over its steps (its epoch's start
and end included, as a user sees it), then per round ours / JAX per case,
for both, and ModelParallel / one device per backend: the median of the
rounds' ratios, with min and max.

JAX comes with the `bench` extra (`pip install "keras-replicator[bench]"`),
or from another environment with Keras and JAX (`--jax-python`). Where it
is missing, the benchmark says so and runs our side alone.

`--jit` compiles our side with `jit_compile=True` (under `ModelParallel`,
each device's share of the step; Keras' default is used otherwise).

    python benchmarks/vs_jax.py [--rounds 3] [--steps 16] [--jax-python PY]
        [--cases ...] [--jit]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))

from _common import label  # noqa: E402
from _common import summary  # noqa: E402

CASES = (
    "one_device",
    "data_parallel",
    "model_parallel",
    "gemma_one_device",
    "gemma_data_parallel",
    "gemma_model_parallel",
)
GEMMA = dict(
    vocabulary_size=8192,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=4,
    hidden_dim=256,
    intermediate_dim=1024,
    head_dim=64,
)
GEMMA_BATCH, GEMMA_LENGTH = 8, 32
BACKENDS = ("tensorflow", "jax")
WIDTH = 2048
GLOBAL_BATCH = 64
DEVICES = 4


def _worker(args):
    """One case on one backend in this process; prints a JSON line."""
    import time

    if args.backend == "tensorflow":
        import keras_replicator as kr

        kr.configure_cpu_replicas(DEVICES)
    import keras
    import numpy as np

    if args.case.startswith("gemma"):
        model, x, y, batch = _gemma(args)
    else:
        if args.case != "one_device":
            keras.distribution.set_distribution(_distribution(args.case))
        rng = np.random.default_rng(0)
        rows = GLOBAL_BATCH * args.steps
        x = rng.normal(size=(rows, WIDTH)).astype("float32")
        y = rng.normal(size=(rows, WIDTH)).astype("float32")
        batch = GLOBAL_BATCH
        keras.utils.set_random_seed(1)
        model = keras.Sequential(
            [
                keras.Input((WIDTH,)),
                *(
                    keras.layers.Dense(
                        WIDTH,
                        activation="relu" if i < 3 else None,
                        name=f"d{i}",
                    )
                    for i in range(4)
                ),
            ]
        )
        model.compile(
            keras.optimizers.Adam(1e-3), "mse", jit_compile=_jit(args)
        )
    ends = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            # Reading the loss waits for the step: JAX dispatches ahead.
            float(logs["loss"])
            ends.append(time.perf_counter())

    def fit():
        model.fit(
            x,
            y,
            batch_size=batch,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[Clock()],
        )

    fit()
    # The median of the intervals between step ends.
    seconds = statistics.median(
        b - a for a, b in zip(ends[:-1], ends[1:], strict=True)
    )
    # As a user sees it: a second fit's wall time (traced by the first),
    # its epoch's start and end included, over its steps.
    start = time.perf_counter()
    fit()
    fit_seconds = (time.perf_counter() - start) / args.steps
    print(
        json.dumps(
            {"seconds_per_step": seconds, "fit_seconds_per_step": fit_seconds}
        )
    )


def _gemma(args):
    """keras-hub's Gemma from `GEMMA`, on one device or under its own map."""
    import keras
    import keras_hub
    import numpy as np

    if args.case == "gemma_data_parallel":
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(
                devices=keras.distribution.list_devices()[:DEVICES]
            )
        )
    if args.case == "gemma_model_parallel":
        devices = keras.distribution.list_devices()[:DEVICES]
        mesh = keras.distribution.DeviceMesh(
            (1, DEVICES), ("batch", "model"), devices
        )
        layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(
                layout_map=layout_map, batch_dim_name="batch"
            )
        )
    keras.utils.set_random_seed(1)
    backbone = keras_hub.models.GemmaBackbone(**GEMMA, dtype="float32")
    model = keras_hub.models.GemmaCausalLM(backbone, preprocessor=None)
    model.compile(
        keras.optimizers.Adam(1e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=_jit(args),
    )
    rows = GEMMA_BATCH * args.steps
    tokens = np.random.default_rng(0).integers(
        1, GEMMA["vocabulary_size"], size=(rows, GEMMA_LENGTH + 1)
    )
    x = {
        "token_ids": tokens[:, :-1].astype("int32"),
        "padding_mask": np.ones((rows, GEMMA_LENGTH), "bool"),
    }
    return model, x, tokens[:, 1:].astype("int32"), GEMMA_BATCH


def _jit(args):
    """Keras' default, or `--jit`: XLA for our side too (JAX always is)."""
    return True if args.jit else "auto"


def _distribution(case):
    import keras

    devices = keras.distribution.list_devices()[:DEVICES]
    if case == "data_parallel":
        return keras.distribution.DataParallel(devices=devices)
    mesh = keras.distribution.DeviceMesh(
        (1, DEVICES), ("batch", "model"), devices
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    # Sequential paths: "sequential/d0/kernel".
    layout_map[r".*/d\d/kernel"] = (None, "model")
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )


def _environment(backend):
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    if backend == "jax":
        env["XLA_FLAGS"] = " ".join(
            [
                env.get("XLA_FLAGS", ""),
                f"--xla_force_host_platform_device_count={DEVICES}",
            ]
        ).strip()
        env["JAX_PLATFORMS"] = "cpu"
    return env


def _run(python, backend, case, steps, jit=False):
    command = [
        python,
        os.path.abspath(__file__),
        "--worker",
        f"--backend={backend}",
        f"--case={case}",
        f"--steps={steps}",
        *(["--jit"] if jit else []),
    ]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env=_environment(backend),
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"{backend} {case} failed (exit {result.returncode}):\n"
            f"{result.stderr[-4000:]}"
        )
    return json.loads(result.stdout.strip().splitlines()[-1])


def _jax_missing(python):
    """Why `python` cannot run Keras on JAX, or None if it can."""
    try:
        probe = subprocess.run(
            [python, "-c", "import jax, keras; print(jax.__version__)"],
            capture_output=True,
            text=True,
            env=_environment("jax"),
            check=False,
        )
    except OSError as error:
        return f"--jax-python {python!r}: {error.strerror}"
    if probe.returncode == 0:
        return None
    lines = probe.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit {probe.returncode}"


def _hub_missing(python, backend):
    try:
        probe = subprocess.run(
            [python, "-c", "import keras_hub"],
            capture_output=True,
            env=_environment(backend),
            check=False,
        )
    except OSError:  # No such Python: `_jax_missing` says so.
        return True
    return probe.returncode != 0


def _versions(python, backend):
    module = "tensorflow" if backend == "tensorflow" else "jax"
    code = (
        f"import keras, {module}; "
        f"print(keras.__version__, {module}.__version__)"
    )
    out = subprocess.run(
        [python, "-c", code],
        capture_output=True,
        text=True,
        env=_environment(backend),
        check=True,
    )
    keras_version, version = out.stdout.split()
    return f"Keras {keras_version}, {module} {version}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument(
        "--jax-python",
        default=sys.executable,
        help="A Python with Keras and jax[cpu] (default: this one).",
    )
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--backend", choices=BACKENDS)
    parser.add_argument("--case", choices=CASES)
    parser.add_argument(
        "--jit",
        action="store_true",
        help="compile our side with jit_compile=True (under ModelParallel: "
        "each device's share)",
    )
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    cases = args.cases.split(",")
    missing = _jax_missing(args.jax_python)
    # keras-hub on JAX is asked for only where JAX is there: without JAX
    # our side runs alone, Gemma's included.
    hub_missing = [
        python
        for python, backend in (
            (sys.executable, "tensorflow"),
            *([] if missing else [(args.jax_python, "jax")]),
        )
        if _hub_missing(python, backend)
    ]
    if hub_missing and any(c.startswith("gemma") for c in cases):
        print(
            f"keras-hub is missing in {', '.join(hub_missing)}: the Gemma "
            "cases are skipped (pip install keras-hub)."
        )
        cases = [c for c in cases if not c.startswith("gemma")]
        if not cases:
            return None
    pythons = {"tensorflow": sys.executable, "jax": args.jax_python}
    backends = list(BACKENDS)
    print(label())
    print(f"ours: {_versions(sys.executable, 'tensorflow')}")
    if missing:
        print(
            f"JAX is missing ({missing}): install the `bench` extra "
            '(pip install "keras-replicator[bench]") or pass --jax-python. '
            "Running our side alone."
        )
        backends.remove("jax")
    else:
        print(f"anchor: {_versions(args.jax_python, 'jax')}")
    models = []
    if any(not c.startswith("gemma") for c in cases):
        models.append(
            f"MLP 4 x Dense({WIDTH}), Adam, global batch {GLOBAL_BATCH}"
        )
    if any(c.startswith("gemma") for c in cases):
        models.append(
            f"Gemma ({GEMMA['num_layers']} layers, hidden "
            f"{GEMMA['hidden_dim']}), Adam, batches of {GEMMA_BATCH} x "
            f"{GEMMA_LENGTH} tokens"
        )
    print(
        "; ".join(models) + f"; {DEVICES} CPU devices, {args.steps} steps, "
        f"median of {args.rounds} alternating rounds (s/step)"
        + ("; ours with jit_compile=True" if args.jit else "")
    )
    times = {(b, c): [] for b in backends for c in cases}
    fits = {(b, c): [] for b in backends for c in cases}
    for i in range(args.rounds):
        # Swap which backend goes first, so drift favours neither.
        order = backends if i % 2 == 0 else backends[::-1]
        for case in cases:
            for backend in order:
                result = _run(
                    pythons[backend], backend, case, args.steps, args.jit
                )
                times[backend, case].append(result["seconds_per_step"])
                fits[backend, case].append(result["fit_seconds_per_step"])
                print(
                    f"  round {i + 1} {case:<20} {backend:<10} "
                    f"{result['seconds_per_step']:.3f}  fit "
                    f"{result['fit_seconds_per_step']:.3f}",
                    flush=True,
                )
    median = {key: statistics.median(v) for key, v in times.items()}
    fit_median = {key: statistics.median(v) for key, v in fits.items()}
    header = f"{'case':<21} {'ours':>8}"
    if "jax" in backends:
        header += f" {'JAX':>8}"
    print(header + "  (medians, s/step; then a fit's wall time / steps)")
    for case in cases:
        row = f"{case:<21} {median['tensorflow', case]:8.3f}"
        if "jax" in backends:
            row += f" {median['jax', case]:8.3f}"
        row += f"   fit {fit_median['tensorflow', case]:8.3f}"
        if "jax" in backends:
            row += f" {fit_median['jax', case]:8.3f}"
        print(row)
    # Ratios per round (each of a pair run side by side), then their
    # median, min and max.
    if "jax" in backends:
        for case in cases:
            for what, kind in ((times, "per step"), (fits, "a fit's wall")):
                print(
                    summary(
                        f"{case} ours / JAX, {kind}",
                        [
                            a / b
                            for a, b in zip(
                                what["tensorflow", case],
                                what["jax", case],
                                strict=True,
                            )
                        ],
                    )
                )
    for prefix, name in (("", "MLP"), ("gemma_", "Gemma")):
        one = f"{prefix}one_device"
        for mode, title in (
            ("data_parallel", "DataParallel"),
            ("model_parallel", "ModelParallel"),
        ):
            split = prefix + mode
            if not {one, split} <= set(cases):
                continue
            # Each backend against its own one device, and JAX's against
            # ours (the bar: our one device).
            for backend, base in [(b, b) for b in backends] + (
                [("jax", "tensorflow")] if "jax" in backends else []
            ):
                whose = backend if base == backend else "JAX's / ours"
                print(
                    summary(
                        f"{name}: {title} / one device, {whose}",
                        [
                            a / b
                            for a, b in zip(
                                times[backend, split],
                                times[base, one],
                                strict=True,
                            )
                        ],
                    )
                )
    return None


if __name__ == "__main__":
    main()
