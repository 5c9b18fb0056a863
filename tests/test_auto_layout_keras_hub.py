"""keras-hub models with no layout map, under `kr.auto_layout_map`.

keras-hub 0.32 ships `get_layout_map` for Gemma, Llama, Qwen, QwenMoe and
Qwen3Moe only. Each model here has none: it is built from a small config
(random weights, no download) under `ModelParallel(layout_map=
kr.auto_layout_map(mesh))` on a 1x4 mesh, and every weight of at least
`min_bytes` must be split in four. A few Adam steps of `fit` give one
device's losses and weights, and a causal LM's greedy `generate` gives one
device's tokens.

BERT's token table is Keras' own tied `ReversibleEmbedding`, which its
classifier only looks up: its gradient must stay the sparse rows one
device's Adam sees (a rematerialised lookup made it dense, 1.7e-4 of the
table's scale off after 2 steps).

T5Gemma (encoder-decoder) ties its decoder's table to the logits; its
encoder's table is a plain `Embedding`.
"""

import math

import keras
import keras_hub
import numpy as np
import pytest

import keras_replicator as kr
from keras_replicator._src.core import placements
from tests import helpers
from tests.test_distribution import _same_history
from tests.test_distribution import no_distribution  # noqa: F401

# The models' norms and biases (16 floats) stay whole; every kernel and
# table is at least this large.
MIN_BYTES = 256
VOCAB = 64
_rng = np.random.default_rng(0)
TOKENS = _rng.integers(1, VOCAB, size=(16, 9)).astype("int32")
IMAGES = _rng.normal(size=(16, 16, 16, 3)).astype("float32")
LABELS = _rng.integers(0, 4, size=(16,)).astype("int32")
PROMPT = {
    "token_ids": np.concatenate(
        [TOKENS[:4, :3], np.zeros((4, 5), "int32")], axis=1
    ),
    "padding_mask": np.arange(8)[None, :].repeat(4, 0) < 3,
}


def _adam():
    # An attention key's bias has a gradient of exactly zero (softmax is
    # invariant to a shift of a query's scores); in floats it is noise of
    # about 1e-9 whose sign depends on the order of sums, which any split
    # batch changes (DataParallel too). Adam's default epsilon (1e-7) makes
    # that noise a full step of either sign; 1e-4 keeps it at 1e-5 of one.
    return keras.optimizers.Adam(1e-2, epsilon=1e-4)


def _lm_loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _causal(backbone_cls, lm_cls, **config):
    backbone = backbone_cls(vocabulary_size=VOCAB, dtype="float32", **config)
    model = lm_cls(backbone=backbone, preprocessor=None)
    model.compile(
        optimizer=_adam(),
        loss=_lm_loss(),
        sampler="greedy",
    )
    x = {
        "token_ids": TOKENS[:, :-1],
        "padding_mask": np.ones((16, 8), "bool"),
    }
    return model, x, TOKENS[:, 1:]


def _gemma3():
    return _causal(
        keras_hub.models.Gemma3Backbone,
        keras_hub.models.Gemma3CausalLM,
        image_size=16,
        num_layers=1,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        head_dim=4,
    )


def _mistral():
    return _causal(
        keras_hub.models.MistralBackbone,
        keras_hub.models.MistralCausalLM,
        num_layers=1,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
    )


def _mixtral():
    return _causal(
        keras_hub.models.MixtralBackbone,
        keras_hub.models.MixtralCausalLM,
        num_layers=1,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        num_experts=4,
        top_k=2,
        # The load-balancing loss is a product of the batch's per-expert
        # means: a statistic of the whole batch that each data-parallel
        # replica computes on its own rows (as on JAX), so it is not one
        # device's. Without it the routing is per token and exact.
        router_aux_loss_coef=0.0,
    )


def _qwen3():
    return _causal(
        keras_hub.models.Qwen3Backbone,
        keras_hub.models.Qwen3CausalLM,
        num_layers=1,
        num_query_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        hidden_dim=16,
        intermediate_dim=32,
    )


def _vit():
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(16, 16, 3),
        patch_size=4,
        num_layers=1,
        num_heads=4,
        hidden_dim=16,
        mlp_dim=32,
        dtype="float32",
    )
    model = keras_hub.models.ViTImageClassifier(backbone, num_classes=4)
    model.compile(optimizer=_adam(), loss=_lm_loss())
    return model, IMAGES, LABELS


def _bert():
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_heads=4,
        hidden_dim=16,
        intermediate_dim=32,
        dropout=0.0,
        max_sequence_length=16,
        dtype="float32",
    )
    model = keras_hub.models.BertTextClassifier(
        backbone, num_classes=4, preprocessor=None, dropout=0.0
    )
    model.compile(optimizer=_adam(), loss=_lm_loss())
    x = {
        "token_ids": TOKENS[:, :8],
        "segment_ids": np.zeros((16, 8), "int32"),
        "padding_mask": np.ones((16, 8), "bool"),
    }
    return model, x, LABELS


def _t5gemma():
    layers = dict(
        hidden_dim=16,
        intermediate_dim=32,
        num_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        layer_types=["full_attention"],
    )
    backbone = keras_hub.models.T5GemmaBackbone(
        vocabulary_size=VOCAB,
        **{f"encoder_{k}": v for k, v in layers.items()},
        **{f"decoder_{k}": v for k, v in layers.items()},
        dropout_rate=0.0,
        dtype="float32",
    )
    model = keras_hub.models.T5GemmaSeq2SeqLM(backbone, preprocessor=None)
    model.compile(optimizer=_adam(), loss=_lm_loss())
    mask = np.ones((16, 8), "int32")
    x = {
        "encoder_token_ids": TOKENS[:, :8],
        "encoder_padding_mask": mask,
        "decoder_token_ids": TOKENS[:, :8],
        "decoder_padding_mask": mask,
    }
    return model, x, TOKENS[:, 1:]


MODELS = {
    "bert": _bert,
    "gemma3": _gemma3,
    "mistral": _mistral,
    "mixtral": _mixtral,
    "qwen3": _qwen3,
    "t5gemma": _t5gemma,
    "vit": _vit,
}
CAUSAL = ("gemma3", "mistral", "mixtral", "qwen3")
# ViT's position table is read with ids of shape (1, 17), the same rows
# for every example: its gradient is 17 rows on one device, and 4 x 17
# rows with repeats once the replicas' gradients are put together (under
# DataParallel too). Keras' Adam squares an `IndexedSlices` gradient row
# by row, so its second moment differs (sum of squares, not square of
# sum), and so do the weights (SGD gives one device's, to 1e-7). Its
# forward pass is compared instead.
FORWARD_ONLY = ("vit",)


def _run(name):
    keras.utils.set_random_seed(1)
    model, x, y = MODELS[name]()
    if name in FORWARD_ONLY:
        return model, model.predict(x, batch_size=8, verbose=0), None
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    tokens = None
    if name in CAUSAL:
        # What `generate` runs on a batch (Gemma3's `generate` fails on
        # inputs with no preprocessor, on one device too).
        generate = model.make_generate_function()
        tokens = generate(PROMPT, stop_token_ids=None)
        tokens = np.asarray(tokens["token_ids"])
    return model, history.history, tokens


def _close(actual, expected, rtol=1e-5):
    """Within `rtol` of the largest value, or of 1e-3 for one near zero.

    A weight that starts at zero (a norm's scale) and moves by 1e-7 in a
    few steps is compared at the scale of a weight, not of its own size.
    """
    actual, expected = np.asarray(actual), np.asarray(expected)
    scale = max(float(np.max(np.abs(expected))), 1e-3)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=rtol * scale)


def _nbytes(variable):
    return math.prod(variable.shape) * np.dtype(variable.dtype).itemsize


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_keras_hub_model_without_a_map_shards_and_trains_as_one_device(name):
    keras.distribution.set_distribution(None)
    reference, h0, tokens0 = _run(name)
    layout_map = kr.auto_layout_map(
        helpers.device_mesh((1, 4)), min_bytes=MIN_BYTES
    )
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    )
    model, h1, tokens1 = _run(name)
    split = 0
    for variable in model.weights:
        blocks = set(kr.shard_shapes(variable).values())
        if _nbytes(variable) < MIN_BYTES or not variable.trainable:
            assert placements.of(variable) is None, variable.path
            continue
        # One dimension split in four, the same block shape on every device.
        (block,) = blocks
        full = tuple(variable.shape)
        cut = [b != f for b, f in zip(block, full, strict=True)]
        assert sum(cut) == 1, (variable.path, full, block)
        assert math.prod(block) * 4 == math.prod(full), variable.path
        split += 1
    assert split >= 6
    if name in FORWARD_ONLY:
        _close(h1, h0)
        return
    _same_history(h0, h1)
    for a, b in zip(reference.get_weights(), model.get_weights(), strict=True):
        _close(b, a)
    if name in CAUSAL:
        np.testing.assert_array_equal(tokens1, tokens0)
