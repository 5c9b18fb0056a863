"""`kr.auto_layout_map`: ModelParallel with no keys written.

Each case builds a real Keras model under `ModelParallel(layout_map=
kr.auto_layout_map(mesh))`, asserts where each weight lives
(`kr.shard_shapes`) and compares a few Adam steps with one device.
"""

import functools

import keras
import numpy as np
import pytest

import keras_replicator as kr
from tests import helpers
from tests.test_distribution import _same_history
from tests.test_distribution import _same_weights
from tests.test_distribution import no_distribution  # noqa: F401

# Small enough that the small models below have split weights; the biases
# (under 256 bytes) stay whole.
MIN_BYTES = 256


def _auto(shape, **kwargs):
    mesh = helpers.device_mesh(shape)
    layout_map = kr.auto_layout_map(mesh, min_bytes=MIN_BYTES, **kwargs)
    return layout_map, keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )


def _model(names=("emb", "q", "conv", "d1", "d2")):
    """Embedding, EinsumDense (heads), Conv1D and Dense layers, seeded."""
    emb, q, conv, d1, d2 = names
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(32, 8, name=emb)(inputs)
    # (hidden 8, heads 4, head size 4).
    h = keras.layers.EinsumDense("abc,cde->abde", (None, 4, 4), name=q)(h)
    h = keras.layers.Reshape((6, 16))(h)
    h = keras.layers.Conv1D(8, 3, activation="tanh", name=conv)(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(16, activation="tanh", name=d1)(h)
    outputs = keras.layers.Dense(3, name=d2)(h)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def _fit(model):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 32, size=(48, 6)).astype("int32")
    y = rng.normal(size=(48, 3)).astype("float32")
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    return history.history


@functools.cache
def _reference():
    keras.distribution.set_distribution(None)
    model = _model()
    return model, _fit(model)


def _blocks(model, layer, name):
    variable = getattr(model.get_layer(layer), name)
    return set(kr.shard_shapes(variable).values())


# Where each weight lives on a mesh of 4 along "model": the vocabulary of
# the table, the heads of the einsum kernel, the output channels of the
# convolution and the output units of the first Dense kernel. The second
# Dense kernel (16, 3) is 192 bytes: whole.
_BLOCKS_1x4 = {
    ("emb", "embeddings"): (8, 8),
    ("q", "kernel"): (8, 1, 4),
    ("conv", "kernel"): (3, 16, 2),
    ("d1", "kernel"): (32, 4),
    ("d2", "kernel"): (16, 3),
    ("d1", "bias"): (16,),
}


@pytest.mark.parametrize("shape", [(1, 4), (2, 2)], ids=["1x4", "2x2"])
def test_auto_layout_map_splits_large_weights_with_one_devices_numbers(shape):
    reference, h0 = _reference()
    _, distribution = _auto(shape)
    keras.distribution.set_distribution(distribution)
    model = _model()
    model_devices = shape[1]
    for (layer, name), block in _BLOCKS_1x4.items():
        if model_devices == 2:
            # Half the split dimension's size on a 2x2 mesh: the "batch"
            # axis splits the batch only, the blocks live on 2 devices each.
            full = tuple(getattr(model.get_layer(layer), name).shape)
            pairs = zip(block, full, strict=True)
            block = tuple(f // 2 if b != f else f for b, f in pairs)
        assert _blocks(model, layer, name) == {block}, (layer, name)
    h1 = _fit(model)
    _same_history(h0, h1)
    _same_weights(reference, model)
    for a, b in zip(
        reference.optimizer.variables, model.optimizer.variables, strict=True
    ):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-7)


def test_a_renamed_layer_still_shards():
    # keras-hub #2806: a map's regex written for one layer name matches
    # nothing once the layer is renamed, and the model loads whole on every
    # device. The automatic rule reads shapes and layers, not names.
    renamed = ("tok", "attn_q", "conv_in", "mlp_up", "head")
    layout_map = keras.distribution.LayoutMap(helpers.device_mesh((1, 4)))
    layout_map[".*d1/kernel"] = (None, "model")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    )
    assert _blocks(_model(renamed), "mlp_up", "kernel") == {(32, 16)}

    keras.distribution.set_distribution(_auto((1, 4))[1])
    model = _model(renamed)
    assert _blocks(model, "mlp_up", "kernel") == {(32, 4)}
    assert _blocks(model, "tok", "embeddings") == {(8, 8)}
    assert _blocks(model, "attn_q", "kernel") == {(8, 1, 4)}


def test_keys_set_on_the_map_win_and_the_report_names_key_rule_or_reason():
    layout_map, distribution = _auto((1, 4))
    # Split the table by its hidden size, keep the first Dense kernel whole.
    layout_map["emb/embeddings"] = (None, "model")
    layout_map["d1/kernel"] = (None, None)
    keras.distribution.set_distribution(distribution)
    model = _model()
    assert _blocks(model, "emb", "embeddings") == {(32, 2)}
    assert _blocks(model, "d1", "kernel") == {(32, 16)}
    assert _blocks(model, "q", "kernel") == {(8, 1, 4)}

    model.compile(keras.optimizers.Adam(), "mse")
    model.optimizer.build(model.trainable_variables)
    lines = []
    kr.layout_report(model, print_fn=lines.append)
    rows = {line.split()[0]: line for line in lines[0].splitlines()[1:-1]}
    assert "emb/embeddings" in rows["emb/embeddings"].split()[2:]
    # An optimizer slot names what laid out the variable it was made from.
    slots = [p for p in rows if "/q_kernel_" in p]
    assert len(slots) == 2, sorted(rows)
    for slot in slots:
        assert "auto: einsum output (dim 1)" in rows[slot]
    (table,) = [p for p in rows if p.endswith("/emb_embeddings_momentum")]
    assert "emb/embeddings" in rows[table]
    assert "auto: einsum output (dim 1)" in rows["q/kernel"]
    assert "auto: conv channels (dim 2)" in rows["conv/kernel"]
    assert "whole: 192 B < min_bytes" in rows["d2/kernel"]
    assert "whole: 64 B < min_bytes" in rows["d1/bias"]
    assert str(layout_map.decisions["q/kernel"]) == (
        "auto: einsum output (dim 1)"
    )


def test_a_dimension_the_axis_does_not_divide_is_skipped_or_reported():
    _, distribution = _auto((1, 4))
    keras.distribution.set_distribution(distribution)
    inputs = keras.Input((18,))
    # (18, 6): the output units do not divide by 4, nor do the inputs.
    h = keras.layers.Dense(6, name="odd")(inputs)
    # (6, 12): the output units divide.
    h = keras.layers.Dense(12, name="even")(h)
    # (12, 30): the inputs divide, the output units do not.
    outputs = keras.layers.Dense(30, name="rows")(h)
    model = keras.Model(inputs, outputs)
    assert _blocks(model, "odd", "kernel") == {(18, 6)}
    assert _blocks(model, "even", "kernel") == {(6, 3)}
    assert _blocks(model, "rows", "kernel") == {(3, 30)}
    decisions = keras.distribution.distribution()._layout_map.decisions
    assert str(decisions["odd/kernel"]) == "whole: no dimension divisible by 4"


def test_auto_layout_map_arguments_are_checked():
    mesh = helpers.device_mesh((1, 4))
    with pytest.raises(TypeError, match="Received: mesh="):
        kr.auto_layout_map((1, 4))
    with pytest.raises(ValueError, match="Received: model_dim_name='tp'"):
        kr.auto_layout_map(mesh, model_dim_name="tp")
    with pytest.raises(ValueError, match="Received: min_bytes=0"):
        kr.auto_layout_map(mesh, min_bytes=0)
    assert kr.auto_layout_map(mesh).min_bytes == 1 << 20
