"""MetricReduction: logs that are exact global values on every worker.

What Keras 3 (3.15, TensorFlow backend) already reduces, measured on four
CPU replicas with a last batch split unevenly (`tests/test_metric_reduction`
pins each point):

- Metric state (`Mean`, `Accuracy`, the loss tracker, ...) lives in
  sync-on-read variables with SUM aggregation. Read in cross-replica
  context, as `model.get_metrics_result()` does outside `strategy.run`,
  they give the sums over every replica (and, under a multi-worker
  strategy, every worker), so the result is the exact global value.
- Epoch logs and evaluate/validation logs come from exactly that read
  (`Trainer._get_metrics_result_or_logs`): already exact and global.
- Batch logs do not: each replica reads its *local* variables in
  `train_step`, and Keras averages the per-replica results
  (`reduce_per_replica`, "mean"). That is an average of averages, wrong
  whenever replicas have seen different numbers of examples.
- Values that callbacks add to `logs` are per process: under several
  workers each worker has its own.

So this callback recomputes batch-level metric logs from the global metric
state (no extra reduction of what Keras already reduced), leaves the exact
epoch metric values alone, and averages every other log value across
workers weighted by each worker's example count.
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
# Key fingerprints stay below 2**20 so sums over workers are exact in
# float64 (and would be in float32).
_FINGERPRINT_MOD = 2**20


class MetricReduction(keras.callbacks.Callback):
    """Makes every value in `logs` the exact global value, on every worker.

    - Batch logs of `fit` and `evaluate` (`on_train_batch_end`,
      `on_test_batch_end`): the model's metrics are recomputed from their
      global state, so they are exact over all replicas and workers,
      weighted by example counts. Keras' own batch logs average the
      replicas' running values, which is wrong when replicas hold
      different numbers of examples (a last partial batch).
    - Epoch logs (`on_epoch_end`): Keras' metric values, training and
      `val_`, are already exact and global and are left alone.
    - Every other numeric value in `logs` (added by a custom `train_step`
      or by callbacks earlier in the list) is averaged across workers,
      weighted by the number of examples each worker has processed in the
      epoch (or evaluation) so far; with one worker nothing changes.

    Afterwards every worker's logs, and so its `History`, hold the same
    values.

    Position in the callback list: after callbacks that *add* values to
    `logs` (e.g. `LearningRateScheduler`) and before every callback that
    *reads* them (`EarlyStopping`, `ReduceLROnPlateau`, `ModelCheckpoint`,
    `CSVLogger`, `TensorBoard`, `TerminateOnNaN`, ...), because Keras hands
    one `logs` dict to the callbacks in list order and this callback
    rewrites it in place. Keras appends `History` and the progress bar at
    the end, so they see the reduced values. At train begin the callback
    checks its position and raises if a known log reader comes first.

    Every worker must produce the same log keys in the same hooks. Each
    hook first all-reduces a fixed-size summary of its keys, so workers
    that disagree all stop with a clear error; only then, and only if
    there are values other than the model's metrics, does a second
    all-reduce carry them, packed in sorted key order.

    Example:
    ```python
    model.fit(x, y, callbacks=[
        kr.callbacks.MetricReduction(),
        keras.callbacks.EarlyStopping(monitor="loss", patience=2),
    ])
    ```

    Raises:
        ValueError: At train begin, if a log-reading callback comes before
            this one in the callback list, or the list holds two
            `MetricReduction` callbacks.
        RuntimeError: If workers log different keys, or different numbers
            of keys, in the same hook.
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
        # The model's metrics now hold validation state if validation ran,
        # so the training weights come from the last batch.
        keys = self._metric_keys | {"val_" + k for k in self._metric_keys}
        self._reduce_other(logs, keys, self._train_examples)

    def _replace_metrics(self, logs):
        # Outside strategy.run: sync-on-read metric variables read as their
        # global sums, so these results are exact over every replica.
        results = self.model.get_metrics_result()
        for key, value in results.items():
            value = np.asarray(value)
            # Non-scalar results (e.g. per-class F1) are left as Keras made
            # them; they are epoch-exact already.
            if key in logs and value.ndim == 0:
                logs[key] = float(value)
        return frozenset(results)

    def _examples(self):
        """Examples this worker has processed since the metrics' reset."""
        tracker = getattr(self.model, "_loss_tracker", None)
        count = getattr(tracker, "count", None)
        if count is None:
            examples = 1.0
        else:
            value = getattr(count, "value", count)
            local = getattr(value, "values", (value,))
            # The worker's own replicas only: no collective here.
            examples = float(sum(np.asarray(v) for v in local))
        return examples

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
        # First a summary of the keys whose shape never depends on them: an
        # all-reduce of vectors of different lengths fails inside the
        # collective ("Shape mismatch in the collective instance") and
        # leaves the collectives of every worker unusable.
        fingerprint = zlib.crc32("\0".join(keys).encode()) % _FINGERPRINT_MOD
        summary = [fingerprint, len(keys)]
        # With the sums of squares as well, the totals equal `workers` times
        # this worker's values only if every worker's values are equal, so
        # all workers pass the check or all raise; none is left waiting in
        # the next all-reduce. Integers below 2**40 sum exactly in float64.
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
        mine = [i for i, c in enumerate(callbacks) if c is self]
        others = [
            i
            for i, c in enumerate(callbacks)
            if isinstance(c, MetricReduction) and c is not self
        ]
        if others:
            raise ValueError(
                "Use one MetricReduction callback per fit; two would "
                "reduce the logs twice. Received: callbacks="
                f"{_names(callbacks)}"
            )
        before = [c for c in callbacks[: mine[0]] if isinstance(c, LOG_READERS)]
        if before:
            raise ValueError(
                "MetricReduction must come before callbacks that read logs, "
                f"so they see the global values; {type(before[0]).__name__} "
                "comes first. Put MetricReduction earlier in `callbacks`. "
                f"Received: callbacks={_names(callbacks)}"
            )


def _enclosing_callback_list(callback):
    """The callbacks of the `CallbackList` running this hook, if any."""
    # Keras hands callbacks no reference to their list; the list is the
    # `self` of the frame that called this hook (CallbackList.on_train_begin).
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
