"""Worker of test_research_api.py: primitives and wrap_optimizer, 2 x 2.

Checks the cross-replica primitives across workers, then trains the model of
`tests/test_optimizer.py` with `replicate` + `wrap_optimizer` (with and
without accumulation) and reports the weights.
"""

import keras_replicator as kr

# Create the replicator first: it splits the CPU before TF starts.
replicator = kr.MultiWorkerReplicator()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests import helpers  # noqa: E402
from tests import test_optimizer as reference  # noqa: E402
from tests.multi_worker import harness  # noqa: E402


def primitives():
    rid = tf.cast(kr.replica_id(), tf.float32)
    value = {"a": tf.stack([rid, -rid]), "b": {"c": rid * rid}}
    return {
        "id": kr.replica_id(),
        "gather": kr.all_gather(kr.replica_id()),
        "broadcast": kr.broadcast(rid * 10.0 + 1.0, source_replica=2),
        "sum": kr.all_sum(value),
        "mean": kr.all_mean(value),
        "max": kr.all_max(value),
        "min": kr.all_min(value),
        "num": tf.constant(kr.num_replicas()),
    }


out = tf.function(lambda: replicator.run(primitives))()
flat = tf.nest.flatten(out)
local = [
    tf.nest.pack_sequence_as(
        out, [replicator.experimental_local_results(v)[i] for v in flat]
    )
    for i in range(replicator.replicas_per_worker)
]


def train(global_batch, calls, accumulation_steps):
    x, y = reference._data()
    with replicator.scope():
        model = reference._model()
        opt = replicator.wrap_optimizer(
            keras.optimizers.Adam(learning_rate=0.01),
            accumulation_steps=accumulation_steps,
        )

    input_fn = helpers.replica_ordered_input_fn(x, y, global_batch)

    def step_fn(batch):
        xb, yb = batch
        with tf.GradientTape() as tape:
            loss = reference._loss(model, xb, yb)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    step = replicator.replicate(step_fn, input_fn)
    losses = [float(step()) for _ in range(calls)]
    return {"weights": model.get_weights(), "losses": losses}


harness.write_result(
    {
        "primitives": tf.nest.map_structure(lambda t: t.numpy(), local),
        "plain": train(global_batch=16, calls=6, accumulation_steps=1),
        "accumulated": train(global_batch=16, calls=6, accumulation_steps=2),
    }
)
