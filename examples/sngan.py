"""SN-GAN with a custom replicated loop: the paper's GAN workload, tiny.

TF-Replicator's paper scaled BigGAN with a custom training loop, spectral
normalization in the discriminator and batch norm over the GLOBAL batch in
the generator. This is that recipe at laptop scale: a generator learns a
ring of 8 Gaussians in 2-D.

- `replicator.replicate(step_fn, input_fn)`: one replica's step (a
  discriminator update, then a generator update) runs on every replica.
- Two optimizers, each from `replicator.wrap_optimizer`: the losses are plain
  per-replica means, and gradients are averaged over all replicas once.
- `keras.layers.SpectralNormalization` (Keras core) wraps the discriminator's
  layers; `kr.layers.CrossReplicaBatchNormalization` normalizes the
  generator over the global batch.

Progress is measured by how far generated points lie from the nearest of the
8 modes (lower is better) and how many modes they cover.

    python examples/sngan.py --replicas 2           # full run
    python examples/sngan.py --smoke                # CI: about a minute
"""

import argparse
import json
import time

import keras_replicator as kr

MODES = 8
RADIUS = 2.0
MODE_STD = 0.05
LATENT = 16


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--steps-per-call", type=int, default=25)
    parser.add_argument("--smoke", action="store_true", help="short CI run")
    args = parser.parse_args()
    if args.smoke:
        args.steps = 600
    return args


def main():
    args = parse_args()
    replicator = kr.LocalReplicator(args.replicas)

    # TensorFlow and Keras after the replicator: it splits the CPU first.
    import keras
    import numpy as np
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    angles = 2 * np.pi * np.arange(MODES) / MODES
    centers = RADIUS * np.stack([np.cos(angles), np.sin(angles)], 1)

    def input_fn(ctx):
        # Each worker's pipeline draws its own stream of real points.
        rng = np.random.default_rng(ctx.input_pipeline_id)
        modes = rng.integers(0, MODES, size=200_000)
        noise = rng.normal(scale=MODE_STD, size=(len(modes), 2))
        points = (centers[modes] + noise).astype("float32")
        batch = ctx.get_per_replica_batch_size(args.global_batch)
        return (
            tf.data.Dataset.from_tensor_slices(points)
            .repeat()
            .batch(batch, drop_remainder=True)
        )

    def sn_dense(units):
        return keras.layers.SpectralNormalization(keras.layers.Dense(units))

    with replicator.scope():
        generator = keras.Sequential(
            [
                keras.Input((LATENT,)),
                keras.layers.Dense(128, use_bias=False),
                kr.layers.CrossReplicaBatchNormalization(),
                keras.layers.ReLU(),
                keras.layers.Dense(128, use_bias=False),
                kr.layers.CrossReplicaBatchNormalization(),
                keras.layers.ReLU(),
                keras.layers.Dense(2),
            ],
            name="generator",
        )
        discriminator = keras.Sequential(
            [
                keras.Input((2,)),
                sn_dense(128),
                keras.layers.LeakyReLU(0.2),
                sn_dense(128),
                keras.layers.LeakyReLU(0.2),
                sn_dense(1),
            ],
            name="discriminator",
        )
        g_opt = replicator.wrap_optimizer(
            keras.optimizers.Adam(1e-3, beta_1=0.5, beta_2=0.9)
        )
        d_opt = replicator.wrap_optimizer(
            keras.optimizers.Adam(1e-3, beta_1=0.5, beta_2=0.9)
        )

    def step_fn(real):
        # One replica's step, written as on one device.
        n = tf.shape(real)[0]
        with tf.GradientTape() as tape:
            fake = generator(tf.random.normal([n, LATENT]), training=True)
            d_real = discriminator(real, training=True)
            d_fake = discriminator(fake, training=True)
            # Hinge loss, as in SN-GAN and BigGAN.
            d_loss = tf.reduce_mean(tf.nn.relu(1.0 - d_real)) + tf.reduce_mean(
                tf.nn.relu(1.0 + d_fake)
            )
        d_vars = discriminator.trainable_variables
        d_opt.apply_gradients(
            zip(tape.gradient(d_loss, d_vars), d_vars, strict=True)
        )
        with tf.GradientTape() as tape:
            fake = generator(tf.random.normal([n, LATENT]), training=True)
            g_loss = -tf.reduce_mean(discriminator(fake, training=True))
        g_vars = generator.trainable_variables
        g_opt.apply_gradients(
            zip(tape.gradient(g_loss, g_vars), g_vars, strict=True)
        )
        return {"d_loss": d_loss, "g_loss": g_loss}

    step = replicator.replicate(
        step_fn, input_fn, steps_per_call=args.steps_per_call
    )

    def quality():
        """Mean distance to the nearest mode, and modes within 3 std."""
        z = np.random.default_rng(123).normal(size=(2000, LATENT))
        fake = generator(z.astype("float32"), training=False).numpy()
        dist = np.linalg.norm(fake[:, None] - centers[None], axis=-1)
        covered = np.unique(dist.argmin(1)[dist.min(1) < 0.3])
        return float(dist.min(1).mean()), int(len(covered))

    initial_distance, initial_modes = quality()
    print(
        f"{replicator.num_replicas_in_sync} replicas, global batch "
        f"{args.global_batch}; before training: mode distance "
        f"{initial_distance:.3f}, modes covered {initial_modes}/{MODES}"
    )
    start = time.perf_counter()
    calls = max(1, args.steps // args.steps_per_call)
    for call in range(1, calls + 1):
        logs = step()
        if call % max(1, calls // 6) == 0 or call == calls:
            distance, modes = quality()
            print(
                f"step {call * args.steps_per_call:5d}  "
                f"d_loss {float(logs['d_loss']):.3f}  "
                f"g_loss {float(logs['g_loss']):.3f}  "
                f"mode distance {distance:.3f}  modes {modes}/{MODES}"
            )
    final_distance, final_modes = quality()
    print(f"{time.perf_counter() - start:.1f} s of training")
    print(
        "RESULT "
        + json.dumps(
            {
                "initial_mode_distance": initial_distance,
                "final_mode_distance": final_distance,
                "initial_modes": initial_modes,
                "final_modes": final_modes,
            }
        )
    )


if __name__ == "__main__":
    main()
