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
"""

import argparse
import json
import time

import keras_replicator as kr


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


def build_resnet(keras, width, num_classes=10):
    """A ResNet for 8x8 images: a stem and two residual stages."""

    def conv_bn_relu(x, stride=1, relu=True):
        x = keras.layers.Conv2D(
            width, 3, strides=stride, padding="same", use_bias=False
        )(x)
        x = kr.layers.CrossReplicaBatchNormalization(momentum=0.9)(x)
        return keras.layers.ReLU()(x) if relu else x

    inputs = keras.Input((8, 8, 1))
    x = conv_bn_relu(inputs)
    for stride in (1, 2):
        y = conv_bn_relu(conv_bn_relu(x, stride), relu=False)
        shortcut = x
        if stride != 1:
            shortcut = keras.layers.Conv2D(width, 1, strides=stride)(x)
        x = keras.layers.ReLU()(keras.layers.Add()([y, shortcut]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(num_classes, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="resnet")


def main():
    args = parse_args()
    replicator = kr.LocalReplicator(args.replicas)

    # TensorFlow and Keras after the replicator: it splits the CPU first.
    import keras
    import numpy as np
    from sklearn.datasets import load_digits

    keras.utils.set_random_seed(0)
    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    # NOTE: batch sizes are GLOBAL; each replica gets global / replicas.
    n = split // args.global_batch * args.global_batch
    (x_train, y_train), (x_test, y_test) = (
        (x[:n], y[:n]),
        (x[split:], y[split:]),
    )

    with replicator.scope():
        model = build_resnet(keras, args.width)
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
