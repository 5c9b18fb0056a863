"""AsyncReplicator on a real cluster: chief + 2 workers + 1 ps on loopback.

Each test starts real processes (`async_cluster.run_chief`) and checks
numbers the chief reports: accuracy against synchronous training, exact step
counts, a finished fit after a worker is killed, and a clear error soon after
the parameter server is killed.
"""

import os
import subprocess
import sys

import pytest

from tests.multi_worker import async_cluster
from tests.multi_worker import harness

pytestmark = pytest.mark.multi_worker

EPOCHS = 6
STEPS = 100
BATCH = 32

_MODEL = """
import os, signal, time
import keras, numpy as np, tensorflow as tf
import keras_replicator as kr
from keras_replicator._src.cli import demo
from tests.multi_worker import async_cluster, harness

(x_train, y_train), (x_test, y_test) = demo.load_digits_split()
EPOCHS, STEPS, BATCH = (int(os.environ[k]) for k in ("EPOCHS", "STEPS",
                                                      "BATCH"))


def build_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(keras.optimizers.Adam(0.003),
                  "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model
"""

TRAIN = (
    _MODEL
    + """
# Synchronous reference on the chief's own CPU, before joining the cluster:
# the same model, seed, batch and number of applied steps.
# A repeated dataset, as each async worker iterates one.
train = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
         .shuffle(len(x_train), seed=0).repeat().batch(BATCH))
sync = build_model()
sync.fit(train, epochs=EPOCHS, steps_per_epoch=STEPS, verbose=0)
sync_acc = sync.evaluate(x_test, y_test, verbose=0, return_dict=True)

replicator = kr.AsyncReplicator()
with replicator.scope():
    model = build_model()
errors = {}
try:
    model.fit(x_train, y_train, batch_size=BATCH, epochs=1)
except ValueError as e:
    errors["no_steps"] = str(e)
history = model.fit(x_train, y_train, batch_size=BATCH, epochs=EPOCHS,
                    steps_per_epoch=STEPS, verbose=0)
exact = model.evaluate(x_test, y_test, verbose=0, return_dict=True)
on_workers = model.evaluate(x_test, y_test, batch_size=BATCH, steps=20,
                            verbose=0, return_dict=True)
predicted = model.predict(x_test, verbose=0).argmax(-1)
# A sharder input in eval mode used to put exact evaluation over the async
# dispatcher (the order patches were installed in decided it): evaluate
# must still take the async path and give the same numbers.
kr.data.shard(lambda ctx: tf.data.Dataset.range(4), 2, mode="eval")
after_shard_eval = model.evaluate(x_test, y_test, verbose=0, return_dict=True)

# Research API: steps dispatched to the workers, values fetched later.
with replicator.scope():
    counter = tf.Variable(0.0)
def input_fn(ctx):
    return tf.data.Dataset.range(1, 11).map(
        lambda i: tf.cast(i, tf.float32)).batch(1)
def step_fn(batch):
    counter.assign_add(1.0)
    return tf.reduce_sum(batch)
step = replicator.replicate(step_fn, input_fn)
remote = [step() for _ in range(30)]
fetched = [float(r.fetch()) for r in remote]
replicator.join()
# None leaves come back as None (a RemoteValue cannot hold them).
with_none = replicator.replicate(
    lambda b: {"sum": tf.reduce_sum(b), "none": None}, input_fn,
    reduce="sum", steps_per_call=2)().fetch()

# replicate() of kr.data.shard(a dataset made here): sharded by element
# over the workers, so a batch of 2 is odd+odd (worker 0) or even+even
# (worker 1); unsharded, the first batch would be 1 + 2.
numbers = tf.data.Dataset.range(1, 11).map(lambda i: tf.cast(i, tf.float32))
shard_step = replicator.replicate(tf.reduce_sum, kr.data.shard(numbers, 2))
shard_sums = [float(r.fetch()) for r in [shard_step() for _ in range(12)]]

iterations = int(model.optimizer.iterations.numpy())
# kr.data.shard: a function that makes the dataset works, and so does a
# dataset made here (sent to the workers as a graph); with a known number
# of examples an epoch is one pass, without steps_per_epoch.
examples = lambda ctx: tf.data.Dataset.from_tensor_slices((x_train, y_train))
sharded = model.fit(kr.data.shard(examples, BATCH, shuffle_seed=0),
                    epochs=1, steps_per_epoch=5, verbose=0)
before = int(model.optimizer.iterations.numpy())
sharded_dataset = model.fit(kr.data.shard(examples(None), BATCH), epochs=1,
                            verbose=0)
one_pass_steps = int(model.optimizer.iterations.numpy()) - before

harness.write_result({
    "sharded_loss": sharded.history["loss"],
    "sharded_dataset_loss": sharded_dataset.history["loss"],
    "one_pass_steps": one_pass_steps,
    "shard_sums": shard_sums,
    "sync_accuracy": sync_acc["accuracy"],
    "accuracy": exact["accuracy"],
    "after_shard_eval": after_shard_eval,
    "exact_eval": exact,
    "worker_eval_accuracy": on_workers["accuracy"],
    "predict_accuracy": float((predicted == y_test).mean()),
    "iterations": iterations,
    "epochs_logged": len(history.history["loss"]),
    "errors": errors,
    "remote_type": type(remote[0]).__name__,
    "fetched": fetched,
    "counter": float(counter.numpy()),
    "with_none": [float(with_none["sum"]), with_none["none"]],
})
"""
)

FAULTS = (
    _MODEL
    + """
replicator = kr.AsyncReplicator()
with replicator.scope():
    model = build_model()


class Kill(keras.callbacks.Callback):
    def __init__(self, env, step):
        super().__init__()
        self.env, self.step, self.killed_at = env, step, None

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.step and self.killed_at is None:
            os.kill(async_cluster.pids(self.env)[0], signal.SIGKILL)
            self.killed_at = time.monotonic()


out = {}
kill_worker = Kill(async_cluster.WORKER_PIDS_ENV, 30)
history = model.fit(x_train, y_train, batch_size=BATCH, epochs=EPOCHS,
                    steps_per_epoch=STEPS, verbose=0, callbacks=[kill_worker])
out["iterations"] = int(model.optimizer.iterations.numpy())
out["epochs_logged"] = len(history.history["loss"])
out["accuracy"] = model.evaluate(x_test, y_test, verbose=0)[1]

kill_ps = Kill(async_cluster.PS_PIDS_ENV, 10)
try:
    model.fit(x_train, y_train, batch_size=BATCH, epochs=1,
              steps_per_epoch=STEPS, verbose=0, callbacks=[kill_ps])
    out["ps_error"] = None
except Exception as e:
    out["ps_error"] = type(e).__name__
    out["ps_message"] = str(e)
    out["ps_seconds"] = time.monotonic() - kill_ps.killed_at
harness.write_result(out)
"""
)


def _run(script, **kwargs):
    env = {"EPOCHS": str(EPOCHS), "STEPS": str(STEPS), "BATCH": str(BATCH)}
    result = async_cluster.run_chief(script, env=env, **kwargs)
    assert result.returncode == 0 and result.result, result.describe()
    return result.result


@pytest.mark.timeout(300)
def test_fit_matches_synchronous_accuracy_and_counts_every_step():
    r = _run(TRAIN, timeout=240)
    # Keras' read-modify-write counter lost updates here before the fix.
    assert r["iterations"] == EPOCHS * STEPS
    assert r["epochs_logged"] == EPOCHS
    assert r["sync_accuracy"] > 0.9
    # Asynchronous steps see stale weights in a timing-dependent order, so
    # the accuracy varies between runs: 0.95-0.98 here against the
    # synchronous 0.978 (a CI run missed a 0.02 bound by 0.005, and 0.95
    # sits at the edge of a 0.03 one). The bar: within 0.05 (18 of the 360
    # test digits) below the synchronous run, and over 0.93 however lucky
    # that run was; async may also come out above it.
    assert r["accuracy"] > 0.93, r
    assert r["accuracy"] >= r["sync_accuracy"] - 0.05, r
    assert r["predict_accuracy"] == pytest.approx(r["accuracy"], abs=1e-6)
    # The async path after a sharder eval input: the same exact numbers.
    assert r["after_shard_eval"] == pytest.approx(r["exact_eval"], abs=1e-6)
    assert r["worker_eval_accuracy"] > 0.9
    assert "Received: steps_per_epoch=None" in r["errors"]["no_steps"]
    # Research API: a RemoteValue per call, resolved on fetch.
    assert r["remote_type"] == "RemoteValueImpl"
    assert len(r["fetched"]) == 30
    assert all(v in range(1, 11) for v in r["fetched"])
    assert r["counter"] == 30.0
    assert r["with_none"][0] in range(1, 11) and r["with_none"][1] is None
    assert len(r["sharded_loss"]) == 1 and r["sharded_loss"][0] < 0.5, r
    assert r["one_pass_steps"] == 1437 // BATCH
    assert len(r["shard_sums"]) == 12
    assert all(v % 2 == 0 for v in r["shard_sums"]), r["shard_sums"]
    assert r["sharded_dataset_loss"][0] < 0.5, r


@pytest.mark.timeout(300)
def test_worker_death_finishes_fit_and_ps_death_raises_soon():
    r = _run(FAULTS, timeout=240)
    # The killed worker's in-flight step is rescheduled on the survivor.
    # A step that applied its update just before the worker died and is
    # run again counts twice, so allow one extra applied step.
    assert EPOCHS * STEPS <= r["iterations"] <= EPOCHS * STEPS + 1
    assert r["epochs_logged"] == EPOCHS
    assert r["accuracy"] > 0.9
    assert r["ps_error"] == "ParameterServerError", r.get("ps_message")
    assert "/job:ps/task:0 (127.0.0.1:" in r["ps_message"]
    assert r["ps_seconds"] < 60


LAUNCHED = """
import json, os
import keras, numpy as np
import keras_replicator as kr

config = json.loads(os.environ["TF_CONFIG"])
print("jobs", sorted(config["cluster"]), "task", config["task"]["type"])
replicator = kr.AsyncReplicator()
with replicator.scope():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
x = np.random.default_rng(0).normal(size=(64, 3)).astype("float32")
model.fit(x, x.sum(1), batch_size=8, epochs=2, steps_per_epoch=10, verbose=0)
print("iterations", int(model.optimizer.iterations.numpy()))
"""


@pytest.mark.timeout(200)
def test_launch_with_ps_runs_the_command_on_the_chief():
    command = [
        sys.executable,
        "-c",
        "from keras_replicator._src.cli import main as cli; "
        "raise SystemExit(cli.main())",
        "launch",
        "--workers",
        "2",
        "--ps",
        "1",
        "--",
        sys.executable,
        "-c",
        LAUNCHED,
    ]
    env = dict(os.environ, PYTHONPATH=str(harness.REPO_ROOT))
    proc = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=150)
    finally:
        harness._kill(proc)
    assert proc.returncode == 0, output
    assert "[chief] jobs ['chief', 'ps', 'worker'] task chief" in output
    assert "[chief] iterations 20" in output
