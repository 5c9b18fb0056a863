"""The dataset sharder: shards, shuffles and batches unbatched examples.

`shard()` turns a dataset of single examples (or a function building one)
into an input function of per-replica batches for
`distribute_datasets_from_function`, with: each replica getting
`global_batch_size / replicas`; explicit sharding over pipelines (workers or
TPU hosts), by file when each gets a file, else by element, never
`AutoShardPolicy.AUTO`'s silent fallback; equal step counts on every
pipeline, so no worker waits in a collective for one out of data; static
shapes (the TPU contract): training drops the remainder, evaluation pads the
last batch and masks the padding with sample weight 0.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any
from typing import Union

import tensorflow as tf

from keras_replicator._src.core import markers
from keras_replicator._src.core import validation
from keras_replicator._src.data import shard_sources

_MODES = ("train", "eval")
DEFAULT_SHUFFLE_BUFFER_SIZE = 10_000

InputFn = Callable[[tf.distribute.InputContext], tf.data.Dataset]
Source = Union[tf.data.Dataset, InputFn]  # noqa: UP007


def shard(
    dataset_or_input_fn: Source,
    global_batch_size: int,
    *,
    shuffle_seed: int | None = None,
    static_shapes: bool | None = None,
    mode: str = "train",
    shuffle_buffer_size: int = DEFAULT_SHUFFLE_BUFFER_SIZE,
) -> ShardedInput:
    """Makes an input function that shards, shuffles and batches examples.

    `strategy.distribute_datasets_from_function` and `replicator.replicate`
    take the result; `replicator.distribute(...)` makes it a distributed
    dataset for `model.fit` and `model.evaluate`.

    In eval mode elements become `(x, y, sample_weight)`: the example's
    weight (or 1), 0 for padding. Keras `evaluate` under a replicator then
    counts every example once for the loss and every metric; custom loops
    must weight by `sample_weight` themselves.

    Example:
    ```python
    replicator = kr.LocalReplicator(2)
    examples = tf.data.Dataset.range(10).map(lambda i: (float(i), i % 2))
    input_fn = kr.data.shard(examples, global_batch_size=4)
    batches = replicator.distribute_datasets_from_function(input_fn)
    ```

    Args:
        dataset_or_input_fn: A `tf.data.Dataset` of unbatched examples in
            a deterministic order, or a function of a
            `tf.distribute.InputContext` returning one. A function reading
            `ctx.input_pipeline_id` or `ctx.num_input_pipelines` (as
            `tfds.ReadConfig(input_context=ctx)` does) shards itself; other
            results are sharded here. Under `AsyncReplicator` pass a
            function: its workers build their pipelines in tf.functions.
        global_batch_size: Examples per step over all replicas and workers.
        shuffle_seed: Seed to shuffle training examples within each
            pipeline's shard: the same order every run, a new one each
            epoch. `None` (default) keeps the order; eval never shuffles.
        static_shapes: Give every batch a fully known shape (training drops
            the last partial batch, eval pads it). Defaults to `True` under
            a `TPUStrategy` in scope at the call, else `False`.
        mode: `"train"` or `"eval"`. Defaults to `"train"`.
        shuffle_buffer_size: Shuffle buffer, in examples. Defaults to 10,000.

    Returns:
        A `ShardedInput`: a callable `input_fn(ctx) -> tf.data.Dataset` of
        per-replica batches.

    Raises:
        ValueError: If `mode` is unknown, a size is not a positive integer,
            or `global_batch_size` does not divide over the replicas in
            scope; when a `ParameterServerStrategy`'s own
            `distribute_datasets_from_function` calls it on a dataset (give
            the result to `model.fit` or use `replicator.distribute`).
        TypeError: If `dataset_or_input_fn` is neither a dataset nor
            callable, or `shuffle_seed` is not an integer.
    """
    if mode not in _MODES:
        raise ValueError(
            f"`mode` must be one of {_MODES}. Received: mode={mode!r}"
        )
    validation.check_positive_int("global_batch_size", global_batch_size)
    validation.check_positive_int("shuffle_buffer_size", shuffle_buffer_size)
    if shuffle_seed is not None and not validation.is_int(shuffle_seed):
        raise TypeError(
            "`shuffle_seed` must be an integer or None. "
            f"Received: shuffle_seed={shuffle_seed!r}"
        )
    if not isinstance(dataset_or_input_fn, tf.data.Dataset) and not callable(
        dataset_or_input_fn
    ):
        raise TypeError(
            "`dataset_or_input_fn` must be a tf.data.Dataset or a function "
            "taking a tf.distribute.InputContext. Received: "
            f"dataset_or_input_fn={dataset_or_input_fn!r}"
        )
    strategy = tf.distribute.get_strategy()
    check_divisible(global_batch_size, strategy.num_replicas_in_sync)
    if static_shapes is None:
        static_shapes = isinstance(strategy, tf.distribute.TPUStrategy)
    return ShardedInput(
        dataset_or_input_fn,
        global_batch_size,
        shuffle_seed=shuffle_seed,
        static_shapes=bool(static_shapes),
        mode=mode,
        shuffle_buffer_size=shuffle_buffer_size,
    )


class ShardedInput:
    """An input function of per-replica batches; made by `shard()`.

    Call it with a pipeline's `tf.distribute.InputContext` (as
    `distribute_datasets_from_function` does) for that pipeline's dataset;
    every pipeline yields the same number of steps.

    Attributes:
        global_batch_size: Examples per step over all replicas.
        mode: `"train"` or `"eval"`.
        static_shapes: Whether every batch has a fully known static shape.
        shuffle_seed: The shuffle seed, or `None` for the dataset's order.
        steps_per_epoch: Steps of one pass, once a pipeline is built, when
            known (a countable dataset, or several pipelines).
        policies: How the source was split, by number of pipelines:
            `"file"`, `"element"` or `"input_fn"` (the function sharded).
    """

    def __init__(
        self,
        source: Source,
        global_batch_size: int,
        *,
        shuffle_seed: int | None,
        static_shapes: bool,
        mode: str,
        shuffle_buffer_size: int,
    ):
        self._source = source
        self.global_batch_size = global_batch_size
        self.shuffle_seed = shuffle_seed
        self.static_shapes = static_shapes
        self.mode = mode
        # Whether the last pipeline built pads its eval batches (weight 0).
        self.padded_eval = False
        self._buffer = shuffle_buffer_size
        # Examples per pipeline by pipeline count, shared by every call (TPU
        # pods build every host's pipeline in one process).
        self._counts: dict[int, list[int]] = {}
        self._lock = threading.Lock()
        self.policies: dict[int, str] = {}
        self.steps_per_epoch: int | None = None

    @property
    def source(self) -> Source:
        """The dataset of examples, or the function making it."""
        return self._source

    @property
    def shuffle_buffer_size(self) -> int:
        """The shuffle buffer, in examples."""
        return self._buffer

    def __call__(self, ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        """Builds one input pipeline's dataset of per-replica batches.

        Args:
            ctx: The pipeline's `tf.distribute.InputContext`.

        Returns:
            A `tf.data.Dataset` of per-replica batches.

        Raises:
            ValueError: If the global batch size does not divide over the
                replicas, or (in static-shape or multi-pipeline eval mode)
                examples have no fully known shape.
            TypeError: If an eval-mode example is not `(x, y)` or
                `(x, y, sample_weight)`.
        """
        replicas = ctx.num_replicas_in_sync
        pipelines = ctx.num_input_pipelines
        check_divisible(self.global_batch_size, replicas)
        if replicas % pipelines:
            raise ValueError(
                "Every input pipeline must feed the same number of replicas. "
                f"Received: num_replicas_in_sync={replicas}, "
                f"num_input_pipelines={pipelines}"
            )
        per_replica = self.global_batch_size // replicas
        per_pipeline = per_replica * (replicas // pipelines)
        dataset = self._pipeline_source(ctx.input_pipeline_id, ctx)
        padded = self.mode == "eval" and (self.static_shapes or pipelines > 1)
        self.padded_eval = padded
        _check_element_spec(dataset.element_spec, self.mode, padded)
        if self.static_shapes:
            _check_fully_defined(dataset.element_spec)

        steps = None
        if pipelines > 1:
            counts = self._pipeline_counts(ctx)
            steps = _equal_steps(counts, per_pipeline, self.mode)
        elif (examples := _known_cardinality(dataset)) is not None:
            # Free: lets `take` end the padding, and Keras know the steps
            # (no "ran out of data" warning).
            if self.mode == "train" and self.static_shapes:
                steps = examples // per_pipeline
            else:
                steps = math.ceil(examples / per_pipeline)
        if self.mode == "train":
            dataset = self._train_batches(
                dataset, per_pipeline, steps if pipelines > 1 else None
            )
        else:
            dataset = _eval_batches(dataset, per_pipeline, steps, padded)
        whole_steps = self.static_shapes or padded
        # Known steps (a partial last batch too) keep Keras from calling its
        # train function on the exhausted iterator, whose update ops race
        # the end-of-data error: `iterations` grew by one at an epoch's end
        # or not (a resumed run ended 1e-4 to 1e-3 off an uninterrupted one).
        self.steps_per_epoch = steps
        if per_pipeline != per_replica:
            # Batch a whole step, then split it: every local replica gets one.
            dataset = dataset.rebatch(per_replica, drop_remainder=whole_steps)
        if steps is not None and whole_steps:
            dataset = dataset.apply(
                tf.data.experimental.assert_cardinality(
                    steps * (per_pipeline // per_replica)
                )
            )
        return dataset.prefetch(tf.data.AUTOTUNE)

    def _pipeline_source(
        self, pipeline_id: int, ctx: tf.distribute.InputContext
    ) -> tf.data.Dataset:
        """One pipeline's shard of unbatched examples."""
        num = ctx.num_input_pipelines
        if isinstance(self._source, tf.data.Dataset) and isinstance(
            tf.distribute.get_strategy(),
            tf.distribute.experimental.ParameterServerStrategy,
        ):
            # Its workers run input functions as tf.functions, where a chief's
            # dataset fails: "Failed copying input tensor ... Unable to parse
            # tensor proto".
            raise ValueError(
                "Under a parameter-server strategy each worker builds its "
                "own input pipeline in a tf.function, which cannot capture "
                "a dataset made here. Give `kr.data.shard(...)`'s result to "
                "`model.fit` or `replicator.replicate` under AsyncReplicator "
                "(they send the dataset to the workers), use "
                "`replicator.distribute(...)`, or pass a function that "
                "makes the dataset: "
                "`kr.data.shard(lambda ctx: make_dataset(), ...)`. Received: "
                f"dataset_or_input_fn={self._source!r}"
            )
        if isinstance(self._source, tf.data.Dataset):
            dataset, policy = shard_sources.shard_source(
                self._source, num, pipeline_id
            )
        else:
            recorder = _RecordingContext(
                num, pipeline_id, ctx.num_replicas_in_sync
            )
            dataset = self._source(recorder)
            if not isinstance(dataset, tf.data.Dataset):
                raise TypeError(
                    "The input function must return a tf.data.Dataset of "
                    f"unbatched examples. Received: {dataset!r}"
                )
            if recorder.read_pipeline:
                policy = "input_fn"
            else:
                dataset, policy = shard_sources.shard_source(
                    dataset, num, pipeline_id
                )
        self.policies[num] = policy
        options = tf.data.Options()
        # Sharded here already: nothing downstream may shard again.
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.OFF
        )
        options.deterministic = True
        return dataset.with_options(options)

    def _pipeline_counts(self, ctx: tf.distribute.InputContext) -> list[int]:
        """Examples in every pipeline's shard (cached per pipeline count)."""
        num = ctx.num_input_pipelines
        with self._lock:
            if num not in self._counts:
                self._counts[num] = [
                    _count(self._pipeline_source(i, ctx)) for i in range(num)
                ]
            return self._counts[num]

    def _train_batches(
        self, dataset: tf.data.Dataset, batch: int, steps: int | None
    ) -> tf.data.Dataset:
        if self.shuffle_seed is not None:
            dataset = dataset.shuffle(
                self._buffer,
                seed=self.shuffle_seed,
                reshuffle_each_iteration=True,
            )
        if steps is None:
            return dataset.batch(batch, drop_remainder=self.static_shapes)
        # Equal steps everywhere: a short shard wraps around (reshuffled).
        return dataset.repeat().batch(batch, drop_remainder=True).take(steps)


def _eval_batches(
    dataset: tf.data.Dataset, batch: int, steps: int | None, padded: bool
) -> tf.data.Dataset:
    """Batches `(x, y[, w])` into `(x, y, w)`, padding with weight 0."""
    spec = dataset.element_spec
    dataset = dataset.map(lambda *example: (example, True))
    if padded:
        filler = tf.nest.map_structure(_zeros, spec)
        dataset = dataset.concatenate(
            tf.data.Dataset.from_tensors((tuple(filler), False)).repeat()
        )
    dataset = dataset.batch(batch, drop_remainder=padded)
    if padded:
        if steps is None:
            # One pipeline: stop after the batch holding the last example.
            dataset = dataset.take_while(lambda _, real: tf.reduce_any(real))
        else:
            dataset = dataset.take(steps)
    return dataset.map(_to_weighted)


def _to_weighted(example, real):
    x, y = example[0], example[1]
    if len(example) == 3:
        weight = example[2]
        mask = tf.cast(real, weight.dtype)
        if weight.shape.rank and weight.shape.rank > 1:
            mask = tf.reshape(mask, [-1] + [1] * (weight.shape.rank - 1))
        return x, y, weight * mask
    return x, y, tf.cast(real, tf.float32)


def _equal_steps(counts: list[int], batch: int, mode: str) -> int:
    """The step count every pipeline runs, from every pipeline's count."""
    if mode == "eval":
        # Pad the short shards: every example once, none dropped.
        return max(math.ceil(c / batch) for c in counts)
    if min(counts) == 0:
        raise ValueError(
            "An input pipeline got no examples, so it can't keep step with "
            "the others. Use more data or fewer workers. Received: examples "
            f"per pipeline={counts}"
        )
    # One epoch is as many global batches as the whole dataset fills.
    return sum(counts) // (batch * len(counts))


def _known_cardinality(dataset: tf.data.Dataset) -> int | None:
    """The number of examples if known without reading them, else None.

    None while tracing too: `ParameterServerStrategy` calls input functions
    in a `tf.function`, where the cardinality is symbolic.
    """
    cardinality = tf.get_static_value(dataset.cardinality())
    if cardinality is None or cardinality < 0:
        return None
    return int(cardinality)


def _count(dataset: tf.data.Dataset) -> int:
    known = _known_cardinality(dataset)
    if known is not None:
        return known
    if dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            "Several input pipelines need finite datasets to agree on a "
            "step count; this one repeats forever. Received: cardinality="
            "infinite"
        )
    return int(dataset.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))


def _zeros(spec: tf.TensorSpec) -> tf.Tensor:
    if spec.dtype == tf.string:
        return tf.fill(spec.shape, "")
    return tf.zeros(spec.shape, spec.dtype)


def _check_element_spec(spec: Any, mode: str, padded: bool) -> None:
    if mode != "eval":
        return
    if not isinstance(spec, tuple) or len(spec) not in (2, 3):
        raise TypeError(
            "In eval mode every example must be a tuple (x, y) or "
            "(x, y, sample_weight), so that padding can be masked out. "
            f"Received: element_spec={spec!r}"
        )
    if padded:
        _check_fully_defined(spec)


def _check_fully_defined(spec: Any) -> None:
    for leaf in tf.nest.flatten(spec):
        if not isinstance(leaf, tf.TensorSpec) or (
            not leaf.shape.is_fully_defined()
        ):
            raise ValueError(
                "Static shapes (and evaluation over several input pipelines) "
                "need unbatched examples whose dense shapes are fully known; "
                "pad or resize them first. Received: element_spec="
                f"{spec!r}"
            )


def check_divisible(global_batch_size: int, replicas: int) -> None:
    """Raises ValueError unless the batch splits evenly over `replicas`."""
    if global_batch_size % replicas:
        raise ValueError(
            "The global batch size must be divisible by the number of "
            f"replicas ({replicas}). Received: "
            f"global_batch_size={global_batch_size}, "
            f"num_replicas_in_sync={replicas}"
        )


class _RecordingContext(tf.distribute.InputContext):
    """An InputContext that notes whether the input function sharded."""

    read_pipeline = False

    @property
    def input_pipeline_id(self):
        self.read_pipeline = True
        return super().input_pipeline_id

    @property
    def num_input_pipelines(self):
        self.read_pipeline = True
        return super().num_input_pipelines


def distribute(
    strategy: tf.distribute.Strategy,
    dataset_or_input_fn: Source,
    global_batch_size: int,
    **options: Any,
) -> tf.distribute.DistributedDataset:
    """`shard()` for `strategy`, as a distributed dataset.

    Args:
        strategy: The replicator the dataset feeds.
        dataset_or_input_fn: As for `shard`.
        global_batch_size: As for `shard`.
        **options: `shard`'s keyword arguments.

    Returns:
        `distribute_datasets_from_function`'s dataset: one pipeline per
        worker or TPU host, prefetched to GPUs and TPUs.
    """
    with strategy.scope():
        input_fn = shard(dataset_or_input_fn, global_batch_size, **options)
    distributed = strategy.distribute_datasets_from_function(input_fn)
    if input_fn.steps_per_epoch is not None and hasattr(
        distributed, "_cardinality"
    ):
        # TF reports the pipeline's cardinality in per-replica batches (or
        # unknown); Keras reads it as steps and calls its train function
        # once too often (see `ShardedInput.__call__`). Report steps.
        distributed._cardinality = input_fn.steps_per_epoch  # noqa: SLF001
    if input_fn.padded_eval:
        # Keras evaluate leaves the padding out (patches/exact_eval.py).
        markers.mark_padded(distributed)
    return distributed
