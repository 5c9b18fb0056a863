"""Sampling loops that read sharded weights: shared by worker and test.

A sampling loop is a `tf.while_loop` whose body reads every sharded
weight: under `ModelParallel` over processes each read is a gather, inside
the loop's body. Over MPI those gathers must pair up across ranks in the
same order as the ones before the loop (mpi_collectives.py's docstring).
The cases: keras-hub's `generate` (greedy and top-k) of a Llama with its
own `get_layout_map` and of a Qwen3 laid out by `kr.auto_layout_map`, and
a custom `tf.while_loop` over a sharded `Dense`. `run()` returns every
case's tokens and numbers, twice (each `generate` is called twice), on one
device when no distribution is set, or under the one set.
"""

import keras
import numpy as np
import tensorflow as tf

VOCAB = 64
# Every kernel and table is at least this large, so every one is split.
MIN_BYTES = 256
_rng = np.random.default_rng(0)
_TOKENS = _rng.integers(1, VOCAB, size=(4, 3)).astype("int32")
PROMPT = {
    "token_ids": np.concatenate([_TOKENS, np.zeros((4, 5), "int32")], 1),
    "padding_mask": np.arange(8)[None, :].repeat(4, 0) < 3,
}
SAMPLERS = ("greedy", "top_k")
LAYOUTS = ("own", "auto")


def _llama():
    import keras_hub

    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        dtype="float32",
    )
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def _qwen3():
    import keras_hub

    backbone = keras_hub.models.Qwen3Backbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_query_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        hidden_dim=16,
        intermediate_dim=32,
        dtype="float32",
    )
    return keras_hub.models.Qwen3CausalLM(backbone=backbone, preprocessor=None)


# Each layout's model: Llama's own map, Qwen3's automatic one.
MODELS = {"own": _llama, "auto": _qwen3}
# The last model `generate` built for each layout, and the custom loop's
# layers: what `split_weights` inspects.
BUILT = {}


def layout_map(layout, mesh):
    """The case's layout map on `mesh` (axes "batch", "model")."""
    import keras_hub

    import keras_replicator as kr

    if layout == "own":
        return keras_hub.models.LlamaBackbone.get_layout_map(
            mesh,
            model_parallel_dim_name="model",
            data_parallel_dim_name="batch",
        )
    layouts = kr.auto_layout_map(mesh, min_bytes=MIN_BYTES)
    # The custom loop's Dense: its kernel split by output units.
    layouts["loop_dense/kernel"] = (None, "model")
    return layouts


def generate(layout, sampler):
    """Two calls of the model's generate function: their tokens."""
    keras.utils.set_random_seed(1)
    model = MODELS[layout]()
    BUILT[layout] = model
    model.compile(sampler=sampler)
    generate_fn = model.make_generate_function()
    return [
        np.asarray(generate_fn(PROMPT, stop_token_ids=None)["token_ids"])
        for _ in range(2)
    ]


def custom_loop():
    """A `tf.while_loop` applying a sharded `Dense` 5 times, twice.

    Each iteration reads the kernel (a gather under ModelParallel) and
    feeds the next; a weight gathered before the loop and one after it
    take part too, so the loop's gathers sit between others.
    """
    keras.utils.set_random_seed(2)
    dense = keras.layers.Dense(16, name="loop_dense")
    head = keras.layers.Dense(16, name="loop_head", use_bias=False)
    x = tf.constant(np.linspace(-1, 1, 64, dtype="float32").reshape(4, 16))
    dense.build((None, 16))
    head.build((None, 16))
    BUILT["custom_loop"] = dense

    @tf.function
    def loop(x):
        h = head(x)

        def body(i, h):
            return i + 1, tf.tanh(dense(h))

        _, h = tf.while_loop(lambda i, h: i < 5, body, (0, h))
        return head(h)

    return [np.asarray(loop(x)) for _ in range(2)]


def split_weights(name):
    """`{path: (full shape, shapes stored)}` of `BUILT[name]`'s split weights.

    A weight is split when a device stores less than its full shape
    (`kr.shard_shapes`): the test asks that the loops ran on blocks.
    """
    import keras_replicator as kr

    out = {}
    for weight in BUILT[name].weights:
        stored = sorted(set(kr.shard_shapes(weight).values()))
        if stored != [tuple(weight.shape)]:
            out[weight.path] = [list(weight.shape), [list(s) for s in stored]]
    return out


def run():
    """Every case's outputs: {name: [first call, second call]}."""
    out = {}
    for layout in LAYOUTS:
        for sampler in SAMPLERS:
            out[f"{layout}_{sampler}"] = generate(layout, sampler)
    out["custom_loop"] = custom_loop()
    return out
