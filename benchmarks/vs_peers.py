"""Across processes, side by side: ours (MPI, gRPC), Keras on JAX, PyTorch.

N processes (`--processes`, default 2), each with one device, pinned to its
own core (when there are as many cores) and running one thread (TensorFlow:
one intra-op and one inter-op thread; JAX: XLA's eigen threading off and one
intra-op thread; PyTorch: `torch.set_num_threads(1)`).

Backends:
- `ours_mpi`: the Keras script under `mpiexec -n N` (the one beside this
  Python), `KERAS_REPLICATOR_TRANSPORT=mpi`;
- `ours_grpc`: the same script under `keras-replicator launch --workers N`
  (TF_CONFIG on loopback, TensorFlow's collectives);
- `jax`: the same script with `KERAS_BACKEND=jax`, gloo CPU collectives, and
  `keras.distribution.initialize` given Keras' own variables
  (`KERAS_DISTRIBUTION_JOB_ADDRESSES`, `..._NUM_PROCESSES`,
  `..._PROCESS_ID`);
- `torch`: the MLP in PyTorch over gloo: `DistributedDataParallel`, and
  FSDP2 (`fully_shard` per layer, then the model) for ModelParallel.

The Keras script calls `keras.distribution.initialize()`, sets
`DataParallel`, or `ModelParallel` on a (1, N) mesh, and feeds a tf.data
pipeline of the global batch (Keras on JAX shards only a tf.data dataset over
processes). Models (`--models`):
- `mlp`: 4 x Dense(2048) on 2048 inputs, ReLU between, 16.8M parameters,
  Adam 1e-3, MSE, global batch 64; kernels `(None, "model")` under
  ModelParallel;
- `gemma`: keras-hub's `GemmaCausalLM` from `GEMMA` (about 30M parameters,
  no download), Adam 1e-3, batches of 8 x 128 tokens; ModelParallel with
  `GemmaBackbone.get_layout_map`.

A run fits `--steps` steps once (tracing, compiling), then times a second
`fit` of `--steps` steps by its wall time; its figure is the slowest
process's seconds per step. Cases alternate their backends' order every
round (`--rounds`). Printed: each run, then medians, each backend's split
step over its own one device, ours (MPI) over every peer, and MPI over gRPC,
each as the median (min, max) over rounds of per-round ratios. A peer that
refuses a case is printed with its error; a missing peer (no jax, keras-hub
or torch in `--peer-python`) is said and skipped.

The peers come with the `bench`, `hub` and `mpi` extras (`pip install
"keras-replicator[bench,hub,mpi]"`), or from another environment
(`--peer-python`).

    python benchmarks/vs_peers.py [--processes 2] [--rounds 3] [--steps 8]
        [--models mlp,gemma] [--backends ours_mpi,ours_grpc,jax,torch]
        [--peer-python PY]
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import label  # noqa: E402
from _common import run_processes  # noqa: E402
from _common import summary  # noqa: E402

BACKENDS = ("ours_mpi", "ours_grpc", "jax", "torch")
CASES = ("one_device", "data_parallel", "model_parallel")
MODELS = ("mlp", "gemma")
WIDTH, GLOBAL_BATCH = 2048, 64
GEMMA = dict(
    vocabulary_size=32768,
    num_layers=4,
    num_query_heads=8,
    num_key_value_heads=8,
    hidden_dim=512,
    intermediate_dim=4096,
    head_dim=64,
)
GEMMA_BATCH, GEMMA_LENGTH = 8, 128
TIMEOUT = 1800


def _rank():
    for name in ("PMI_RANK", "KERAS_DISTRIBUTION_PROCESS_ID", "RANK"):
        if name in os.environ:
            return int(os.environ[name])
    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    return int(config.get("task", {}).get("index", 0))


def _pin(processes):
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= processes:
        os.sched_setaffinity(0, [cores[_rank()]])


def _keras_worker(args):
    """One Keras run (TensorFlow or JAX backend); prints `RESULT <json>`."""
    _pin(args.processes)
    import keras
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    if keras.backend.backend() == "tensorflow":
        import keras_replicator  # noqa: F401 - keras.distribution on TF
    else:
        # tf.data only feeds JAX: no TensorFlow device is wanted.
        tf.config.set_visible_devices([], "GPU")
    if args.case != "one_device":
        keras.distribution.initialize()
        devices = keras.distribution.list_devices()
        if args.case == "data_parallel":
            keras.distribution.set_distribution(
                keras.distribution.DataParallel(devices=devices)
            )
        else:
            mesh = keras.distribution.DeviceMesh(
                (1, len(devices)), ("batch", "model"), devices
            )
            if args.model == "gemma":
                import keras_hub

                layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
            else:
                layout_map = keras.distribution.LayoutMap(mesh)
                layout_map[r".*/d\d/kernel"] = (None, "model")
            keras.distribution.set_distribution(
                keras.distribution.ModelParallel(
                    layout_map=layout_map, batch_dim_name="batch"
                )
            )
    keras.utils.set_random_seed(1)
    rng = np.random.default_rng(0)
    if args.model == "gemma":
        import keras_hub

        backbone = keras_hub.models.GemmaBackbone(**GEMMA, dtype="float32")
        model = keras_hub.models.GemmaCausalLM(backbone, preprocessor=None)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        batch = GEMMA_BATCH
        tokens = rng.integers(
            1,
            GEMMA["vocabulary_size"],
            size=(batch * args.steps, GEMMA_LENGTH + 1),
        ).astype("int32")
        x = {
            "token_ids": tokens[:, :-1],
            "padding_mask": np.ones(tokens[:, :-1].shape, "bool"),
        }
        y = tokens[:, 1:]
    else:
        model = keras.Sequential(
            [keras.Input((WIDTH,))]
            + [
                keras.layers.Dense(
                    WIDTH, activation="relu" if i < 3 else None, name=f"d{i}"
                )
                for i in range(4)
            ]
        )
        loss, batch = "mse", GLOBAL_BATCH
        x = rng.normal(size=(batch * args.steps, WIDTH)).astype("float32")
        y = rng.normal(size=(batch * args.steps, WIDTH)).astype("float32")
    model.compile(keras.optimizers.Adam(1e-3), loss)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        batch, drop_remainder=True
    )
    model.fit(data, epochs=1, verbose=0)  # Traces and compiles.
    start = time.perf_counter()
    history = model.fit(data, epochs=1, verbose=0)
    seconds = (time.perf_counter() - start) / args.steps
    _result(
        seconds,
        history.history["loss"][-1],
        model.count_params(),
    )


def _torch_worker(args):
    """The MLP in PyTorch: one device, DDP or FSDP2 over gloo."""
    _pin(args.processes)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    torch.manual_seed(1)
    layers = []
    for i in range(4):
        layers.append(torch.nn.Linear(WIDTH, WIDTH))
        if i < 3:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    share = 1
    if args.case != "one_device":
        dist.init_process_group("gloo")
        share = dist.get_world_size()
        if args.case == "data_parallel":
            model = torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer)
            fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    local = GLOBAL_BATCH // share
    batches = [
        (
            torch.randn(local, WIDTH, generator=generator),
            torch.randn(local, WIDTH, generator=generator),
        )
        for _ in range(args.steps)
    ]

    def epoch():
        for x, y in batches:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
        return float(loss)

    epoch()
    start = time.perf_counter()
    last = epoch()
    seconds = (time.perf_counter() - start) / args.steps
    # A DTensor's numel is its global size: parameters as on one device.
    _result(seconds, last, sum(p.numel() for p in model.parameters()))
    if args.case != "one_device":
        dist.destroy_process_group()


def _result(seconds, loss, parameters):
    print(
        "RESULT "
        + json.dumps(
            {
                "seconds_per_step": seconds,
                "loss": float(loss),
                "parameters": int(parameters),
            }
        ),
        flush=True,
    )


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(python, command, processes, env_of):
    """N processes of `command` (peers), each with env_of(rank)'s variables."""
    running = [
        subprocess.Popen(
            [python, *command],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **env_of(rank)},
        )
        for rank in range(processes)
    ]
    outputs, failed = [], None
    deadline = time.monotonic() + TIMEOUT
    for p in running:
        try:
            out, err = p.communicate(
                timeout=max(1, deadline - time.monotonic())
            )
        except subprocess.TimeoutExpired:
            for q in running:
                q.kill()
            raise RuntimeError(f"timed out after {TIMEOUT} s") from None
        outputs.append(out)
        if p.returncode and failed is None:
            failed = err
    if failed is not None:
        for q in running:
            q.kill()
        raise RuntimeError(failed)
    decoder = json.JSONDecoder()
    return [
        decoder.raw_decode(out.split("RESULT ")[1])[0]
        for out in outputs
        if "RESULT " in out
    ]


def _worker_command(args, backend, model, case):
    return [
        os.path.abspath(__file__),
        f"--worker={'torch' if backend == 'torch' else 'keras'}",
        f"--model={model}",
        f"--case={case}",
        f"--processes={args.processes}",
        f"--steps={args.steps}",
    ]


def _run(args, backend, model, case):
    """One run; returns the slowest process's result."""
    n = 1 if case == "one_device" else args.processes
    command = _worker_command(args, backend, model, case)
    quiet = {"TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONUNBUFFERED": "1"}
    if backend.startswith("ours"):
        env = {**quiet, "KERAS_BACKEND": "tensorflow"}
        if backend == "ours_mpi" and n > 1:
            env.update(
                KERAS_REPLICATOR_TRANSPORT="mpi",
                KERAS_REPLICATOR_CPU_REPLICAS="1",
            )
            results = run_processes(
                [sys.executable, *command],
                n,
                timeout=TIMEOUT,
                mpiexec=True,
                env=env,
            )
        else:
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                results = run_processes(
                    [sys.executable, *command], n, timeout=TIMEOUT
                )
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
    else:
        port = _free_port()

        def env_of(rank):
            env = dict(quiet)
            if backend == "jax":
                env.update(
                    KERAS_BACKEND="jax",
                    JAX_PLATFORMS="cpu",
                    JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
                    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false "
                    "intra_op_parallelism_threads=1",
                )
                if n > 1:
                    env.update(
                        KERAS_DISTRIBUTION_JOB_ADDRESSES=f"127.0.0.1:{port}",
                        KERAS_DISTRIBUTION_NUM_PROCESSES=str(n),
                        KERAS_DISTRIBUTION_PROCESS_ID=str(rank),
                    )
            else:
                env.update(
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                    RANK=str(rank),
                    WORLD_SIZE=str(n),
                    OMP_NUM_THREADS="1",
                )
            return env

        results = _spawn(args.peer_python, command, n, env_of)
    if len(results) != n:
        raise RuntimeError(f"{len(results)} of {n} processes reported")
    return max(results, key=lambda r: r["seconds_per_step"])


def _missing(python, modules, backend="jax"):
    """Why `python` cannot import `modules` (Keras on `backend`), or None."""
    try:
        probe = subprocess.run(
            [python, "-c", f"import {', '.join(modules)}"],
            capture_output=True,
            text=True,
            env={
                **os.environ,
                "KERAS_BACKEND": backend,
                "JAX_PLATFORMS": "cpu",
            },
            check=False,
            timeout=300,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return str(error)
    if probe.returncode == 0:
        return None
    lines = probe.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit {probe.returncode}"


def _runs(args, models, backends):
    """The (backend, model, case) runs this benchmark makes, in one round."""
    runs = []
    for model in models:
        for case in CASES:
            for backend in backends:
                if backend == "torch" and model != "mlp":
                    continue
                if backend == "ours_grpc" and case == "one_device":
                    continue  # One process: ours_mpi's one device.
                runs.append((backend, model, case))
    return runs


def _ratios(a, b):
    pairs = [(x, y) for x, y in zip(a, b, strict=False) if x and y]
    return [x / y for x, y in pairs]


def _report(args, times, errors, models, backends):
    names = {"data_parallel": "DDP", "model_parallel": "FSDP2"}
    for model in models:
        print(f"\n{model}: medians, s/step")
        for case in CASES:
            cells = []
            for backend in backends:
                key = (backend, model, case)
                if key in errors:
                    cells.append(f"{backend} refused")
                elif times.get(key):
                    cells.append(
                        f"{backend} {statistics.median(times[key]):.3f}"
                    )
            print(f"  {case:<15} " + "  ".join(cells))
        for backend in backends:
            one = "ours_mpi" if backend.startswith("ours") else backend
            for case in CASES[1:]:
                a = times.get((backend, model, case))
                b = times.get((one, model, "one_device"))
                if a and b:
                    print(
                        "  "
                        + summary(
                            f"{backend} {case} / own one device",
                            _ratios(a, b),
                        )
                    )
        for case in CASES:
            ours = times.get(("ours_mpi", model, case))
            for peer in backends:
                theirs = times.get((peer, model, case))
                if peer == "ours_mpi" or not ours or not theirs:
                    continue
                title = peer
                if peer == "torch" and case in names:
                    title = f"torch {names[case]}"
                print(
                    "  "
                    + summary(
                        f"{case}: ours_mpi / {title}", _ratios(ours, theirs)
                    )
                )
    for key, error in sorted(errors.items()):
        print(f"{' '.join(key)} refused: {error}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument(
        "--peer-python",
        default=sys.executable,
        help="a Python with Keras, jax[cpu], TensorFlow (tf.data), keras-hub "
        "and torch for the peers (default: this one)",
    )
    parser.add_argument("--worker", choices=("keras", "torch"))
    parser.add_argument("--model", choices=MODELS)
    parser.add_argument("--case", choices=CASES)
    args = parser.parse_args()
    if args.worker == "keras":
        return _keras_worker(args)
    if args.worker == "torch":
        return _torch_worker(args)
    models = [m for m in args.models.split(",") if m]
    backends = [b for b in args.backends.split(",") if b]
    for value, allowed, name in (
        (models, MODELS, "models"),
        (backends, BACKENDS, "backends"),
    ):
        wrong = [v for v in value if v not in allowed]
        if wrong:
            parser.error(f"Received: --{name}={wrong}; allowed: {allowed}")
    print(label())
    for backend, modules in (("jax", ("jax", "keras")), ("torch", ("torch",))):
        if backend in backends:
            why = _missing(args.peer_python, modules)
            if why:
                print(
                    f"{backend} is missing in {args.peer_python} ({why}): "
                    "skipped (pip install "
                    '"keras-replicator[bench,hub,mpi]", or pass --peer-python)'
                )
                backends.remove(backend)
    if "gemma" in models:
        pythons = [(sys.executable, "tensorflow")]
        if "jax" in backends:
            pythons.append((args.peer_python, "jax"))
        why = [p for p, b in pythons if _missing(p, ("keras_hub",), b)]
        if why:
            print(f"keras-hub is missing in {why}: gemma skipped")
            models.remove("gemma")
    print(
        f"{args.processes} processes, one device, one core and one thread "
        f"each; {args.steps} timed steps after {args.steps} warm ones; "
        f"median of {args.rounds} alternating rounds (s/step)"
    )
    runs = _runs(args, models, backends)
    times, errors = {}, {}
    for i in range(args.rounds):
        for model in models:
            for case in CASES:
                group = [r for r in runs if r[1:] == (model, case)]
                # Rotate who goes first, so drift favours no backend.
                shift = i % len(group) if group else 0
                for key in group[shift:] + group[:shift]:
                    if key in errors:
                        continue
                    try:
                        result = _run(args, *key)
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        lines = [x for x in str(e).splitlines() if x.strip()]
                        errors[key] = lines[-1] if lines else repr(e)
                        print(f"  round {i + 1} {' '.join(key)}: refused")
                        continue
                    times.setdefault(key, []).append(result["seconds_per_step"])
                    print(
                        f"  round {i + 1} {key[1]:<5} {key[2]:<15} "
                        f"{key[0]:<10} {result['seconds_per_step']:.3f} "
                        f"s/step, loss {result['loss']:.5g}, "
                        f"{result['parameters'] / 1e6:.1f}M parameters",
                        flush=True,
                    )
    _report(args, times, errors, models, backends)


if __name__ == "__main__":
    main()
