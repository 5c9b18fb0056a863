"""The dataset sharder, in process: per-pipeline logic, shapes, evaluation."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator._src.data import shard_sources

NUM_FILES = 7
RECORDS_PER_FILE = 1000


@pytest.fixture(scope="module")
def record_files(tmp_path_factory):
    """7 TFRecord files of 1,000 records; each record holds its id."""
    root = tmp_path_factory.mktemp("records")
    paths = []
    for f in range(NUM_FILES):
        path = str(root / f"part-{f}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for r in range(RECORDS_PER_FILE):
                writer.write(str(f * RECORDS_PER_FILE + r).encode())
        paths.append(path)
    return paths


def _ids(record):
    return tf.strings.to_number(record, tf.int64)


def _pipeline_ids(input_fn, num_pipelines, replicas):
    """The ids each pipeline yields, as one array per pipeline."""
    out = []
    for i in range(num_pipelines):
        ctx = tf.distribute.InputContext(num_pipelines, i, replicas)
        batches = list(input_fn(ctx).as_numpy_iterator())
        out.append(batches)
    return out


@pytest.mark.parametrize("num_files", [NUM_FILES, 1])
def test_eval_counts_every_record_once_over_two_pipelines(
    record_files, num_files
):
    files = record_files[:num_files]
    ds = tf.data.TFRecordDataset(files).map(lambda r: (_ids(r), _ids(r)))
    input_fn = kr.data.shard(ds, 64, mode="eval", static_shapes=True)
    pipelines = _pipeline_ids(input_fn, 2, 4)
    assert input_fn.policies[2] == ("file" if num_files > 1 else "element")
    # Equal step counts (per-replica batches) on both pipelines.
    assert len(pipelines[0]) == len(pipelines[1])
    seen = np.concatenate(
        [x[w > 0] for batches in pipelines for x, _, w in batches]
    )
    expected = np.arange(num_files * RECORDS_PER_FILE)
    np.testing.assert_array_equal(np.sort(seen), expected)
    for batches in pipelines:
        for x, _, w in batches:
            assert x.shape == (16,) and w.shape == (16,)


def test_train_uneven_file_shards_run_equal_steps(record_files):
    # 7 files over 2 pipelines: 4,000 versus 3,000 records.
    ds = tf.data.TFRecordDataset(record_files).map(_ids)
    input_fn = kr.data.shard(ds, 64, static_shapes=True, shuffle_seed=3)
    pipelines = _pipeline_ids(input_fn, 2, 4)
    # One epoch is as many global batches as 7,000 records fill.
    assert [len(b) for b in pipelines] == [7000 // 64 * 2] * 2
    assert all(b.shape == (16,) for batches in pipelines for b in batches)


def test_input_fn_reading_its_context_is_not_sharded_again(record_files):
    def input_fn(ctx):
        files = tf.data.Dataset.from_tensor_slices(record_files)
        files = files.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        records = files.interleave(tf.data.TFRecordDataset)
        return records.map(lambda r: (_ids(r), _ids(r)))

    sharded = kr.data.shard(input_fn, 8, mode="eval")
    pipelines = _pipeline_ids(sharded, 2, 2)
    assert sharded.policies[2] == "input_fn"
    seen = np.concatenate([x[w > 0] for b in pipelines for x, _, w in b])
    np.testing.assert_array_equal(np.sort(seen), np.arange(7000))


def test_input_fn_ignoring_its_context_is_sharded_by_element():
    sharded = kr.data.shard(lambda ctx: tf.data.Dataset.range(10), 2)
    pipelines = _pipeline_ids(sharded, 2, 2)
    assert sharded.policies[2] == "element"
    assert [np.concatenate(b).tolist() for b in pipelines] == [
        [0, 2, 4, 6, 8],
        [1, 3, 5, 7, 9],
    ]


def test_tfds_mock_data_eval_counts_every_example_once():
    tfds = pytest.importorskip("tensorflow_datasets")

    def input_fn(ctx):
        read_config = tfds.ReadConfig(input_context=ctx)
        ds = tfds.load(
            "mnist",
            split="train",
            read_config=read_config,
            shuffle_files=False,
        )
        return ds.map(lambda e: (e["image"], e["label"]))

    with tfds.testing.mock_data(num_examples=100):
        sharded = kr.data.shard(input_fn, 8, mode="eval", static_shapes=True)
        pipelines = _pipeline_ids(sharded, 2, 2)
    assert len(pipelines[0]) == len(pipelines[1])
    weights = np.concatenate([w for b in pipelines for _, _, w in b])
    assert weights.sum() == 100
    assert all(x.shape == (4, 28, 28, 1) for b in pipelines for x, _, _ in b)


def test_shuffle_is_seeded_and_differs_per_epoch():
    def epochs(seed):
        replicator = kr.LocalReplicator(2)
        dist = replicator.distribute(
            tf.data.Dataset.range(32), 8, shuffle_seed=seed
        )
        out = []
        for _ in range(2):
            order = []
            for batch in dist:
                order += np.concatenate(
                    [
                        v.numpy()
                        for v in replicator.experimental_local_results(batch)
                    ]
                ).tolist()
            out.append(order)
        return out

    first, second = epochs(7), epochs(7)
    assert first == second
    assert first[0] != first[1]
    assert sorted(first[0]) == list(range(32))
    assert epochs(8)[0] != first[0]


def test_unshuffled_order_matches_single_device_batches():
    replicator = kr.LocalReplicator(2)
    dist = replicator.distribute(tf.data.Dataset.range(16), 8)
    steps = [
        np.concatenate(
            [v.numpy() for v in replicator.experimental_local_results(b)]
        ).tolist()
        for b in dist
    ]
    assert steps == [list(range(8)), list(range(8, 16))]


def test_input_fn_can_be_called_while_tracing():
    # ParameterServerStrategy (AsyncReplicator) calls input functions in a
    # tf.function, where cardinality is symbolic: it used to fail with
    # "int() argument must be ... not 'SymbolicTensor'".
    examples = tf.data.Dataset.range(10).map(lambda i: (i, i % 2))
    input_fn = kr.data.shard(examples, 4, mode="eval")
    ctx = tf.distribute.InputContext(1, 0, 1)

    @tf.function
    def first_batch():
        return next(iter(input_fn(ctx)))

    x, y, weight = first_batch()
    assert x.numpy().tolist() == [0, 1, 2, 3]
    assert y.numpy().tolist() == [0, 1, 0, 1]
    assert weight.numpy().tolist() == [1, 1, 1, 1]


def test_rejects_indivisible_global_batch():
    replicator = kr.LocalReplicator(4)
    with pytest.raises(ValueError, match="global_batch_size=6, num_replicas"):
        replicator.distribute(tf.data.Dataset.range(8), 6)


def test_rejects_bad_arguments():
    ds = tf.data.Dataset.range(8)
    with pytest.raises(ValueError, match="Received: mode='test'"):
        kr.data.shard(ds, 4, mode="test")
    with pytest.raises(ValueError, match="Received: global_batch_size=0"):
        kr.data.shard(ds, 0)
    with pytest.raises(TypeError, match="dataset_or_input_fn=3"):
        kr.data.shard(3, 4)
    with pytest.raises(TypeError, match="In eval mode every example"):
        kr.data.shard(ds, 4, mode="eval")(tf.distribute.InputContext())


def test_static_shapes_need_known_example_shapes():
    ragged = tf.data.Dataset.range(1, 5).map(lambda n: tf.range(n))
    with pytest.raises(ValueError, match="fully known"):
        kr.data.shard(ragged, 2, static_shapes=True)(
            tf.distribute.InputContext()
        )


def test_count_files_sees_interleaved_file_lists(record_files):
    listed = tf.data.Dataset.from_tensor_slices(record_files[:3])
    assert (
        shard_sources.count_files(listed.interleave(tf.data.TFRecordDataset))
        == 3
    )
    assert shard_sources.count_files(tf.data.Dataset.range(3)) is None


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )


def _data(n=1000):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.integers(0, 3, size=(n,)).astype("int32")
    w = rng.uniform(0.5, 2.0, size=(n,)).astype("float32")
    return x, y, w


@pytest.mark.parametrize("jit", [False, True], ids=["graph", "xla"])
def test_static_eval_equals_single_device_evaluation(jit):
    # With jit, XLA compiles each replica's step (see per_replica_jit).
    x, y, w = _data()
    reference = _model()
    reference.compile(
        "sgd",
        "sparse_categorical_crossentropy",
        metrics=["accuracy"],
        weighted_metrics=["accuracy"],
    )
    expected = reference.evaluate(
        x, y, sample_weight=w, batch_size=1000, verbose=0, return_dict=True
    )
    replicator = kr.LocalReplicator(4)
    with replicator.scope():
        model = _model()
        model.compile(
            "sgd",
            "sparse_categorical_crossentropy",
            metrics=["accuracy"],
            weighted_metrics=["accuracy"],
            jit_compile=jit,
        )
    dist = replicator.distribute(
        tf.data.Dataset.from_tensor_slices((x, y, w)),
        64,
        mode="eval",
        static_shapes=True,
    )
    for spec in tf.nest.flatten(dist.element_spec, expand_composites=True):
        assert spec.shape.is_fully_defined(), spec
    got = model.evaluate(dist, verbose=0, return_dict=True)
    for name in ("loss", "accuracy", "weighted_accuracy"):
        assert got[name] == pytest.approx(expected[name], abs=1e-5), name


def test_static_fit_with_xla_matches_single_device():
    x, y, _ = _data(256)
    reference = _model()
    reference.compile("sgd", "sparse_categorical_crossentropy")
    reference.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    replicator = kr.LocalReplicator(2)
    with replicator.scope():
        model = _model()
        model.compile(
            "sgd", "sparse_categorical_crossentropy", jit_compile=True
        )
    dist = replicator.distribute(
        tf.data.Dataset.from_tensor_slices((x, y)), 64, static_shapes=True
    )
    model.fit(dist, epochs=2, shuffle=False, verbose=0)
    for a, e in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(a, e, atol=1e-5)


def test_fit_on_four_replicas_matches_single_device():
    x, y, _ = _data(256)
    reference = _model()
    reference.compile("sgd", "sparse_categorical_crossentropy")
    reference.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    replicator = kr.LocalReplicator(4)
    with replicator.scope():
        model = _model()
        model.compile("sgd", "sparse_categorical_crossentropy")
    dist = replicator.distribute(
        tf.data.Dataset.from_tensor_slices((x, y)), 64, static_shapes=True
    )
    model.fit(dist, epochs=2, shuffle=False, verbose=0)
    for a, e in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(a, e, atol=1e-5)
