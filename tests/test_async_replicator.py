"""AsyncReplicator without a cluster: bad input and the Keras patches.

The cluster tests are in tests/multi_worker/test_async.py.
"""

import inspect
import json
import socket

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.backend.tensorflow import core as tf_core
from keras.src.backend.tensorflow import trainer as tf_trainer

import keras_replicator as kr
from keras_replicator._src import patches
from keras_replicator._src.data import worker_shards
from keras_replicator._src.patches import registry
from keras_replicator._src.replicators import async_data
from keras_replicator._src.replicators import async_errors
from keras_replicator._src.replicators import async_ps
from keras_replicator._src.replicators import async_training


def _cluster(task="chief", **jobs):
    ports = iter(range(20000, 20100))
    cluster = {
        job: [f"127.0.0.1:{next(ports)}" for _ in range(n)]
        for job, n in jobs.items()
    }
    return {"cluster": cluster, "task": {"type": task, "index": 0}}


@pytest.mark.parametrize(
    "jobs, missing",
    [
        (dict(chief=1, worker=2), "'ps' job"),
        (dict(chief=1, ps=1), "'worker' job"),
        (dict(worker=2, ps=1), "'chief' job"),
    ],
)
def test_rejects_cluster_without_a_required_job(jobs, missing):
    task = "chief" if "chief" in jobs else "worker"
    with pytest.raises(ValueError, match=missing) as info:
        kr.AsyncReplicator(cluster=_cluster(task, **jobs))
    assert "Received: cluster={" in str(info.value)


def test_rejects_missing_cluster(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(ValueError, match="Received: cluster=None"):
        kr.AsyncReplicator()


@pytest.mark.parametrize(
    "value, error, text",
    [
        ("big", TypeError, "Received: variable_partitioner='big'"),
        (0, ValueError, "Received: variable_partitioner=0"),
    ],
)
def test_rejects_bad_variable_partitioner(value, error, text):
    cluster = _cluster(chief=1, worker=1, ps=2)
    with pytest.raises(error, match=text):
        kr.AsyncReplicator(cluster=cluster, variable_partitioner=value)


def test_min_shard_bytes_shards_over_every_ps():
    config = kr._src.cluster.config.parse_tf_config(
        _cluster(chief=1, worker=1, ps=3)
    )
    partitioner = async_ps._partitioner(1024, config)
    # 1,000 rows of 64 float32 = 256 KB: capped at one shard per ps.
    assert partitioner(tf.TensorShape([1000, 64]), tf.float32) == [3, 1]
    assert partitioner(tf.TensorShape([4, 64]), tf.float32) == [1, 1]


@pytest.mark.parametrize("steps", [None, 0, 2.5, True])
def test_fit_rejects_missing_or_bad_steps_per_epoch(steps):
    model = _compiled_model()
    with pytest.raises(ValueError, match=f"Received: steps_per_epoch={steps}"):
        async_training.fit(
            model,
            None,
            x=np.zeros((4, 3)),
            y=np.zeros((4, 1)),
            epochs=1,
            steps_per_epoch=steps,
        )


def test_fit_rejects_unsupported_arguments():
    model = _compiled_model()
    with pytest.raises(ValueError, match="Received: class_weight="):
        async_training.fit(
            model,
            None,
            x=np.zeros((4, 3)),
            steps_per_epoch=1,
            class_weight={0: 1.0},
        )


def test_source_rejects_targets_with_a_dataset():
    dataset = tf.data.Dataset.from_tensor_slices(np.zeros((4, 3))).batch(2)
    with pytest.raises(ValueError, match="Received: y="):
        async_data.Source(dataset, y=np.zeros(4))
    with pytest.raises(ValueError, match="Received: x=None"):
        async_data.Source(None)


def test_source_rejects_a_distributed_dataset():
    distributed = tf.distribute.MirroredStrategy(
        ["/cpu:0"]
    ).experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(np.zeros((4, 3))).batch(2)
    )
    with pytest.raises(ValueError, match="not a distributed dataset"):
        async_data.Source(distributed)


def test_worker_input_counts_one_pass_and_evaluates_every_example_once():
    x = np.arange(10, dtype="float32").reshape(10, 1)
    examples = tf.data.Dataset.from_tensor_slices((x, x[:, 0] * 2))
    train = worker_shards.WorkerShardedInput(examples, 4)
    # 10 examples in steps of 4 (one step, one worker): 2 full steps.
    assert train.examples == 10 and train.steps_per_epoch == 2
    evaluation = worker_shards.WorkerShardedInput(examples, 4, mode="eval")
    assert evaluation.steps_per_epoch == 3
    batches = list(evaluation.local_dataset())
    assert [len(b[0]) for b in batches] == [4, 4, 2]
    assert float(sum(tf.reduce_sum(b[2]) for b in batches)) == 10.0
    # Rebuilt from the graph sent to the workers: the same examples.
    rebuilt = [float(e[0][0]) for e in train.examples_dataset()]
    assert rebuilt == [float(i) for i in range(10)]
    assert async_data.Source(train).steps_per_epoch == 2


def test_worker_input_from_shard_keeps_its_options():
    examples = tf.data.Dataset.range(8)
    sharded = kr.data.shard(examples, 4, shuffle_seed=3, mode="train")
    source = async_data.Source(sharded)
    assert source.examples.global_batch_size == 4
    assert source.examples.shuffle_seed == 3
    assert source.steps_per_epoch == 2


def test_worker_input_rejects_bad_arguments():
    examples = tf.data.Dataset.range(8)
    with pytest.raises(ValueError, match="Received: mode='test'"):
        worker_shards.WorkerShardedInput(examples, 4, mode="test")
    with pytest.raises(ValueError, match="Received: global_batch_size=0"):
        worker_shards.WorkerShardedInput(examples, 0)
    with pytest.raises(TypeError, match="Received: dataset_or_input_fn=3"):
        worker_shards.WorkerShardedInput(3, 4)
    with pytest.raises(ValueError, match="Received: y="):
        async_data.Source(
            worker_shards.WorkerShardedInput(examples, 4), y=np.zeros(8)
        )


def test_fit_of_unknown_size_names_both_fixes():
    model = _compiled_model()
    unknown = tf.data.Dataset.range(8).filter(lambda i: i > 0)
    with pytest.raises(ValueError) as info:
        async_training.fit(
            model,
            None,
            x=worker_shards.WorkerShardedInput(unknown, 4),
            epochs=1,
        )
    assert "replicator.distribute(examples, global_batch_size)" in str(
        info.value
    )
    assert str(info.value).endswith("Received: steps_per_epoch=None")


class _FakeRemoteValue:
    def fetch(self):
        return [np.float32(1.5), np.int32(2)]

    def get(self):
        return [tf.constant(1.5), tf.constant(2)]


def test_remote_value_puts_back_none_leaves():
    outputs = {"loss": 0.0, "aux": None, "pair": (None, 0)}
    none_leaves = tf.nest.map_structure(lambda v: v is None, outputs)
    remote = async_ps._RemoteValueWithNones(_FakeRemoteValue(), none_leaves)
    assert isinstance(
        remote, tf.distribute.experimental.coordinator.RemoteValue
    )
    assert remote.fetch() == {"loss": 1.5, "aux": None, "pair": (None, 2)}
    got = remote.get()
    assert got["aux"] is None and got["pair"][0] is None
    assert float(got["loss"]) == 1.5 and int(got["pair"][1]) == 2


def test_ps_failure_becomes_a_clear_error_naming_the_server():
    config = kr._src.cluster.config.parse_tf_config(
        _cluster(chief=1, worker=1, ps=2)
    )
    error = tf.errors.UnavailableError(
        None,
        None,
        "Graph execution error:\n\nfailed to connect to all addresses\n"
        "Additional GRPC error information from remote target "
        "/job:ps/replica:0/task:1/device:CPU:0 while calling ...",
    )
    with pytest.raises(async_errors.ParameterServerError) as info:
        with async_errors.clear_ps_errors(config):
            raise error
    assert "/job:ps/task:1 (127.0.0.1:20003)" in str(info.value)
    assert "failed to connect to all addresses" in str(info.value)
    # A worker failure, or any other error, passes through unchanged.
    other = tf.errors.InvalidArgumentError(None, None, "bad shape")
    with pytest.raises(tf.errors.InvalidArgumentError):
        with async_errors.clear_ps_errors(config):
            raise other


def test_an_error_naming_no_server_is_checked_against_the_servers():
    # A run got an OutOfRangeError naming no task after a ps was killed.
    alive = socket.socket()
    alive.bind(("127.0.0.1", 0))
    alive.listen()
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()  # nothing listens there now
    try:
        ps = [f"127.0.0.1:{alive.getsockname()[1]}", f"127.0.0.1:{dead_port}"]
        config = kr._src.cluster.config.parse_tf_config(
            {
                "cluster": {
                    "chief": ["127.0.0.1:20000"],
                    "worker": ["127.0.0.1:20001"],
                    "ps": ps,
                },
                "task": {"type": "chief", "index": 0},
            }
        )
        error = tf.errors.OutOfRangeError(None, None, "End of sequence")
        with pytest.raises(async_errors.ParameterServerError) as info:
            with async_errors.clear_ps_errors(config):
                raise error
        assert f"/job:ps/task:1 ({ps[1]})" in str(info.value)
        # With every server answering, the error is the step's own.
        alive_only = kr._src.cluster.config.parse_tf_config(
            {
                "cluster": {
                    "chief": ["127.0.0.1:20000"],
                    "worker": ["127.0.0.1:20001"],
                    "ps": ps[:1],
                },
                "task": {"type": "chief", "index": 0},
            }
        )
        with pytest.raises(tf.errors.OutOfRangeError):
            with async_errors.clear_ps_errors(alive_only):
                raise error
    finally:
        alive.close()


@pytest.fixture
def patched(restore_patches):
    patches.install_for("async")
    return restore_patches


def test_patch_leaves_other_strategies_on_stock_keras(patched):
    replicator = kr.LocalReplicator(num_replicas=2)
    with replicator.scope():
        model = _compiled_model()
    x = np.random.default_rng(0).normal(size=(32, 3)).astype("float32")
    history = model.fit(x, x[:, :1], batch_size=8, epochs=2, verbose=0)
    # Stock fit: 4 batches per epoch, counted once each.
    assert int(model.optimizer.iterations.numpy()) == 8
    assert len(history.history["loss"]) == 2
    variable = keras.Variable(1.0)
    variable.assign_add(2.0)
    variable.assign_sub(0.5)
    assert float(variable.numpy()) == 2.5


def test_uninstall_restores_stock_keras(patched):
    registry = patched
    trainer = tf_trainer.TensorFlowTrainer
    stock = {
        name: registry.original(trainer, name)
        for name in ("fit", "evaluate", "predict")
    }
    assert registry.installed("trainer_loops")
    assert registry.installed("atomic_assign")
    assert "assign_add" in vars(tf_core.Variable)
    registry.uninstall(["trainer_loops", "atomic_assign"])
    for name, method in stock.items():
        assert getattr(trainer, name) is method
    assert "assign_add" not in vars(tf_core.Variable)


def test_async_loops_take_every_argument_of_keras():
    # If a Keras upgrade adds an argument to fit/evaluate/predict, the async
    # loops must learn it (trainer_loops binds Keras' signature).
    trainer = tf_trainer.TensorFlowTrainer
    for name in ("fit", "evaluate", "predict"):
        stock = inspect.signature(registry.original(trainer, name))
        ours = inspect.signature(getattr(async_training, name))
        assert set(stock.parameters) - {"self", "kwargs"} <= set(
            ours.parameters
        ), name


def _compiled_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    return model


def test_auto_picks_async_replicator_for_a_cluster_with_ps(monkeypatch):
    from keras_replicator._src.replicators import auto as auto_lib

    config = _cluster(chief=1, worker=2, ps=1)
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    choice = auto_lib.choose()
    assert choice.backend == "AsyncReplicator"
    assert "parameter servers" in choice.reason
