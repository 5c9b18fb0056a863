"""MetricReduction: logs that are exact global values on every worker.

What Keras 3 (3.15, TensorFlow backend) already reduces, measured on four
CPU replicas with an unevenly split last batch (`tests/test_metric_reduction`
pins each point):

- Metric state (`Mean`, `Accuracy`, the loss tracker, ...) is in
  sync-on-read SUM variables; `model.get_metrics_result()` outside
  `strategy.run` reads the sums over every replica and worker: exact.
- Epoch and evaluate/validation logs come from that read
  (`Trainer._get_metrics_result_or_logs`): exact and global.
- Batch logs are not: each replica reads its *local* variables in
  `train_step` and Keras averages them (`reduce_per_replica`, "mean"), an
  average of averages, wrong when replicas saw different example counts.
- Values callbacks add to `logs` are per worker.

So this recomputes batch metric logs from the global state, leaves epoch
metrics alone, and averages other log values across workers, weighted by
each worker's example count.
"""

from __future__ import annotations

import inspect
import zlib

import keras
import numpy as np

from keras_replicator._src import collectives

# Callbacks that read `logs`: MetricReduction must come before them.
LOG_READERS = (
    keras.callbacks.EarlyStopping,
    keras.callbacks.ReduceLROnPlateau,
    keras.callbacks.ModelCheckpoint,
    keras.callbacks.CSVLogger,
    keras.callbacks.TensorBoard,
    keras.callbacks.TerminateOnNaN,
    keras.callbacks.RemoteMonitor,
    keras.callbacks.History,
    keras.callbacks.ProgbarLogger,
)
# Key fingerprints < 2**20: sums over workers exact in float64 (and float32).
_FINGERPRINT_MOD = 2**20


class MetricReduction(keras.callbacks.Callback):
    """Makes every value in `logs` the exact global value, on every worker.

    - Batch logs of `fit` and `evaluate`: metrics are recomputed from their
      global state (Keras averages the replicas' running values, wrong when
      they hold different example counts, as in a last partial batch).
    - Epoch logs: Keras' metrics (training and `val_`) are already exact.
    - Other numeric values (from a custom `train_step` or earlier
      callbacks) are averaged across workers, weighted by each worker's
      examples so far in the epoch or evaluation.

    So every worker's logs, and `History`, hold the same values.

    Place it after callbacks that *add* to `logs` (e.g.
    `LearningRateScheduler`) and before those that *read* them
    (`EarlyStopping`, `ReduceLROnPlateau`, `ModelCheckpoint`, `CSVLogger`,
    `TensorBoard`, `TerminateOnNaN`, ...): Keras passes one `logs` dict in
    list order and this rewrites it in place (`History` and the progress
    bar come last). It checks this at train begin.

    Every worker must log the same keys in the same hooks. Each hook first
    all-reduces a fixed-size summary of its keys, so disagreeing workers
    all stop with a clear error; then, only if there are non-metric
    values, a second all-reduce carries them in sorted key order.

    Example:
    ```python
    model.fit(x, y, callbacks=[
        kr.callbacks.MetricReduction(),
        keras.callbacks.EarlyStopping(monitor="loss", patience=2),
    ])
    ```

    Raises:
        ValueError: At train begin, if a log-reading callback comes first,
            or the list holds two `MetricReduction` callbacks.
        RuntimeError: If workers log different keys in the same hook.
    """

    def __init__(self):
        super().__init__()
        self._metric_keys = frozenset()
        self._train_examples = None

    def on_train_begin(self, logs=None):
        """Checks the callback's position in the list."""
        self._check_position()
        self._metric_keys = frozenset()
        self._train_examples = None

    def on_train_end(self, logs=None):
        """Reduces values added to the final logs, if any."""
        if logs:
            self._reduce_other(logs, self._metric_keys, self._train_examples)

    def on_train_batch_end(self, batch, logs=None):
        """Replaces batch metrics with exact global values."""
        if logs:
            self._metric_keys = self._replace_metrics(logs)
            self._train_examples = self._examples()
            self._reduce_other(logs, self._metric_keys, self._train_examples)

    def on_test_batch_end(self, batch, logs=None):
        """Replaces evaluation batch metrics with exact global values."""
        if logs:
            keys = self._replace_metrics(logs)
            self._reduce_other(logs, keys, self._examples())

    def on_test_end(self, logs=None):
        """Reduces values added to the final evaluation logs."""
        if logs:
            keys = frozenset(self.model.get_metrics_result())
            self._reduce_other(logs, keys, self._examples())

    def on_epoch_end(self, epoch, logs=None):
        """Reduces what Keras did not: values other than its metrics."""
        if not logs:
            return
        # Metrics may hold validation state: weigh by the last train batch's.
        keys = self._metric_keys | {"val_" + k for k in self._metric_keys}
        self._reduce_other(logs, keys, self._train_examples)

    def _replace_metrics(self, logs):
        # Outside strategy.run sync-on-read variables read as global sums.
        results = self.model.get_metrics_result()
        for key, value in results.items():
            value = np.asarray(value)
            # Non-scalar results (per-class F1) stay: epoch-exact already.
            if key in logs and value.ndim == 0:
                logs[key] = float(value)
        return frozenset(results)

    def _examples(self):
        """Examples this worker has processed since the metrics' reset."""
        tracker = getattr(self.model, "_loss_tracker", None)
        count = getattr(tracker, "count", None)
        if count is None:
            return 1.0
        value = getattr(count, "value", count)
        local = getattr(value, "values", (value,))
        # The worker's own replicas only: no collective here.
        return float(sum(np.asarray(v) for v in local))

    def _reduce_other(self, logs, metric_keys, examples):
        strategy = self.model.distribute_strategy
        workers = _num_workers(strategy)
        if workers <= 1:
            return
        # Sorted: every worker packs the same keys in the same order.
        keys = sorted(
            k for k in logs if k not in metric_keys and _is_number(logs[k])
        )
        weight = 1.0 if examples is None else examples
        # First a fixed-shape key summary: an all-reduce of different lengths
        # fails ("Shape mismatch in the collective instance") and leaves every
        # worker's collectives unusable.
        fingerprint = zlib.crc32("\0".join(keys).encode()) % _FINGERPRINT_MOD
        summary = [fingerprint, len(keys)]
        # With the squares, totals equal `workers` times ours only if all
        # workers agree, so all pass or all raise (none waits in the next
        # all-reduce). Integers below 2**40 sum exactly in float64.
        check = [*summary, *(v * v for v in summary)]
        total = _sum_over_workers(strategy, np.array([*check, weight]))
        if any(total[i] != value * workers for i, value in enumerate(check)):
            raise RuntimeError(
                "MetricReduction needs the same log keys on every worker, "
                "in the same hooks; the workers' keys differ (in name or "
                f"number). This worker has {len(keys)}: {keys}. Add the same "
                "keys to `logs` on every worker. Received: "
                f"logs={sorted(logs)}"
            )
        if not keys:
            return
        values = np.array([float(logs[k]) * weight for k in keys])
        sums = _sum_over_workers(strategy, values)
        total_weight = total[len(check)]
        for key, value in zip(keys, sums, strict=True):
            logs[key] = float(value / total_weight)

    def _check_position(self):
        callbacks = _enclosing_callback_list(self)
        if callbacks is None:
            return
        mine = next(i for i, c in enumerate(callbacks) if c is self)
        if sum(isinstance(c, MetricReduction) for c in callbacks) > 1:
            raise ValueError(
                "Use one MetricReduction callback per fit; two would "
                "reduce the logs twice. Received: callbacks="
                f"{_names(callbacks)}"
            )
        before = [c for c in callbacks[:mine] if isinstance(c, LOG_READERS)]
        if before:
            raise ValueError(
                "MetricReduction must come before callbacks that read logs, "
                f"so they see the global values; {type(before[0]).__name__} "
                "comes first. Put MetricReduction earlier in `callbacks`. "
                f"Received: callbacks={_names(callbacks)}"
            )


def _enclosing_callback_list(callback):
    """The callbacks of the `CallbackList` running this hook, if any."""
    # Keras gives no reference to the list: it is the calling frame's `self`.
    frame = inspect.currentframe()
    try:
        for _ in range(8):
            frame = frame.f_back
            if frame is None:
                return None
            owner = frame.f_locals.get("self")
            if isinstance(owner, keras.callbacks.CallbackList) and any(
                c is callback for c in owner.callbacks
            ):
                return list(owner.callbacks)
        return None
    finally:
        del frame


def _names(callbacks):
    return [type(c).__name__ for c in callbacks]


def _is_number(value):
    if isinstance(value, bool):
        return False
    return np.ndim(value) == 0 and np.issubdtype(
        np.asarray(value).dtype, np.number
    )


def _num_workers(strategy):
    workers = getattr(strategy, "num_workers", None)
    if workers is None:
        workers = getattr(strategy.extended, "_num_workers", 1)
    return int(workers)


def _sum_over_workers(strategy, vector):
    """Sums a NumPy vector over workers: one all-reduce, eager."""
    return collectives.sum_over_workers(
        strategy, vector, _num_workers(strategy)
    )
