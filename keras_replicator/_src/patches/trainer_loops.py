"""Keras' `fit`, `evaluate` and `predict`: the replicator's own loops, if any.

One patch owns these entry points, for:

- `AsyncReplicator`, under which Keras 3 cannot train (keras-team/keras#18624:
  `strategy.run` on the coordinator, which `ParameterServerStrategy`
  refuses). A replicator with its own loops (`keras_loops.fit`/`evaluate`/
  `predict`, functions of `(model, replicator, **arguments)`) gets every
  call, its arguments bound to Keras' signature;
- exact evaluation (`exact_eval`): `evaluate` learns whether `x` is padded;
- preemption: `fit` runs with the signal handlers installed, put back
  however it ends;
- the hang watchdog (`training/hang_watchdog.py`): each call under
  `LocalReplicator`/`MultiWorkerReplicator` is a watched loop;
- `ModelParallel`'s block-stored variables: with `jit_compile=True` each
  device's share is compiled (`patches/per_replica_jit.py`), their layers
  are rematerialised for `fit` (`sharding/remat.py`), and products learn the
  global batch of array data or a batched dataset
  (`sharding/contraction.batch_hint`) to choose their path;
- `keras.distribution`: `Dropout` draws the global batch's masks in `fit`,
  as on JAX (`layers/global_dropout.py`);
- a model's first `fit` under `ModelParallel`: a warning names layout map
  keys that matched nothing and large variables left whole
  (`sharding/report.py`).

Everything else (no strategy, a stock one) runs Keras' method unchanged.
"""

from __future__ import annotations

import inspect
import os

import numpy as np
import tensorflow as tf

from keras_replicator._src import upstream
from keras_replicator._src.callbacks import timeline
from keras_replicator._src.core import env
from keras_replicator._src.core import placements
from keras_replicator._src.core import traits
from keras_replicator._src.layers import global_dropout
from keras_replicator._src.patches import exact_eval
from keras_replicator._src.patches import registry
from keras_replicator._src.sharding import contraction
from keras_replicator._src.sharding import remat
from keras_replicator._src.sharding import report
from keras_replicator._src.training import hang_watchdog
from keras_replicator._src.training import preemption as resume
from keras_replicator._src.training import resumption


def _loops(model):
    """The replicator, if the model's strategy brings its own Keras loops."""
    strategy = traits.model_strategy(model)
    if traits.is_ours(strategy) and hasattr(strategy, "keras_loops"):
        return strategy
    return None


def _arguments(original, model, args, kwargs) -> dict:
    """The call's arguments by name, defaults filled, as Keras binds them."""
    bound = inspect.signature(original).bind(model, *args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    arguments.pop("self")
    arguments.update(arguments.pop("kwargs", {}))
    return arguments


def _with_timeline(arguments) -> dict | None:
    """`fit`'s arguments with a `Timeline` added, if the environment asks.

    `KERAS_REPLICATOR_TIMELINE=path` adds `kr.callbacks.Timeline(path)` to
    a `fit` that has none (a `CallbackList` passed as is stays as is).
    """
    path = os.environ.get(env.TIMELINE)
    if not path:
        return None
    callbacks = arguments().get("callbacks")
    if callbacks is not None and not isinstance(callbacks, (list, tuple)):
        return None
    callbacks = list(callbacks or [])
    if any(isinstance(c, timeline.Timeline) for c in callbacks):
        return None
    # First: it then also records a `BackupAndRestore`'s restore.
    return {**arguments(), "callbacks": [timeline.Timeline(path), *callbacks]}


def _global_batch(arguments) -> int | None:
    """The global batch Keras' loop will step through, if known; else None.

    Array data: `batch_size` (Keras' default 32). A dataset made by
    `.batch(n)` (keras-hub's tasks make one): `n`, found back through
    batch-keeping transformations. Anything else is unknown. Only a
    product's path depends on it (`contraction.batch_hint`), never a number.
    """
    x = arguments.get("x")
    if isinstance(x, tf.data.Dataset):
        return _dataset_batch(x)
    leaves = (
        list(x.values())
        if isinstance(x, dict)
        else (list(x) if isinstance(x, (list, tuple)) else [x])
    )
    if not leaves or not all(
        isinstance(leaf, np.ndarray) or tf.is_tensor(leaf) for leaf in leaves
    ):
        return None
    batch = arguments.get("batch_size") or 32
    return batch if isinstance(batch, int) and batch > 0 else None


# Dataset transformations that keep each element's batch dimension.
_KEEPS_BATCH = frozenset({
    "_MapDataset", "_ParallelMapDataset", "_PrefetchDataset",
    "_RepeatDataset", "_TakeDataset", "_SkipDataset", "_ShuffleDataset",
    "_CacheDataset", "_FilterDataset", "_OptionsDataset",
    "_IgnoreErrorsDataset", "_ShardDataset",
})  # fmt: skip
_BATCHES = frozenset({"_BatchDataset", "_ParallelBatchDataset"})


def _dataset_batch(dataset) -> int | None:
    # Every element's rows, where its spec fixes them (`from_tensors`,
    # `batch(n, drop_remainder=True)`).
    rows = {
        spec.shape[0]
        for spec in tf.nest.flatten(dataset.element_spec)
        if getattr(spec, "shape", None) is not None and spec.shape.rank
    }
    if len(rows) == 1 and None not in rows:
        return rows.pop()
    for _ in range(64):
        kind = type(dataset).__name__
        if kind in _BATCHES:
            batch = tf.get_static_value(getattr(dataset, "_batch_size", None))
            return int(batch) if batch is not None and batch > 0 else None
        if kind not in _KEEPS_BATCH:
            return None
        dataset = getattr(dataset, "_input_dataset", None)
    return None


def _batch_statistics(model, strategy) -> None:
    """Global dropout masks under `keras.distribution`.

    On JAX one program spans the mesh, so `Dropout` under a distribution
    draws the global batch's mask. A model fit under one gets an override
    doing the same when traced under its replicator; a plain replicator
    keeps tf.distribute's per-replica masks.
    """
    if getattr(strategy, placements.DISTRIBUTION_ATTR, None) is None:
        return
    if global_dropout.use_global_masks(model):
        model.train_function = None


def _dispatch(name):
    def method(original, self, *args, **kwargs):
        # Bound once, and only where needed: a model under no strategy
        # gets Keras' own call, its errors included.
        bound = []

        def arguments():
            if not bound:
                bound.append(_arguments(original, self, args, kwargs))
            return bound[0]

        replicator = _loops(self)
        if replicator is not None:
            loop = getattr(replicator.keras_loops, name)
            return loop(self, replicator, **arguments())
        if name == "evaluate":
            exact_eval.prepare(self, arguments().get("x"))
        strategy = traits.model_strategy(self)
        if not traits.is_in_graph(strategy):
            return original(self, *args, **kwargs)
        sharded = placements.any_sharded(self.variables)
        if name == "fit" and sharded:
            remat.rematerialize(self)
        if name == "fit":
            # Once per model: what its ModelParallel layout map missed.
            report.warn_once(self)
        hint = contraction.batch_hint(
            strategy, _global_batch(arguments()) if sharded else None
        )
        if name == "fit":
            _batch_statistics(self, strategy)
            bar = resume.progress_bar(arguments().get("verbose"))
            traced = _with_timeline(arguments)
            with resumption.fit_scope(self), hint, bar:
                with hang_watchdog.watching(
                    strategy, name, resumption.position(self)
                ):
                    try:
                        if traced is not None:
                            return original(self, **traced)
                        return original(self, *args, **kwargs)
                    except BaseException:
                        # Keras ends no callback when `fit` raises.
                        timeline.release_all(
                            (traced or arguments()).get("callbacks")
                        )
                        raise
        with hang_watchdog.watching(strategy, name), hint:
            return original(self, *args, **kwargs)

    method.__name__ = name
    return method


_Trainer = upstream.TensorFlowTrainer

PATCH = registry.register(
    registry.Patch(
        name="trainer_loops",
        targets=tuple(
            registry.Target(_Trainer, name, _dispatch(name))
            for name in ("fit", "evaluate", "predict")
        ),
        applies_to=frozenset(traits.KINDS),
        # The loops take Keras' own arguments; a signature change must be
        # looked at (tests/test_async_replicator.py compares them too).
        pins=(
            registry.Pin(
                "keras.src.backend.tensorflow.trainer",
                ("def fit(", "def evaluate(", "def predict("),
            ),
        ),
        delete_when=(
            "Keras 3 supports ParameterServerStrategy in fit/evaluate "
            "(keras-team/keras#18624) and evaluates padded batches exactly"
        ),
    )
)
