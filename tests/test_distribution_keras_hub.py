"""keras-hub's Gemma under ModelParallel, sharded by its own layout map.

`GemmaBackbone.get_layout_map(mesh)` is keras-hub's layout (from the Gemma
team's training config): the model axis splits heads and the feed-forward
width, the batch axis splits the hidden size (FSDP). The model is built from
a config (no preset download; `examples/gemma_model_parallel.py`'s
`build_model`) and trained with `fit` on 2x2 and 1x4 meshes
against one device.
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
    causal_lm = _build()
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
