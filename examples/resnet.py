"""A ResNet classifier with `model.fit`: the paper's ResNet workload, tiny.

TF-Replicator's paper trained ResNet-50 on ImageNet with ordinary training
code on many accelerators. Here the same recipe runs on scikit-learn's
bundled digits (1,797 real 8x8 images, offline): a small ResNet whose batch
norm uses `kr.layers.CrossReplicaBatchNormalization` (statistics over the
global batch), compiled and fitted as on one device inside
`replicator.scope()`. Pass `--accumulation-steps N` to wrap the optimizer
with `replicator.wrap_optimizer` and train N micro-batches per update.

    python examples/resnet.py --replicas 4          # full run
    python examples/resnet.py --smoke               # CI: well under a minute

Needs scikit-learn, for the digits: `pip install "keras-replicator[demo]"`
(in a checkout, `pip install ".[demo]"`; `make demo` installs it).
"""

import argparse
import importlib.util
import json
import sys
import time

if importlib.util.find_spec("sklearn") is None:
    # One line, not a traceback (and before TensorFlow loads).
    sys.exit(
        'This example needs scikit-learn: pip install "keras-replicator[demo]" '
        '(in a checkout: pip install ".[demo]")'
    )

import keras_replicator as kr  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--accumulation-steps", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="short CI run")
    args = parser.parse_args()
    if args.smoke:
        args.epochs, args.width = 4, 16
    return args


def main():
    args = parse_args()
    replicator = kr.LocalReplicator(args.replicas)

    # Keras after the replicator: it splits the CPU first. The model and
    # data are `keras-replicator demo`'s: a small ResNet whose batch norm is
    # kr.layers.CrossReplicaBatchNormalization, and the digits split 80/20.
    import keras

    from keras_replicator._src.cli import demo

    keras.utils.set_random_seed(0)
    (x_train, y_train), (x_test, y_test) = demo.load_digits_split()
    # NOTE: batch sizes are GLOBAL; each replica gets global / replicas.
    n = len(x_train) // args.global_batch * args.global_batch
    x_train, y_train = x_train[:n], y_train[:n]

    with replicator.scope():
        model = demo.build_resnet(width=args.width)
        optimizer = keras.optimizers.Adam(3e-3)
        if args.accumulation_steps > 1:
            optimizer = replicator.wrap_optimizer(
                optimizer, accumulation_steps=args.accumulation_steps
            )
        model.compile(
            optimizer=optimizer,
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
    _, initial_accuracy = model.evaluate(x_test, y_test, verbose=0)
    start = time.perf_counter()
    model.fit(
        x_train,
        y_train,
        batch_size=args.global_batch,
        epochs=args.epochs,
        verbose=2,
    )
    seconds = time.perf_counter() - start
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    print(
        f"{replicator.num_replicas_in_sync} replicas: test accuracy "
        f"{accuracy:.3f} (before training {initial_accuracy:.3f}), "
        f"{seconds:.1f} s of training"
    )
    print(
        "RESULT "
        + json.dumps(
            {"initial_accuracy": initial_accuracy, "final_accuracy": accuracy}
        )
    )


if __name__ == "__main__":
    main()
