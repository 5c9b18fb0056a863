"""The `keras-replicator` command."""

from __future__ import annotations

import argparse
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


def _demo(args: argparse.Namespace) -> int:
    from keras_replicator._src import demo
    from keras_replicator._src import devices

    # Split the CPU before anything initialises TensorFlow's devices.
    if not devices.local_gpus():
        devices.configure_cpu_replicas(args.replicas)
    results = demo.run(replicas=args.replicas, epochs=args.epochs)
    worst = min(r["accuracy"] for r in results.values())
    return 0 if worst >= args.min_accuracy else 1


def _env(args: argparse.Namespace) -> int:
    import keras
    import tensorflow as tf

    from keras_replicator._src.replicators import auto

    choice = auto.choose()
    print(f"tensorflow {tf.__version__}, keras {keras.__version__}")
    print(f"auto() picks: {choice.describe()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `keras-replicator`."""
    parser = argparse.ArgumentParser(
        prog="keras-replicator",
        description="Run Keras 3 (TensorFlow) replicated on any topology.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo", help="train a small ResNet on digits, 1 vs N replicas"
    )
    demo.add_argument("--replicas", type=_positive_int, default=2)
    demo.add_argument("--epochs", type=_positive_int, default=12)
    demo.add_argument(
        "--min-accuracy",
        type=float,
        default=0.95,
        help="exit non-zero if test accuracy is below this (default 0.95)",
    )
    demo.set_defaults(func=_demo)

    env = sub.add_parser("env", help="show what auto() picks here, and why")
    env.set_defaults(func=_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit code."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
