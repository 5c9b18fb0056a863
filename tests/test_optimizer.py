"""wrap_optimizer: gradients averaged once, compared with one device."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator._src.training import optimizer as optimizer_lib
from tests.helpers import assert_weights_close

FEATURES = 5


def _data(n=128, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1)) + 0.1).astype("float32")
    return x, y


def _model():
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )
    rng = np.random.default_rng(42)
    model.set_weights(
        [rng.normal(scale=0.5, size=w.shape) for w in model.get_weights()]
    )
    return model


def _loss(model, x, y):
    # A plain per-replica mean: no division by the replica count.
    return tf.reduce_mean(tf.square(model(x) - y))


def _single_device(global_batch, steps, opt_fn):
    x, y = _data()
    model, opt = _model(), opt_fn()
    for k in range(steps):
        xb = x[k * global_batch : (k + 1) * global_batch]
        yb = y[k * global_batch : (k + 1) * global_batch]
        with tf.GradientTape() as tape:
            loss = _loss(model, xb, yb)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    return model.get_weights()


def _replicated(replicas, global_batch, calls, opt_fn, wrap=True, **wrap_kw):
    replicator = kr.LocalReplicator(replicas)
    x, y = _data()
    with replicator.scope():
        model = _model()
        opt = opt_fn()
        if wrap:
            opt = replicator.wrap_optimizer(opt, **wrap_kw)

    def input_fn(ctx):
        per_replica = ctx.get_per_replica_batch_size(global_batch)
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(per_replica)

    def step_fn(batch):
        xb, yb = batch
        with tf.GradientTape() as tape:
            loss = _loss(model, xb, yb)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    step = replicator.replicate(step_fn, input_fn)
    for _ in range(calls):
        step()
    return model.get_weights(), opt


def _adam():
    return keras.optimizers.Adam(learning_rate=0.01)


def _sgd():
    return keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)


@pytest.mark.parametrize("opt_fn", [_adam, _sgd], ids=["adam", "sgd"])
def test_four_replicas_match_one_device(opt_fn):
    expected = _single_device(global_batch=16, steps=6, opt_fn=opt_fn)
    actual, _ = _replicated(4, global_batch=16, calls=6, opt_fn=opt_fn)
    assert_weights_close(actual, expected)


def test_plain_optimizer_averages_like_the_wrapper():
    # In `replicate` a plain Keras optimizer averages the replicas'
    # mean-loss gradients too (`patches/replica_mean.py`); stock Keras would
    # sum them, i.e. step 4x too far with plain SGD.
    sgd = lambda: keras.optimizers.SGD(learning_rate=0.05)  # noqa: E731
    expected = _single_device(global_batch=16, steps=1, opt_fn=sgd)
    wrapped, _ = _replicated(4, global_batch=16, calls=1, opt_fn=sgd)
    plain, _ = _replicated(4, 16, calls=1, opt_fn=sgd, wrap=False)
    assert_weights_close(wrapped, expected)
    assert_weights_close(plain, expected)


def test_accumulation_matches_twice_the_batch():
    expected = _single_device(global_batch=32, steps=3, opt_fn=_adam)
    actual, opt = _replicated(
        4, global_batch=16, calls=6, opt_fn=_adam, accumulation_steps=2
    )
    assert_weights_close(actual, expected)
    assert int(opt.iterations.numpy()) == 3


def test_accumulation_on_one_device():
    expected = _single_device(global_batch=16, steps=2, opt_fn=_sgd)
    actual, _ = _replicated(
        1, global_batch=8, calls=4, opt_fn=_sgd, accumulation_steps=2
    )
    assert_weights_close(actual, expected)


@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_compression_stays_close(compression):
    expected = _single_device(global_batch=16, steps=3, opt_fn=_sgd)
    actual, _ = _replicated(
        4, global_batch=16, calls=3, opt_fn=_sgd, compression=compression
    )
    tol = 3e-2 if compression == "bf16" else 3e-3
    assert_weights_close(actual, expected, atol=tol)


def test_model_fit_trains_like_the_plain_optimizer():
    x, y = _data()
    reference = _model()
    reference.compile(_adam(), "mse")
    reference.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)

    replicator = kr.LocalReplicator(4)
    with replicator.scope():
        model = _model()
        model.compile(replicator.wrap_optimizer(_adam()), "mse")
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), reference.get_weights())


def _count_collectives(replicator, num_tensors, **kwargs):
    grads = [tf.ones([50, 10]) * i for i in range(num_tensors)]

    @tf.function
    def run():
        return replicator.run(
            lambda: optimizer_lib.all_reduce_mean(grads, **kwargs)
        )

    graph = run.get_concrete_function().graph
    ops = [op.type for op in graph.get_operations()]
    return sum(t.startswith("CollectiveReduce") for t in ops), run()


def test_gradients_are_packed_not_one_per_tensor():
    replicator = kr.LocalReplicator(2)
    packed, out = _count_collectives(replicator, 20)
    # One pack per replica (20 x 2 KB is far below 32 MiB).
    assert packed == 2
    np.testing.assert_allclose(
        replicator.experimental_local_results(out)[1][7], np.full([50, 10], 7)
    )
    small_packs, _ = _count_collectives(replicator, 20, bytes_per_pack=8000)
    assert 2 < small_packs < 2 * 20


def test_bad_arguments_are_named():
    replicator = kr.LocalReplicator(2)
    with replicator.scope():
        adam = _adam()
    with pytest.raises(ValueError, match="Received: compression='int8'"):
        replicator.wrap_optimizer(adam, compression="int8")
    with pytest.raises(ValueError, match="Received: accumulation_steps=0"):
        replicator.wrap_optimizer(adam, accumulation_steps=0)
    with pytest.raises(TypeError, match="Received: optimizer='adam'"):
        replicator.wrap_optimizer("adam")
    with pytest.raises(ValueError, match="inside `with replicator.scope"):
        replicator.wrap_optimizer(_adam())
    with replicator.scope():
        keras_acc = keras.optimizers.SGD(gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
        replicator.wrap_optimizer(keras_acc)


def test_config_round_trip():
    replicator = kr.LocalReplicator(2)
    with replicator.scope():
        wrapped = replicator.wrap_optimizer(
            _adam(), accumulation_steps=3, compression="bf16"
        )
        config = keras.saving.serialize_keras_object(wrapped)
        again = keras.saving.deserialize_keras_object(config)
    assert isinstance(again, optimizer_lib.ReplicatedOptimizer)
    assert again.accumulation_steps == 3
    assert again.compression == "bf16"
    assert isinstance(again.inner_optimizer, keras.optimizers.Adam)
    assert float(again.learning_rate.numpy()) == pytest.approx(0.01)


def test_checkpoint_restores_mid_accumulation(tmp_path):
    # Train 3 micro-batches with accumulation_steps=2, checkpointing after
    # the 1st (half an accumulation), restore into fresh objects, continue:
    # the same weights as an uninterrupted run.
    x, y = _data()

    def setup(skip_steps=0):
        replicator = kr.LocalReplicator(2)
        with replicator.scope():
            model = _model()
            opt = replicator.wrap_optimizer(_adam(), accumulation_steps=2)
            opt.build(model.trainable_variables)

        def input_fn(ctx):
            data = tf.data.Dataset.from_tensor_slices((x, y))
            data = data.batch(ctx.get_per_replica_batch_size(16))
            # A global step takes one per-replica batch per replica.
            return data.skip(skip_steps * ctx.num_replicas_in_sync)

        def step_fn(batch):
            with tf.GradientTape() as tape:
                loss = _loss(model, *batch)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply(grads, model.trainable_variables)

        checkpoint = tf.train.Checkpoint(model=model, optimizer=opt)
        return model, replicator.replicate(step_fn, input_fn), checkpoint

    model, step, _ = setup()
    for _ in range(3):
        step()
    expected = model.get_weights()

    model, step, checkpoint = setup()
    step()
    path = checkpoint.save(str(tmp_path / "ckpt"))
    model, step, checkpoint = setup(skip_steps=1)
    checkpoint.restore(path).assert_consumed()
    for _ in range(2):
        step()
    assert_weights_close(model.get_weights(), expected)
