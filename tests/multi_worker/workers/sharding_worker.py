"""One worker of the 2x2 sharding test: ids seen, evaluate, uneven fit.

argv: the init weights (.npz), the 7-file directory, the 1-file directory.
"""

import sys

import keras  # noqa: E402  (after keras_replicator set the backend)
import numpy as np

import keras_replicator as kr
from tests.multi_worker import harness
from tests.multi_worker import sharding_common as common

init_path, seven_dir, one_dir = sys.argv[1:4]
replicator = kr.MultiWorkerReplicator()
out = {"worker": replicator.worker_index}


def ids_seen(dataset):
    """Sum and count of the ids with weight > 0, and the steps, here."""
    dist = replicator.distribute(dataset, 64, mode="eval", static_shapes=True)
    total, count, steps = 0, 0, 0
    for batch in dist:
        steps += 1
        for ids, _, w in zip(
            *(replicator.experimental_local_results(t) for t in batch),
            strict=True,
        ):
            mask = w.numpy() > 0
            total += int(ids.numpy()[mask].sum())
            count += int(mask.sum())
    return {"sum": total, "count": count, "steps": steps}


for name, directory in (("seven", seven_dir), ("one", one_dir)):
    records = common.records(directory)
    out[name] = ids_seen(records.map(lambda r: (common.ids(r), common.ids(r))))
    with replicator.scope():
        model = common.model()
        model.set_weights(list(np.load(init_path).values()))
    dist = replicator.distribute(
        records.map(common.parse), 64, mode="eval", static_shapes=True
    )
    out[name]["evaluate"] = model.evaluate(dist, verbose=0, return_dict=True)

with common.mock_tfds():
    out["tfds"] = ids_seen(common.tfds_input_fn)


class CountSteps(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1


with replicator.scope():
    model = common.model()
    model.set_weights(list(np.load(init_path).values()))
counter = CountSteps()
train = replicator.distribute(
    common.records(seven_dir).map(common.parse),
    64,
    static_shapes=True,
    shuffle_seed=1,
)
model.fit(train, epochs=1, shuffle=False, verbose=0, callbacks=[counter])
out["train_steps"] = counter.steps
harness.write_result(out)
