"""The `keras-replicator` command.

`--help`, `launch`, `tf-config` and `env` where no GPU can be never import
TensorFlow (`lazy_package`). `demo`, `checkpoint` and other `env` runs
load it, hiding its C++ start-up logs unless `--verbose` or
`TF_CPP_MIN_LOG_LEVEL` (`tf_logs`). Keep module imports TensorFlow-free.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"must be a positive integer. Received: {text!r}"
        )
    return value


def _load_package(args: argparse.Namespace) -> None:
    """Imports keras_replicator, and TensorFlow, quietly unless --verbose."""
    from keras_replicator._src.cluster import lazy_package
    from keras_replicator._src.cluster import tf_logs

    # TensorFlow already imported (as in tests): its logging is set up.
    if "tensorflow" in sys.modules or not tf_logs.quiet_wanted(args.verbose):
        lazy_package.load()
        return
    os.environ[tf_logs.LEVEL_ENV] = tf_logs.QUIET_LEVEL
    with tf_logs.hidden_startup_logs():
        lazy_package.load()


def _demo(args: argparse.Namespace) -> int:
    _load_package(args)
    from keras_replicator._src.cli import demo
    from keras_replicator._src.core import devices

    # Split the CPU before anything initialises TensorFlow's devices.
    if not devices.local_gpus():
        devices.configure_cpu_replicas(args.replicas)
    results = demo.run(replicas=args.replicas, epochs=args.epochs)
    worst = min(r["accuracy"] for r in results.values())
    return 0 if worst >= args.min_accuracy else 1


# Distributions that install the `tensorflow` module, most common first.
_TENSORFLOW_DISTRIBUTIONS = (
    "tensorflow",
    "tensorflow-cpu",
    "tf-nightly",
    "tensorflow-macos",
    "tensorflow-intel",
)


def _installed_version(names: tuple[str, ...]) -> str:
    """The installed version of the first of `names`, read from metadata."""
    from importlib import metadata

    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def _versions() -> str:
    if "tensorflow" in sys.modules:
        import keras
        import tensorflow as tf

        return f"tensorflow {tf.__version__}, keras {keras.__version__}"
    # What is installed, without importing it (the import is 5-8 s).
    tensorflow = _installed_version(_TENSORFLOW_DISTRIBUTIONS)
    keras = _installed_version(("keras", "keras-nightly"))
    return f"tensorflow {tensorflow}, keras {keras}"


def _devices() -> str:
    """The `devices:` line: TensorFlow's list, or why it was not asked."""
    if "tensorflow" in sys.modules:
        import tensorflow as tf

        names = [
            d.name.removeprefix("/physical_device:")
            for d in tf.config.list_physical_devices()
        ]
        return f"{', '.join(names)} (TensorFlow's physical devices)"
    return (
        f"{os.cpu_count()} CPU core(s) and no GPU, found without importing "
        "TensorFlow: no NVIDIA or ROCm driver and no TensorFlow device "
        "plugin here, so TensorFlow has no GPU to use (`env --tensorflow` "
        "asks TensorFlow)"
    )


def _env(args: argparse.Namespace) -> int:
    from keras_replicator._src.core import devices

    # TensorFlow's import is most of `env`'s time (5-8 s of CPU on a small
    # machine): only a possible GPU (only TensorFlow knows if it can use
    # it) or --tensorflow needs it; TPU, cluster and CPU replicas come from
    # the environment.
    possible = devices.gpus_possible()
    if args.tensorflow or possible is not None:
        _load_package(args)
    from keras_replicator._src.cluster import discovery
    from keras_replicator._src.cluster import transport
    from keras_replicator._src.core import env
    from keras_replicator._src.replicators import auto

    try:
        choice = auto.choose()
        # KERAS_REPLICATOR_CPU_REPLICAS, else MultiWorkerReplicator's 1.
        replicas = int(os.environ.get(env.CPU_REPLICAS) or 1)
        carrier = transport.choose(replicas_per_process=replicas)
    except (ValueError, ImportError) as e:
        print(f"keras-replicator env: error: {e}", file=sys.stderr)
        return 2
    print(_versions())
    print(f"devices: {_devices()}")
    launched = discovery.detect()
    if launched is not None and "TF_CONFIG" not in os.environ:
        # Under mpiexec every rank runs this, so the exchange completes.
        launched = discovery.exchange_addresses(launched)
        print(f"launcher: {launched.describe()}")
        print(f"cluster: {json.dumps(launched.tf_config())}")
    print(f"auto() picks: {choice.describe()}")
    print(carrier.describe())
    return 0


def _checkpoint(args: argparse.Namespace) -> int:
    _load_package(args)
    from keras_replicator._src.sharding import checkpoint

    model = _build_model(args.model)
    if args.direction == "to-weights":
        checkpoint.to_weights(model, args.source, args.target)
    else:
        checkpoint.from_weights(model, args.source, args.target)
    print(f"{args.source} -> {args.target}")
    return 0


def _build_model(spec: str):
    """The model `FILE.py:FUNCTION` or `MODULE:FUNCTION` returns."""
    import importlib
    import runpy

    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise SystemExit(
            "--model must be FILE.py:FUNCTION or MODULE:FUNCTION. "
            f"Received: --model={spec!r}"
        )
    if where.endswith(".py"):
        if not os.path.exists(where):
            raise SystemExit(f"No such file. Received: --model={spec!r}")
        namespace = runpy.run_path(where)
    else:
        # As `python -m` would: modules of the working directory import.
        sys.path.insert(0, os.getcwd())
        namespace = vars(importlib.import_module(where))
    if name not in namespace:
        raise SystemExit(f"{where} has no {name!r}. Received: --model={spec!r}")
    model = namespace[name]()
    if not getattr(model, "built", False):
        raise SystemExit(
            f"{spec} returned an unbuilt model: build it (an `Input`, or call "
            f"it on a batch) before returning it. Received: {model!r}"
        )
    return model


def _launch(args: argparse.Namespace) -> int:
    from keras_replicator._src.cluster import launch
    from keras_replicator._src.cluster import tf_logs

    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    swap_python = not args.no_python_swap
    try:
        # A missing script fails here, before anything is printed or run.
        command, note = launch.prepare_command(command, swap_python)
        if note:
            print(note, file=sys.stderr, flush=True)
        # The one-process advice is the chief's (cluster/process_layout.py).
        return launch.launch(
            command,
            workers=args.workers,
            replicas_per_worker=args.replicas_per_worker,
            ps=args.ps,
            max_restarts=args.max_restarts,
            swap_python=swap_python,
            quiet=tf_logs.quiet_wanted(args.verbose),
            transport=args.transport,
        )
    except ValueError as e:
        print(f"keras-replicator launch: error: {e}", file=sys.stderr)
        return 2


def _tf_config(args: argparse.Namespace) -> int:
    from keras_replicator._src.cluster import config as cluster

    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    try:
        config = cluster.make_tf_config(hosts, args.index, args.task_type)
    except ValueError as e:
        print(f"keras-replicator tf-config: error: {e}", file=sys.stderr)
        return 2
    print(config.to_json())
    return 0


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default.

    Except None (read elsewhere: the help says it) and required arguments;
    an on/off flag's is "off".
    """

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            "%(default)" in text
            or action.required
            or action.default in (None, argparse.SUPPRESS)
            or not action.option_strings
        ):
            return text
        if isinstance(action, argparse._StoreTrueAction):
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"


def _add_verbose(parser: argparse.ArgumentParser, whose: str) -> None:
    parser.add_argument(
        "--verbose",
        action="store_true",
        help=f"show TensorFlow's C++ start-up logs ({whose}); they are hidden "
        "unless TF_CPP_MIN_LOG_LEVEL is set",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `keras-replicator`."""
    parser = argparse.ArgumentParser(
        prog="keras-replicator",
        description="Run Keras 3 (TensorFlow) replicated on any topology.",
        formatter_class=_DefaultsFormatter,
    )
    # Subcommands' parsers do not inherit the formatter: each is given it.
    sub = parser.add_subparsers(dest="command", required=True)
    add = functools.partial(sub.add_parser, formatter_class=_DefaultsFormatter)

    demo = add("demo", help="train a small ResNet on digits, 1 vs N replicas")
    demo.add_argument(
        "--replicas",
        type=_positive_int,
        default=2,
        help="replicas of the replicated run (CPU replicas without a GPU)",
    )
    demo.add_argument(
        "--epochs", type=_positive_int, default=12, help="epochs of each run"
    )
    demo.add_argument(
        "--min-accuracy",
        type=float,
        default=0.95,
        help="exit non-zero if test accuracy is below this",
    )
    _add_verbose(demo, "of this process")
    demo.set_defaults(func=_demo)

    env = add(
        "env",
        help="show what auto() picks here, and why",
        description="Shows the TensorFlow and Keras versions, the devices "
        "and what kr.auto() picks here, and why. Quick: TensorFlow is "
        "imported only when a GPU may be here (NVIDIA or ROCm driver "
        "files, a TensorFlow device plugin, or not Linux), to ask whether "
        "it can use it, or with --tensorflow.",
    )
    env.add_argument(
        "--tensorflow",
        action="store_true",
        help="import TensorFlow and list its devices, even where no GPU can "
        "be (slower: TensorFlow's import is most of the time)",
    )
    _add_verbose(env, "of this process, when it imports TensorFlow")
    env.set_defaults(func=_env)

    launch = add(
        "launch",
        help="run a command as N local workers with TF_CONFIG on loopback",
        description="Starts N local worker processes of one cluster, each "
        "with TF_CONFIG on free 127.0.0.1 ports, prefixes their output with "
        "the worker's name, ends all when one fails (exiting with its "
        "code, or restarting all with --max-restarts) or on Ctrl-C, and "
        "forwards SIGTERM/SIGUSR1 so the workers save and exit 75. "
        "Workers die with the launcher, however it dies. A command "
        "starting with python (python3, pythonX.Y) runs on the Python that "
        "runs keras-replicator, and its script must exist. On one host "
        "one process with every replica is faster than several workers: "
        "the chief's MultiWorkerReplicator() says so in one line, unless "
        "keras.distribution built it (one device per process can be the "
        "point there). "
        "Example: keras-replicator launch --workers 2 -- python train.py",
    )
    launch.add_argument(
        "--workers",
        type=_positive_int,
        required=True,
        metavar="N",
        help="worker processes, all on this host",
    )
    launch.add_argument(
        "--replicas-per-worker",
        type=_positive_int,
        default=None,
        metavar="K",
        help="CPU replicas per worker (sets KERAS_REPLICATOR_CPU_REPLICAS; "
        "default: unset, so a worker's MultiWorkerReplicator() holds its "
        "GPUs, or 1 CPU replica)",
    )
    launch.add_argument(
        "--ps",
        type=int,
        default=0,
        metavar="M",
        help="parameter-server tasks; with M > 0 the command runs on a "
        "chief (kr.AsyncReplicator) and workers/ps run TensorFlow servers",
    )
    launch.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="R",
        help="start every worker again (new ports) after one fails, up to R "
        "times, the hang watchdog's exit code 76 included; scripts resume "
        "from their BackupAndRestore backup",
    )
    launch.add_argument(
        "--transport",
        choices=("grpc", "mpi"),
        default="grpc",
        help="how workers exchange tensors: grpc (TF_CONFIG per worker) or "
        "mpi (one mpiexec -n N, the one beside this Python or on PATH; one "
        "rank and one replica per worker; collectives over mpi4py)",
    )
    launch.add_argument(
        "--no-python-swap",
        action="store_true",
        help="run the command as given; by default a python, python3 or "
        "pythonX.Y that is not the Python running keras-replicator (as "
        "outside its virtual environment) is replaced by that Python; "
        "a line on stderr says so",
    )
    _add_verbose(launch, "of every worker")
    launch.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="the command every worker runs, after --",
    )
    launch.set_defaults(func=_launch)

    convert = add(
        "checkpoint",
        help="convert a sharded checkpoint to a .weights.h5 file, or back",
    )
    convert.add_argument("direction", choices=("to-weights", "from-weights"))
    convert.add_argument(
        "source", help="the sharded checkpoint (to-weights) or the .weights.h5"
    )
    convert.add_argument(
        "target", help="the .weights.h5 (to-weights) or the checkpoint folder"
    )
    convert.add_argument(
        "--model",
        required=True,
        help="FILE.py:FUNCTION or MODULE:FUNCTION returning the built model "
        "(run it under `keras-replicator launch` with a ModelParallel "
        "distribution to convert a model larger than one process)",
    )
    _add_verbose(convert, "of this process")
    convert.set_defaults(func=_checkpoint)

    tf_config = add(
        "tf-config", help="print the TF_CONFIG of one task of a cluster"
    )
    tf_config.add_argument(
        "--hosts",
        required=True,
        help="comma-separated host:port of every task, in task order",
    )
    tf_config.add_argument(
        "--index",
        type=int,
        required=True,
        help="this task's index among the tasks of its type",
    )
    tf_config.add_argument(
        "--type",
        default="worker",
        dest="task_type",
        help="this task's type: worker, chief or ps",
    )
    tf_config.set_defaults(func=_tf_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit code."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
