"""keras-hub's Gemma and Llama under ModelParallel, by their own layout maps.

`GemmaBackbone.get_layout_map(mesh)` and `LlamaBackbone`'s are keras-hub's
layouts (from the Gemma team's training config): the model axis splits
heads and the feed-forward width, the batch axis splits the hidden size
(FSDP). The models are built from a config (no preset download; Gemma is
`examples/gemma_model_parallel.py`'s `build_model`) and trained with `fit`
on 2x2 and 1x4 meshes (Llama, with grouped-query attention: 2x2) against
one device.
"""

import functools
import runpy
from pathlib import Path

import keras
import keras_hub
import numpy as np
import pytest

import keras_replicator as kr
from keras_replicator._src.core import placements
from tests.test_distribution import _mesh
from tests.test_distribution import _same_history
from tests.test_distribution import _same_weights
from tests.test_distribution import no_distribution  # noqa: F401

# The example's model: a small GemmaCausalLM from a config, compiled.
EXAMPLE = (
    Path(__file__).resolve().parents[1] / "examples/gemma_model_parallel.py"
)
_build = runpy.run_path(str(EXAMPLE))["build_model"]


def _gemma():
    return _fit(_build())


def _llama():
    """A small LlamaCausalLM from a config (grouped-query attention)."""
    keras.utils.set_random_seed(1)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=64,
        num_layers=1,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        dtype="float32",
    )
    causal_lm = keras_hub.models.LlamaCausalLM(
        backbone=backbone, preprocessor=None
    )
    causal_lm.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"],
    )
    return _fit(causal_lm)


def _fit(causal_lm):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 64, size=(16, 9)).astype("int32")
    x = {
        "token_ids": tokens[:, :-1],
        "padding_mask": np.ones((16, 8), "bool"),
    }
    history = causal_lm.fit(
        x, tokens[:, 1:], batch_size=8, epochs=1, verbose=0, shuffle=False
    )
    return causal_lm, history.history


@functools.cache
def _gemma_reference():
    keras.distribution.set_distribution(None)
    return _gemma()


@pytest.mark.parametrize(
    ("shape", "table"), [((2, 2), (32, 8)), ((1, 4), (16, 16))]
)
def test_keras_hub_gemma_layout_map_trains_as_one_device(shape, table):
    reference, h0 = _gemma_reference()
    layout_map = keras_hub.models.GemmaBackbone.get_layout_map(_mesh(shape))
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    )
    model, h1 = _gemma()
    embeddings = model.backbone.get_layer("token_embedding").embeddings
    assert kr.shard_shapes(embeddings) == {f"cpu:{i}": table for i in range(4)}
    query = model.backbone.get_layer("decoder_block_0").attention.query_dense
    assert placements.of(query.kernel) is not None
    _same_history(h0, h1, rtol=1e-4)
    _same_weights(reference, model, rtol=1e-4)


def test_keras_hub_llama_layout_map_trains_as_one_device():
    keras.distribution.set_distribution(None)
    reference, h0 = _llama()
    layout_map = keras_hub.models.LlamaBackbone.get_layout_map(_mesh((2, 2)))
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    )
    model, h1 = _llama()
    # Keys and values have 2 heads, queries 4: (hidden 16, heads, 4) split
    # (model, batch, None).
    attention = model.backbone.get_layer(
        "transformer_layer_0"
    )._self_attention_layer
    shapes = {
        "query": (8, 2, 4),
        "key": (8, 1, 4),
        "value": (8, 1, 4),
    }
    for name, block in shapes.items():
        kernel = getattr(attention, f"_{name}_dense").kernel
        assert set(kr.shard_shapes(kernel).values()) == {block}, name
    _same_history(h0, h1, rtol=1e-4)
    _same_weights(reference, model, rtol=1e-4)


def _gemma_weights(distribution, dtype):
    """A 16-bit GemmaCausalLM fitted under `distribution`: its weights."""
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(1)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=64,
        num_layers=1,
        num_query_heads=4,
        num_key_value_heads=4,
        hidden_dim=16,
        intermediate_dim=32,
        head_dim=8,
        dtype=dtype,
    )
    causal_lm = keras_hub.models.GemmaCausalLM(
        backbone=backbone, preprocessor=None
    )
    causal_lm.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model, history = _fit(causal_lm)
    weights = [w.astype("float64") for w in model.get_weights()]
    return weights, history["loss"]


@pytest.mark.parametrize("dtype", ["mixed_bfloat16", "bfloat16"])
def test_keras_hub_gemma_in_16_bits_trains_as_close_to_one_device_as_dp(dtype):
    # 16-bit products round each replica's own gradients, so no replicated
    # run gives one device's weights to float32 tolerance; ModelParallel
    # (its products moving rows, summed in float32) is as close as
    # DataParallel.
    one, one_loss = _gemma_weights(None, dtype)
    devices = keras.distribution.list_devices()[:4]
    layout_map = keras_hub.models.GemmaBackbone.get_layout_map(_mesh((2, 2)))
    model, model_loss = _gemma_weights(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        ),
        dtype,
    )
    data, _ = _gemma_weights(
        keras.distribution.DataParallel(devices=devices), dtype
    )

    def deviation(weights):
        return sum(
            np.abs(a - b).sum() for a, b in zip(one, weights, strict=True)
        ) / sum(np.abs(a).sum() for a in one)

    assert deviation(model) <= 2 * deviation(data), (
        deviation(model),
        deviation(data),
    )
    np.testing.assert_allclose(model_loss, one_loss, rtol=1e-3)
