"""Products by sharded kernels move rows or the kernel: one device's numbers.

Under `ModelParallel`, `ops.matmul`/`ops.einsum` by a sharded kernel (Dense,
EinsumDense, a tied embedding's `matmul(x, transpose(table))`) is one op
(`sharding/contraction.py`) that, step by step, either gathers every
replica's rows and multiplies them by its own block (few rows) or gathers
the kernel (many rows). The model below has layers on both sides of that
choice, kernels split by rows, by columns, over both mesh axes and with
copies, and its last batch is uneven (26 examples at batch 8: 2 rows over 4
replicas, two of them with none). Weights, optimizer state and every logged
number equal one device's: in float64 to 1e-10 (so the paths compute what
one device computes, only summed in another order), in float32 to float
tolerance.
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import keras_replicator as kr
from keras_replicator._src.core import placements
from keras_replicator._src.sharding import contraction
from tests import helpers

# float64 checks that the paths compute what one device computes; float32
# that rounding stays at float tolerance after Adam. TensorFlow 2.19's
# `tf.einsum` of a kernel's block of heads is not the whole einsum's to the
# bit, as 2.20's and 2.21's is (a block's `matmul` is on all three): there
# an EinsumDense's last-bit differences grow to 2.6e-5 of the weights here
# (DataParallel: 9e-7; float64 still 1e-10; the 4 x Dense(2048) model of
# `benchmarks/memory.py`: 2.3e-6 on both).
# float32: after Adam's steps, an element whose gradient is near Adam's
# epsilon turns the gradients' last-bit differences (each device sums its
# 1/N of the batch, then the blocks are summed across devices) into a
# visible step. How large depends on the CPU's kernels: within 2e-5 of
# the largest weight on the Intel Xeon VMs of earlier CI runs, 5.0e-5 on
# an AMD EPYC VM (2026-12-02), and up to 5e-5 on TensorFlow before 2.20.
# The gradients themselves agree to rounding (SGD: tests/test_distribution.py).
TOL = {"float32": 1e-4, "float64": 1e-10}


@pytest.fixture(autouse=True)
def no_distribution():
    keras.distribution.set_distribution(None)
    yield
    keras.distribution.set_distribution(None)


class TiedLogits(keras.layers.Layer):
    """Logits by a table's transpose, as keras-hub's tied embeddings do."""

    def build(self, input_shape):
        self.table = self.add_weight(
            shape=(48, input_shape[-1]),
            initializer="glorot_uniform",
            name="table",
        )

    def call(self, x):
        return ops.matmul(x, ops.transpose(self.table))


def _model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((2, 32))
    # "btd,ndh->btnh": rows of 64 in, 128 out against a 2048 kernel.
    h = keras.layers.EinsumDense(
        "btd,ndh->btnh", (2, 4, 16), activation="tanh", name="heads"
    )(inputs)
    h = keras.layers.Reshape((128,))(h)
    h = keras.layers.Dense(32, activation="relu", name="wide")(h)
    h = keras.layers.Dense(32, name="tied_in")(h)
    logits = TiedLogits(name="tied")(h)
    # 48 x 5 = 240 values: rows of 53 move on the last batch (4 x 1 x 53),
    # the kernel moves on full ones (4 x 2 x 53).
    outputs = keras.layers.Dense(5, name="small")(logits)
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"]
    )
    return model


def _data():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(26, 2, 32)).astype("float32")
    y = rng.normal(size=(26, 5)).astype("float32")
    return x, y


def _fit(static=False):
    model = _model()
    x, y = _data()
    if static:
        # Batches of a shape known when traced (24 rows, batch 8): each
        # product's path is chosen then, not in the graph.
        x = tf.data.Dataset.from_tensor_slices((x[:24], y[:24])).batch(
            8, drop_remainder=True
        )
        y = None
    kwargs = {} if static else {"batch_size": 8}
    history = model.fit(x, y, epochs=2, verbose=0, shuffle=False, **kwargs)
    evaluated = model.evaluate(x, y, verbose=0, **kwargs)
    predicted = model.predict(
        x.map(lambda x, y: x) if static else x, verbose=0, **kwargs
    )
    return model, history.history, evaluated, predicted


@functools.cache
def _reference(floatx, static=False):
    keras.distribution.set_distribution(None)
    with helpers.floatx(floatx):
        return _fit(static)


def _close(a, b, tol=TOL["float32"]):
    a, b = np.asarray(a), np.asarray(b)
    scale = max(float(np.max(np.abs(a))), 1e-6)
    assert float(np.max(np.abs(a - b))) <= tol * scale, (
        float(np.max(np.abs(a - b))),
        scale,
    )


_model_parallel = helpers.model_parallel


_LAYOUTS = {
    "1x4": (
        (1, 4),
        {
            "heads/kernel": ("model", None, None),
            "wide/kernel": (None, "model"),
            "tied_in/kernel": ("model", None),
            "tied/table": ("model", None),
            "small/kernel": ("model", None),
        },
    ),
    "2x2": (
        (2, 2),
        {
            "heads/kernel": (None, "batch", "model"),
            "wide/kernel": ("batch", "model"),
            # Split over one axis of two: each block on 2 devices.
            "tied_in/kernel": (None, "model"),
            "tied/table": ("model", "batch"),
            "small/kernel": ("batch", None),
        },
    ),
}


@pytest.mark.parametrize(
    "name, floatx, static",
    [
        # 1x4 in float32 only: 2x2 holds float64's tighter bound.
        ("1x4", "float32", False),
        ("2x2", "float64", False),
        ("2x2", "float64", True),
    ],
)
def test_both_paths_give_one_devices_numbers(name, floatx, static):
    reference, h0, e0, p0 = _reference(floatx, static)
    shape, layouts = _LAYOUTS[name]
    keras.distribution.set_distribution(_model_parallel(shape, layouts))
    with helpers.floatx(floatx):
        model, h1, e1, p1 = _fit(static)
    assert model.compute_dtype == reference.compute_dtype == floatx
    close = functools.partial(_close, tol=TOL[floatx])
    for layer in ("heads", "wide", "tied_in", "tied", "small"):
        assert placements.of(model.get_layer(layer).weights[0]) is not None
    # Where it ran: 4 devices, each holding its block of the kernel.
    wide = kr.shard_shapes(model.get_layer("wide").kernel)
    assert len(wide) == 4
    assert set(wide.values()) == {(128, 8) if name == "1x4" else (64, 16)}
    # Dense and EinsumDense gather their kernels (if at all) inside the op:
    # not rematerialised. The custom layer is.
    assert not hasattr(model.get_layer("wide"), "_keras_replicator_remat")
    assert not hasattr(model.get_layer("heads"), "_keras_replicator_remat")
    assert model.get_layer("tied")._keras_replicator_remat
    assert h0.keys() == h1.keys()
    for key in h0:
        close(h0[key], h1[key])
    close(e0, e1)
    close(p0, p1)
    for a, b in zip(reference.get_weights(), model.get_weights(), strict=True):
        close(a, b)
    for a, b in zip(
        reference.optimizer.variables, model.optimizer.variables, strict=True
    ):
        close(a.numpy(), b.numpy())


@pytest.mark.parametrize(
    "equation, kernel_rank, found",
    [
        ("ab,bc->ac", 2, ("ab", "bc", "ac")),
        ("btd,ndh->btnh", 3, ("btd", "ndh", "btnh")),
        ("btnh,nhd->btd", 3, ("btnh", "nhd", "btd")),
        ("ay,zy->az", 2, ("ay", "zy", "az")),
        # Not a dense layer's contraction: left to the stock op.
        ("...b,bc->...c", 2, None),
        ("ab,bc->ca", 2, None),  # the batch is not the output's first axis
        ("ab,ab->a", 2, None),  # a kernel label in x and the output
        ("ab,bc->abc", 2, None),
        ("ab,bc,cd->ad", 2, None),
        ("ab,bc->ac", 3, None),
    ],
)
def test_which_contractions_take_the_op(equation, kernel_rank, found):
    assert contraction.parse(equation, kernel_rank) == found


def test_a_transposed_view_read_elsewhere_is_the_gathered_transpose():
    keras.distribution.set_distribution(
        _model_parallel((1, 4), {"tied/table": ("model", None)})
    )
    model = _model()
    table = model.get_layer("tied").table
    strategy = table._value.distribute_strategy

    @tf.function
    def step():
        def replica_fn():
            view = ops.transpose(table)
            assert isinstance(view, contraction.Transposed)
            assert tuple(view.shape) == (32, 48)
            # Anything but matmul converts it: the whole table, transposed.
            return ops.add(view, 1.0) - 1.0, view * 2.0

        return strategy.run(replica_fn)

    added, doubled = step()
    whole = np.transpose(table.numpy())
    for replica in strategy.experimental_local_results(added):
        _close(whole, replica.numpy())
    for replica in strategy.experimental_local_results(doubled):
        _close(2.0 * whole, replica.numpy())


def _lookup_model():
    keras.utils.set_random_seed(4)
    inputs = keras.Input((3,), dtype="int32")
    h = keras.layers.Embedding(40, 16, name="table")(inputs)
    h = keras.layers.Flatten()(h)
    outputs = keras.layers.Dense(5, name="head")(h)
    model = keras.Model(inputs, outputs)
    # Adam: a sparse gradient's repeated ids are squared one by one, so a
    # dense or reordered gradient would give other numbers.
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    return model


def _lookup_fit():
    rng = np.random.default_rng(6)
    # Repeated ids, and negative ones (Keras' `take` counts them from the
    # end); 26 rows at batch 8: an uneven last batch.
    ids = rng.integers(-40, 40, size=(26, 3)).astype("int32")
    ids[:, 1] = ids[:, 0]
    y = rng.normal(size=(26, 5)).astype("float32")
    model = _lookup_model()
    history = model.fit(
        ids, y, batch_size=8, epochs=2, verbose=0, shuffle=False
    )
    return model, history.history


@functools.cache
def _lookup_reference():
    keras.distribution.set_distribution(None)
    return _lookup_fit()


@pytest.mark.parametrize(
    "shape, axes, block",
    [
        ((1, 4), ("model", None), (10, 16)),
        ((1, 4), (None, "model"), (40, 4)),
        ((2, 2), ("model", "batch"), (20, 8)),
    ],
    ids=["rows", "columns", "both"],
)
def test_a_sharded_lookup_moves_rows_with_one_devices_sparse_numbers(
    shape, axes, block
):
    reference, h0 = _lookup_reference()
    keras.distribution.set_distribution(
        _model_parallel(shape, {"table/embeddings": axes})
    )
    model, h1 = _lookup_fit()
    table = model.get_layer("table")
    assert placements.of(table.embeddings) is not None
    blocks = kr.shard_shapes(table.embeddings)
    assert len(blocks) == 4
    assert set(blocks.values()) == {block}
    assert not hasattr(table, "_keras_replicator_remat")
    _close(h0["loss"], h1["loss"])
    for a, b in zip(reference.get_weights(), model.get_weights(), strict=True):
        _close(a, b)
    for a, b in zip(
        reference.optimizer.variables, model.optimizer.variables, strict=True
    ):
        _close(a.numpy(), b.numpy())


def _fit_both(strategy):
    """The products model and the lookup model fitted in `strategy`."""
    x, y = _data()
    ids = np.random.default_rng(6).integers(0, 40, size=(26, 3))
    with strategy.scope():
        products, lookup = _model(), _lookup_model()
    return [
        (
            model,
            model.fit(
                inputs, y, batch_size=8, epochs=2, verbose=0, shuffle=False
            ).history,
        )
        for model, inputs in ((products, x), (lookup, ids.astype("int32")))
    ]


def test_with_nothing_sharded_the_patched_products_are_stock(restore_patches):
    # The patched matmul/einsum/transpose/take act on sharded kernels only:
    # with nothing sharded, a plain replicator and stock MirroredStrategy
    # fit these models (the einsum, the tied transpose, the lookup with its
    # sparse gradient) to unpatched stock MirroredStrategy's numbers.
    restore_patches.uninstall_all()
    stock = _fit_both(helpers.stock_mirrored())
    ours = kr.LocalReplicator(2)  # installs every patch of its kind
    assert restore_patches.installed("sharded_variables")
    for fitted in (_fit_both(ours), _fit_both(helpers.stock_mirrored())):
        for (model, history), (expected, expected_history) in zip(
            fitted, stock, strict=True
        ):
            _close(expected_history["loss"], history["loss"])
            for a, b in zip(
                expected.get_weights(), model.get_weights(), strict=True
            ):
                _close(a, b)


@pytest.fixture
def chosen(monkeypatch):
    """The paths the products choose (`contraction._choose`), in order."""
    paths = []
    choose = contraction._choose

    def spy(moving, moving_fn, kernel_fn):
        paths.append(moving)
        return choose(moving, moving_fn, kernel_fn)

    monkeypatch.setattr(contraction, "_choose", spy)
    return paths


def _embedding_mlp():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(64, 32, name="emb")(inputs)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(256, activation="relu", name="d0")(h)
    h = keras.layers.Dense(256, activation="relu", name="d1")(h)
    outputs = keras.layers.Dense(4, name="d2", dtype="float32")(h)
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


@pytest.mark.parametrize(
    "policy, mesh, static",
    [
        ("mixed_bfloat16", (1, 4), True),
        ("mixed_float16", (1, 4), True),
        # Blocks with copies (zeros from the copies), batches of unknown
        # size (the path chosen in the graph), an uneven last batch.
        ("mixed_bfloat16", (2, 2), False),
    ],
)
def test_16_bit_products_move_rows_as_close_to_one_device_as_data_parallel(
    policy, mesh, static, chosen
):
    # Mixed precision: float32 weights, 16-bit products. Rows move; a column
    # block is one device's to the bit, a product split along its
    # contraction is summed in float32 and rounded once, and a block's
    # gradient is computed from every row at once, as on one device. So a
    # step's kernel updates are about as close to one device's as
    # DataParallel's (whose replicas each round their own gradient to 16
    # bits), or closer.
    # (Over many steps 16-bit differences grow chaotically in any
    # replicated run: there the test asks for one device's losses.)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 64, size=(58, 6)).astype("int32")
    y = rng.normal(size=(58, 4)).astype("float32")
    if static:
        data = tf.data.Dataset.from_tensor_slices((x[:48], y[:48])).batch(
            16, drop_remainder=True
        )
    else:
        # Through a transformation the batch hint does not follow
        # (`contraction.batch_hint`): batches of a size unknown to the
        # loop, so the path is chosen in the graph.
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
        data = data.apply(tf.data.experimental.assert_cardinality(4))
    layouts = {
        ".*d0/kernel": (None, "model"),
        ".*d1/kernel": ("model", None),
        ".*emb/embeddings": ("model", None),
    }
    kernels = ("emb", "d0", "d1")
    ulp = 2.0**-8 if policy == "mixed_bfloat16" else 2.0**-11
    saved = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        step, losses, predicted = {}, {}, {}
        for name, distribution in (
            ("one", None),
            ("model", _model_parallel(mesh, layouts)),
            ("data", keras.distribution.DataParallel(
                devices=keras.distribution.list_devices()[:4]
            )),
        ):  # fmt: skip
            keras.distribution.set_distribution(distribution)
            model = _embedding_mlp()
            predicted[name] = model.predict(x[:48], batch_size=16, verbose=0)
            if name == "model":
                chosen.clear()  # the paths of fit's steps, below
            # Read under its own distribution (its replicator's scope).
            before = [layer.weights[0].numpy() for layer in map(
                model.get_layer, kernels
            )]  # fmt: skip
            model.fit(data.take(1), verbose=0, shuffle=False)
            step[name] = [
                model.get_layer(k).weights[0].numpy() - b
                for k, b in zip(kernels, before, strict=True)
            ]
            history = model.fit(data, epochs=2, verbose=0, shuffle=False)
            losses[name] = history.history["loss"]
            if name == "model":
                d1 = model.get_layer("d1")
                assert d1.compute_dtype == policy[len("mixed_") :]
                blocks = set(kr.shard_shapes(d1.kernel).values())
                assert blocks == {(256 // mesh[1], 256)}
    finally:
        keras.config.set_dtype_policy(saved)
    # Every product moved rows: decided when traced (static batches), or in
    # the graph.
    if static:
        assert chosen and all(moving is True for moving in chosen), chosen
    else:
        assert chosen and all(tf.is_tensor(moving) for moving in chosen)
    scale = float(np.abs(predicted["one"]).max())
    # Two 16-bit ulps of the largest output: bfloat16 products were within
    # one ulp on the Intel Xeon VMs of earlier CI runs, and are 1.05 ulps
    # off on an AMD EPYC VM (2026-12-02), whose CPU kernels round a long
    # contraction's partial sums another way.
    assert np.abs(predicted["model"] - predicted["one"]).max() <= 2 * (
        ulp * scale
    )
    for kernel, one, ours, data_parallel in zip(
        kernels, step["one"], step["model"], step["data"], strict=True
    ):
        error = np.abs(ours - one).max() / np.abs(one).max()
        data_error = np.abs(data_parallel - one).max() / np.abs(one).max()
        # A quarter of a 16-bit ulp of slack sufficed on the Intel Xeon VMs
        # of earlier CI runs (float16 products on the CPU are not float32's
        # rounded once; bfloat16's were, to the bit). On an AMD EPYC VM
        # (2026-12-02) a column block's bfloat16 product is up to 1.05 ulps
        # from the same columns of the whole product (the forward pass
        # above), and the embedding's step 1.2 ulps: 1.5 ulps of slack.
        assert error <= data_error + 1.5 * ulp, (kernel, error, data_error)
    np.testing.assert_allclose(losses["model"], losses["one"], rtol=1e-3)


def _dense_model(names=("d",), width=64):
    """Dense(`width`) layers named `names`, every kernel `(None, "model")`
    on a (1, 4) mesh, compiled with SGD and MSE."""
    pattern = ".*(" + "|".join(names) + ")/kernel"
    keras.distribution.set_distribution(
        _model_parallel((1, 4), {pattern: (None, "model")})
    )
    model = keras.Sequential(
        [
            keras.Input((width,)),
            *(keras.layers.Dense(width, name=name) for name in names),
        ]
    )
    model.compile("sgd", "mse")
    return model


@pytest.mark.parametrize(
    "policy, moves", [("float32", False), ("mixed_bfloat16", True)]
)
def test_the_path_is_chosen_by_bytes(policy, moves, chosen):
    # A 64 x 64 kernel, 48 rows of 64 in and 64 out over 4 replicas: 6144
    # values of rows against 4096 of kernel. In float32 the kernel is fewer
    # bytes (16 KiB against 24); with bfloat16 rows it is more (16 KiB
    # against 12).
    saved = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        model = _dense_model()
        x = np.ones((48, 64), "float32")
        data = tf.data.Dataset.from_tensors((x, x))
        model.fit(data, verbose=0, shuffle=False)
    finally:
        keras.config.set_dtype_policy(saved)
    assert chosen and all(moving is moves for moving in chosen), chosen


@pytest.mark.parametrize(
    "data, when",
    [
        ("arrays", "traced"),
        # As keras-hub's tasks feed arrays: batched, mapped, prefetched.
        ("batched", "traced"),
        # Rows the element spec fixes, past a transformation not followed.
        ("fixed_rows", "traced"),
        ("unknown", "graph"),
    ],
)
def test_a_known_global_batch_chooses_the_path_when_traced(data, when, chosen):
    # The step's batch dimension is None (the last batch may be smaller);
    # with the loop's global batch known, each product still picks its
    # path when traced, from a full batch's rows, and traces one path.
    model = _dense_model()
    x = np.ones((40, 64), "float32")
    kwargs = {}
    if data == "arrays":
        inputs = (x, x)
        kwargs["batch_size"] = 16
    elif data == "batched":
        inputs = (
            tf.data.Dataset.from_tensor_slices((x, x))
            .batch(16)
            .map(lambda a, b: (a, b), num_parallel_calls=tf.data.AUTOTUNE)
            .prefetch(2),
        )
    elif data == "fixed_rows":
        inputs = (
            tf.data.Dataset.from_tensor_slices((x, x))
            .batch(16, drop_remainder=True)
            .apply(tf.data.experimental.assert_cardinality(2)),
        )
    else:
        # A transformation the hint does not follow: an unknown batch.
        inputs = (
            tf.data.Dataset.from_tensor_slices((x, x))
            .batch(16)
            .apply(tf.data.experimental.assert_cardinality(3)),
        )
    model.fit(*inputs, verbose=0, shuffle=False, **kwargs)
    assert chosen, chosen
    if when == "traced":
        # 16 rows of 64 + 64 floats against a 64 x 64 kernel: rows move.
        assert all(moving is True for moving in chosen), chosen
    else:
        assert all(tf.is_tensor(moving) for moving in chosen), chosen


def test_the_input_datas_gradient_is_neither_computed_nor_summed(
    monkeypatch, chosen
):
    # Two Dense layers moving rows: each sums its output in the forward
    # pass; in the backward pass only the second sums its input gradient.
    # The first layer's input is the data, which no tape records: one
    # device prunes that gradient, and a sum (a collective, which always
    # runs) would be a wasted exchange per step.
    sums = []
    summed = contraction._Rows.summed_own

    def spy(self, part, slices):
        sums.append(part.shape)
        return summed(self, part, slices)

    monkeypatch.setattr(contraction._Rows, "summed_own", spy)
    model = _dense_model(("d0", "d1"))
    x = np.ones((32, 64), "float32")
    model.fit(x, x, batch_size=16, epochs=1, verbose=0, shuffle=False)
    assert chosen and all(moving is True for moving in chosen), chosen
    # Per replica (4 traced): two forward sums and one backward sum.
    assert len(sums) == 4 * 3, sums


def test_with_no_tape_tf_gradients_gets_the_input_gradient():
    # `tf.gradients` differentiates a graph with no tape: nothing records
    # the input, yet its gradient is asked for, and must be one device's.
    keras.utils.set_random_seed(0)
    model = _dense_model(("d0", "d1"))
    strategy = model.get_layer("d0").kernel._value.distribute_strategy

    @tf.function
    def step():
        def replica_fn():
            x = tf.ones([8, 64])
            return tf.gradients(tf.reduce_sum(model(x)), x)[0]

        return strategy.run(replica_fn)

    w0 = model.get_layer("d0").kernel.numpy()
    w1 = model.get_layer("d1").kernel.numpy()
    expected = np.ones([8, 64], "float32") @ (w0 @ w1).T
    for dx in strategy.experimental_local_results(step()):
        _close(expected, dx.numpy())


def _gradient_step(model, rows):
    """The model's strategy, and a step: each replica's gradients of the
    sum of its output for `rows` rows of ones."""
    strategy = model.get_layer("d0").kernel._value.distribute_strategy

    @tf.function
    def step():
        def replica_fn():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(tf.ones([rows, 64])))
            return tape.gradient(loss, model.trainable_variables)

        return strategy.run(replica_fn)

    return strategy, step


def test_products_exchange_only_each_devices_rows_and_columns():
    # A device needs only its own rows of a product's output, and only its
    # block's columns of the output gradients: one all-to-all sends each
    # device just that. A sum of the whole mesh's output (an all-reduce of
    # it) would send 2N times the bytes, a gather of whole gradients N.
    model = _dense_model(("d0", "d1"))
    strategy, step = _gradient_step(model, 8)
    graph = step.get_concrete_function().graph
    ops = graph.get_operations()
    per_replica = 4
    exchanges = [op for op in ops if op.type == "CollectiveAllToAllV2"]
    # Per replica: each layer's output; each layer's block of its output
    # gradients; d1's input gradient (d0's input is data: none).
    assert len(exchanges) == per_replica * 5, len(exchanges)
    # No sum carries rows: what sums remain are scalars (the gradient
    # weights' total).
    sums = [op for op in ops if op.type == "CollectiveReduceV2"]
    for op in sums:
        assert op.inputs[0].shape.num_elements() in (1, 2), op.inputs[0]


def test_a_moving_kernel_gathers_no_row_counts():
    # 48 rows of 64 in and 64 out against a 64 x 64 float32 kernel, over
    # 4 replicas: the kernel is fewer bytes, chosen when traced (rows known
    # then). That path gathers the kernel in the forward pass and again in
    # the backward pass, and sums its gradient; each replica's row count is
    # never read, so no gather exchanges it (a collective, which always
    # runs: a wasted step-wide wait per product).
    model = _dense_model(("d0", "d1"))
    strategy, step = _gradient_step(model, 48)
    graph = step.get_concrete_function().graph
    gathers = [
        op for op in graph.get_operations() if op.type == "CollectiveGatherV2"
    ]
    # Per replica and layer: the kernel, forward and backward; no rows.
    assert len(gathers) == 4 * 2 * 2, [op.inputs[0].shape for op in gathers]
    for op in gathers:
        assert op.inputs[0].shape.num_elements() == 64 * 16, op.inputs[0]
    grads = strategy.experimental_local_results(step())
    w0 = model.get_layer("d0").kernel.numpy()
    # d sum(x @ w0 @ w1) / d w1 over the 48 rows: each replica's block of
    # columns, cut from the full gradients summed over the replicas.
    expected = (np.ones([48, 64], "float32") @ w0).T @ np.ones([48, 64])
    # (Every replica has the same 48 rows; the blocks are of their mean.)
    for replica, per_replica in enumerate(grads):
        columns = slice(16 * replica, 16 * (replica + 1))
        _close(expected[:, columns], per_replica[2].numpy())


def test_rows_of_other_trailing_dimensions_fail_on_every_replica():
    # A custom loop whose replicas pad their own sequences differently:
    # rows of 3 x 64 values on replica 0, of 2 x 64 elsewhere. Rows travel
    # as equal flat pieces, so each replica's values per row are checked
    # in the gather of the row counts; the step fails, on every replica,
    # instead of multiplying misplaced values (or waiting on a replica).
    keras.distribution.set_distribution(
        _model_parallel((1, 4), {".*d/kernel": (None, "model")})
    )
    layer = keras.layers.Dense(64, name="d")
    layer.build((None, None, 64))
    strategy = layer.kernel._value.distribute_strategy

    def batch(context):
        length = 3 if context.replica_id_in_sync_group == 0 else 2
        return tf.ones([2, length, 64])

    x = strategy.experimental_distribute_values_from_function(batch)

    @tf.function
    def step(x):
        return strategy.run(layer, (x,))

    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match="other_trailing_dimensions_on_another_replica",
    ):
        step(x)
    # Rows of one shape on every replica: one device's product.
    same = strategy.experimental_distribute_values_from_function(
        lambda context: tf.ones([2, 3, 64])
    )
    for y in strategy.experimental_local_results(step(same)):
        _close(np.ones([2, 3, 64]) @ layer.kernel.numpy(), y.numpy())
