"""keras-hub's Gemma, sharded by its own layout map, on one host or several.

Needs keras-hub, which keras-replicator does not require:
`pip install "keras-replicator[hub]"` (in a checkout, `pip install ".[hub]"`;
`make test`'s `dev` extra has it).

The script is plain Keras 3 (`keras.distribution`): `initialize()` joins the
worker processes `keras-replicator launch` (or Kubernetes, Slurm, mpiexec)
started, `GemmaBackbone.get_layout_map(mesh)` says which weights to split
over which mesh axis, and `ModelParallel` stores each of them in blocks, one
per device. `import keras_replicator` is the only addition.

The model is a small `GemmaCausalLM` built from a config (no download). It
learns a synthetic language: every token determines the next one
(`next = (3 * token + 1) mod vocabulary`), so its accuracy climbs to 1.

    # 2 workers x 2 CPU replicas: batch across the workers, model inside.
    keras-replicator launch --workers 2 --replicas-per-worker 2 -- \\
        python examples/gemma_model_parallel.py
    # One host: the 8 CPU devices `import keras_replicator` makes, a (2, 4)
    # mesh; a (1, 4) mesh over the first 4; one device:
    python examples/gemma_model_parallel.py
    python examples/gemma_model_parallel.py --mesh 1,4
    python examples/gemma_model_parallel.py --distribution none

With `--out DIR` each process writes `DIR/process<i>.json` (its history and
where the embedding table lives) and `DIR/process<i>.npz` (its weights),
and a `ModelCheckpoint` writes `DIR/model.weights.h5` once (on the chief)
with whole values.
"""

import argparse
import importlib.util
import json
import os
import sys
import time

if importlib.util.find_spec("keras_hub") is None:
    # One line, not a traceback (and before TensorFlow loads).
    sys.exit(
        'This example needs keras-hub: pip install "keras-replicator[hub]" '
        '(in a checkout: pip install ".[hub]")'
    )

# Fills keras.distribution's TensorFlow backend.
import keras_replicator as kr  # noqa: E402

VOCABULARY = 64
SEQUENCE = 8
EXAMPLES = 64


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--distribution",
        choices=("model_parallel", "data_parallel", "none"),
        default="model_parallel",
    )
    parser.add_argument(
        "--mesh",
        default=None,
        help="'BATCH,MODEL' (on one host, over the first BATCH x MODEL "
        "devices). Default: the batch axis across processes and the model "
        "axis inside each; on one host (2, devices / 2).",
    )
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def build_model(layers=1):
    """A small GemmaCausalLM from a config, compiled; seeded."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(1)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCABULARY,
        num_layers=layers,
        num_query_heads=4,
        num_key_value_heads=4,
        hidden_dim=16,
        intermediate_dim=32,
        head_dim=8,
        dtype="float32",
    )
    model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"],
    )
    return model


def dataset(global_batch):
    """Global batches of the synthetic language, the same on every process.

    Under `keras.distribution` on several processes Keras cuts each global
    batch by process, so step t sees the examples one device sees.
    """
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    tokens = np.empty((EXAMPLES, SEQUENCE + 1), "int32")
    tokens[:, 0] = rng.integers(1, VOCABULARY, size=EXAMPLES)
    for t in range(SEQUENCE):
        tokens[:, t + 1] = (3 * tokens[:, t] + 1) % VOCABULARY
    x = {
        "token_ids": tokens[:, :-1],
        "padding_mask": np.ones((EXAMPLES, SEQUENCE), "bool"),
    }
    return tf.data.Dataset.from_tensor_slices((x, tokens[:, 1:])).batch(
        global_batch, drop_remainder=True
    )


def distribution(kind, mesh_arg):
    """`kind` over every process's devices (None for "none")."""
    import keras
    import keras_hub

    if kind == "none":
        return None
    devices = keras.distribution.list_devices()
    if kind == "data_parallel":
        return keras.distribution.DataParallel(devices=devices)
    if mesh_arg:
        shape = tuple(int(n) for n in mesh_arg.split(","))
        # On one host a mesh may use the first devices; over several
        # processes it must hold them all.
        devices = devices[: shape[0] * shape[1]]
    else:
        processes = kr.process_count()
        batch = processes if processes > 1 else 2 - len(devices) % 2
        shape = (batch, len(devices) // batch)
    mesh = keras.distribution.DeviceMesh(shape, ("batch", "model"), devices)
    layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )


def main(argv=None):
    args = parse_args(argv)
    import keras
    import tensorflow as tf

    if args.distribution != "none":
        # Before any other TensorFlow code: it starts this process's server.
        keras.distribution.initialize()
    process = kr.process_index()
    keras.distribution.set_distribution(
        distribution(args.distribution, args.mesh)
    )
    model = build_model(args.layers)
    callbacks = []
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        # Written once, by the chief, with whole values (every process
        # takes part in gathering the sharded weights).
        callbacks.append(
            keras.callbacks.ModelCheckpoint(
                os.path.join(args.out, "model.weights.h5"),
                save_weights_only=True,
            )
        )
    start = time.perf_counter()
    history = model.fit(
        dataset(args.global_batch),
        epochs=args.epochs,
        shuffle=False,  # `dataset` is not shuffled; Keras warns otherwise
        callbacks=callbacks,
        verbose=2 if kr.is_chief() else 0,
    )
    seconds = time.perf_counter() - start
    table = model.backbone.get_layer("token_embedding").embeddings
    shapes = {d: list(s) for d, s in kr.shard_shapes(table).items()}
    weights = model.get_weights()  # every process gathers, together
    if kr.is_chief():
        print(
            f"{args.distribution}: accuracy "
            f"{history.history['accuracy'][-1]:.3f}, {seconds:.1f} s; "
            f"token embedding (64, 16) per device: {shapes}"
        )
    if args.out:
        import numpy as np

        np.savez(os.path.join(args.out, f"process{process}.npz"), *weights)
        report = {
            "history": history.history,
            "embedding_shard_shapes": shapes,
            "devices": keras.distribution.list_devices(),
            "strategy": type(tf.distribute.get_strategy()).__name__,
        }
        with open(os.path.join(args.out, f"process{process}.json"), "w") as f:
            json.dump(report, f)
    keras.distribution.set_distribution(None)
    return history.history, weights


if __name__ == "__main__":
    main()
