"""D4PG on Pendulum with a replicated learner: the paper's RL workload, tiny.

TF-Replicator's paper ran D4PG's learner replicated over accelerators. This
is a small D4PG (Barth-Maron et al., 2018) on gymnasium's `Pendulum-v1`:

- a distributional critic: a categorical distribution over 51 atoms of the
  return, trained on 3-step targets projected onto the atoms (C51);
- a deterministic actor trained to maximise the critic's expected return;
- Polyak-averaged target networks;
- a learner written as ONE replica's step and run on every replica with
  `replicator.replicate(step_fn, input_fn)`. Each replica samples its own
  minibatch from the replay buffer; both optimizers come from
  `replicator.wrap_optimizer`, so gradients are averaged over the replicas.

A single actor fills the replay buffer between learner calls. Progress is
the return of greedy evaluation episodes (higher is better; a random policy
scores about -1200 and a good one about -150).

    python examples/d4pg.py --replicas 2             # full run
    python examples/d4pg.py --smoke                  # CI: about a minute

Needs gymnasium, which no extra of keras-replicator's but `dev` installs:
`pip install gymnasium`.
"""

import argparse
import importlib.util
import json
import sys
import time

if importlib.util.find_spec("gymnasium") is None:
    # One line, not a traceback (and before TensorFlow loads).
    sys.exit("This example needs gymnasium: pip install gymnasium")

import keras_replicator as kr  # noqa: E402

ATOMS = 51
V_MIN, V_MAX = -100.0, 0.0
REWARD_SCALE = 0.1  # Pendulum's rewards are in [-16.3, 0].
GAMMA = 0.99
N_STEP = 3
TAU = 0.005
MAX_ACTION = 2.0


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--episodes", type=int, default=40)
    parser.add_argument("--updates-per-episode", type=int, default=200)
    parser.add_argument("--smoke", action="store_true", help="short CI run")
    args = parser.parse_args()
    if args.smoke:
        args.episodes = 14
    return args


def main():
    args = parse_args()
    replicator = kr.LocalReplicator(args.replicas)

    # TensorFlow and Keras after the replicator: it splits the CPU first.
    import gymnasium as gym
    import keras
    import numpy as np
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    env = gym.make("Pendulum-v1")
    obs_dim = env.observation_space.shape[0]
    act_dim = env.action_space.shape[0]
    atoms = tf.linspace(V_MIN, V_MAX, ATOMS)

    def mlp(inputs, outputs, name, activation=None):
        return keras.Sequential(
            [
                keras.Input((inputs,)),
                keras.layers.Dense(256, activation="relu"),
                keras.layers.Dense(256, activation="relu"),
                keras.layers.Dense(outputs, activation=activation),
            ],
            name=name,
        )

    with replicator.scope():
        actor = mlp(obs_dim, act_dim, "actor", "tanh")
        critic = mlp(obs_dim + act_dim, ATOMS, "critic")
        target_actor = mlp(obs_dim, act_dim, "target_actor", "tanh")
        target_critic = mlp(obs_dim + act_dim, ATOMS, "target_critic")
        target_actor.set_weights(actor.get_weights())
        target_critic.set_weights(critic.get_weights())
        actor_opt = replicator.wrap_optimizer(keras.optimizers.Adam(1e-4))
        critic_opt = replicator.wrap_optimizer(keras.optimizers.Adam(1e-3))

    buffer = ReplayBuffer(obs_dim, act_dim, capacity=100_000)

    def input_fn(ctx):
        # Each pipeline samples minibatches from the shared replay buffer.
        batch = ctx.get_per_replica_batch_size(args.global_batch)
        rng = np.random.default_rng(ctx.input_pipeline_id)
        spec = (
            tf.TensorSpec([batch, obs_dim]),
            tf.TensorSpec([batch, act_dim]),
            tf.TensorSpec([batch]),
            tf.TensorSpec([batch]),
            tf.TensorSpec([batch, obs_dim]),
        )
        return tf.data.Dataset.from_generator(
            lambda: iter(lambda: buffer.sample(batch, rng), None),
            output_signature=spec,
        )

    def policy(model, obs):
        return MAX_ACTION * model(obs)

    def step_fn(batch):
        # One replica's learner step, written as on one device.
        obs, action, reward, discount, next_obs = batch
        next_action = policy(target_actor, next_obs)
        next_probs = tf.nn.softmax(
            target_critic(tf.concat([next_obs, next_action], -1))
        )
        target = project(reward, discount, next_probs, atoms)
        with tf.GradientTape() as tape:
            logits = critic(tf.concat([obs, action], -1))
            critic_loss = tf.reduce_mean(
                tf.nn.softmax_cross_entropy_with_logits(target, logits)
            )
        c_vars = critic.trainable_variables
        critic_opt.apply_gradients(
            zip(tape.gradient(critic_loss, c_vars), c_vars, strict=True)
        )
        with tf.GradientTape() as tape:
            probs = tf.nn.softmax(
                critic(tf.concat([obs, policy(actor, obs)], -1))
            )
            actor_loss = -tf.reduce_mean(tf.reduce_sum(probs * atoms, -1))
        a_vars = actor.trainable_variables
        actor_opt.apply_gradients(
            zip(tape.gradient(actor_loss, a_vars), a_vars, strict=True)
        )
        # Every replica computes the same new targets from mirrored weights.
        for model, target_model in (
            (actor, target_actor),
            (critic, target_critic),
        ):
            for w, t in zip(model.weights, target_model.weights, strict=True):
                t.assign(TAU * w + (1.0 - TAU) * t)
        return {"critic_loss": critic_loss, "q": -actor_loss / REWARD_SCALE}

    act = tf.function(lambda obs: policy(actor, obs[None])[0])

    def run_episode(seed, noise=0.0, rng=None):
        obs, _ = env.reset(seed=seed)
        total, trajectory = 0.0, []
        for _ in range(200):
            action = act(tf.constant(obs, tf.float32)).numpy()
            if noise:
                action = np.clip(
                    action + noise * rng.normal(size=act_dim),
                    -MAX_ACTION,
                    MAX_ACTION,
                )
            next_obs, reward, terminated, truncated, _ = env.step(action)
            trajectory.append((obs, action, reward))
            total += reward
            obs = next_obs
            if terminated or truncated:
                break
        return total, trajectory, obs, terminated

    def evaluate():
        return float(np.mean([run_episode(1000 + i)[0] for i in range(3)]))

    initial_return = evaluate()
    print(
        f"{replicator.num_replicas_in_sync} replicas, global batch "
        f"{args.global_batch}; greedy return before training "
        f"{initial_return:.0f}"
    )
    # The first episodes fill the buffer before the first learner call.
    learner = None
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for episode in range(args.episodes):
        ret, trajectory, last_obs, terminated = run_episode(
            episode, noise=0.3 * MAX_ACTION, rng=rng
        )
        buffer.add_episode(trajectory, last_obs, terminated)
        if len(buffer) < 2 * args.global_batch:
            continue
        if learner is None:
            learner = replicator.replicate(
                step_fn, input_fn, steps_per_call=args.updates_per_episode
            )
        logs = learner()
        print(
            f"episode {episode:3d}  return {ret:7.0f}  "
            f"critic_loss {float(logs['critic_loss']):.3f}  "
            f"Q {float(logs['q']):7.0f}"
        )
    final_return = evaluate()
    print(f"{time.perf_counter() - start:.1f} s of training")
    print(f"greedy return after training {final_return:.0f}")
    print(
        "RESULT "
        + json.dumps(
            {"initial_return": initial_return, "final_return": final_return}
        )
    )


def project(reward, discount, next_probs, atoms):
    """Projects the target distribution r + discount * Z onto the atoms (C51).

    Args:
        reward: `[batch]` n-step rewards (scaled).
        discount: `[batch]` gamma^n, or 0 where the episode terminated.
        next_probs: `[batch, atoms]` probabilities of the next state's return.
        atoms: `[atoms]` the fixed support, evenly spaced.

    Returns:
        `[batch, atoms]` target probabilities on `atoms`.
    """
    import tensorflow as tf

    delta = (V_MAX - V_MIN) / (ATOMS - 1)
    shifted = reward[:, None] + discount[:, None] * atoms[None, :]
    shifted = tf.clip_by_value(shifted, V_MIN, V_MAX)
    # Each shifted atom splits its mass between its two neighbours, in
    # proportion to closeness: a triangular kernel of width delta.
    weight = tf.clip_by_value(
        1.0 - tf.abs(shifted[:, None, :] - atoms[None, :, None]) / delta,
        0.0,
        1.0,
    )
    return tf.stop_gradient(tf.reduce_sum(weight * next_probs[:, None, :], -1))


class ReplayBuffer:
    """A uniform replay buffer of n-step transitions, in NumPy arrays."""

    def __init__(self, obs_dim, act_dim, capacity):
        import numpy as np

        self.capacity = capacity
        self.size = 0
        self.next = 0
        self.obs = np.zeros((capacity, obs_dim), "float32")
        self.action = np.zeros((capacity, act_dim), "float32")
        self.reward = np.zeros((capacity,), "float32")
        self.discount = np.zeros((capacity,), "float32")
        self.next_obs = np.zeros((capacity, obs_dim), "float32")

    def __len__(self):
        return self.size

    def add_episode(self, trajectory, last_obs, terminated):
        """Adds every n-step transition of one episode."""
        states = [t[0] for t in trajectory] + [last_obs]
        for i, (obs, action, _) in enumerate(trajectory):
            window = trajectory[i : i + N_STEP]
            ret = sum(
                (GAMMA**k) * r * REWARD_SCALE
                for k, (_, _, r) in enumerate(window)
            )
            ends = i + len(window) == len(trajectory)
            # A time-limit truncation still bootstraps; a termination not.
            discount = 0.0 if ends and terminated else GAMMA ** len(window)
            self._add(obs, action, ret, discount, states[i + len(window)])

    def _add(self, obs, action, reward, discount, next_obs):
        i = self.next
        self.obs[i], self.action[i], self.reward[i] = obs, action, reward
        self.discount[i], self.next_obs[i] = discount, next_obs
        self.next = (i + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def sample(self, batch, rng):
        """A uniformly sampled minibatch of `batch` transitions."""
        idx = rng.integers(0, self.size, size=batch)
        return (
            self.obs[idx],
            self.action[idx],
            self.reward[idx],
            self.discount[idx],
            self.next_obs[idx],
        )


if __name__ == "__main__":
    main()
