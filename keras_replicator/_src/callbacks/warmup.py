"""LinearWarmup: the gradual warm-up of the linear scaling rule.

Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in
1 Hour" (arXiv 1706.02677): when the global batch grows k times, multiply the
learning rate by k, reached by raising the single-worker rate by the same
amount every iteration for 5 epochs.
"""

from __future__ import annotations

import keras

from keras_replicator._src.core import validation
from keras_replicator._src.core import versions

# Set on the optimizer while a warm-up is unfinished; see on_train_begin.
_TARGET_ATTR = "_keras_replicator_warmup_target"


class LinearWarmup(keras.callbacks.Callback):
    """Linear learning-rate warm-up to the scaled rate (Goyal et al. 2017).

    Compile with the *scaled* rate (single-replica rate times `scale`, by
    default the replicas in sync, per the linear scaling rule). Training
    starts at `target / scale` and rises linearly per step to the target
    after `warmup_epochs` epochs (or `warmup_steps` steps):

        lr(t) = target * (1/scale + (1 - 1/scale) * t / W)   for t < W
        lr(t) = target                                       for t >= W

    with `t` the 0-based global step (`epoch * steps_per_epoch + batch`), `W`
    the warm-up steps and `target` the optimizer's rate at train begin.
    Afterwards the rate is left to later schedules (`ReduceLROnPlateau`);
    train end restores `target`, so a later `fit` (say with
    `initial_epoch`) warms up to the same target. With
    `steps_per_execution = s`, Keras calls batch hooks every `s` steps, which
    all use the first one's rate. Put it before callbacks that change the
    rate after the warm-up.

    Example:
    ```python
    base_lr = 0.1  # tuned for one replica
    with replicator.scope():
        model.compile(
            keras.optimizers.SGD(base_lr * replicator.num_replicas_in_sync),
            "mse",
        )
    model.fit(x, y, epochs=10, callbacks=[kr.callbacks.LinearWarmup(5)])
    ```

    Args:
        warmup_epochs: Warm-up epochs (may be fractional); ignored with
            `warmup_steps`. Defaults to 5, as in the paper.
        scale: The factor k from starting to target rate. Defaults to the
            model's `distribute_strategy.num_replicas_in_sync`.
        warmup_steps: Warm-up steps; needed when `fit` does not know the
            steps per epoch (unknown length, no `steps_per_epoch`).
            Defaults to None.

    Raises:
        ValueError: If an argument is not positive, or `scale < 1`.
        TypeError: At train begin, if the optimizer's learning rate is a
            schedule rather than a number.
        RuntimeError: At train begin, if steps per epoch are unknown and
            `warmup_steps` is not given.
    """

    def __init__(
        self,
        warmup_epochs: float = 5,
        scale: float | None = None,
        warmup_steps: int | None = None,
    ):
        super().__init__()
        validation.check_positive_number("warmup_epochs", warmup_epochs)
        if warmup_steps is not None:
            validation.check_positive_number("warmup_steps", warmup_steps)
        if scale is not None:
            validation.check_positive_number("scale", scale)
            if scale < 1:
                raise ValueError(
                    "`scale` must be at least 1 (the target rate is the "
                    f"larger one). Received: scale={scale!r}"
                )
        self.warmup_epochs = warmup_epochs
        self.scale = scale
        self.warmup_steps = warmup_steps
        self._target = None
        self._total = None
        self._steps_per_epoch = None
        self._offset = 0
        self._seen = 0

    def learning_rate(self, step: int) -> float:
        """The warm-up rate at 0-based global `step` (counted from epoch 0).

        Args:
            step: The global step.

        Returns:
            The learning rate; valid once training has begun.
        """
        if step >= self._total:
            return self._target
        start = 1.0 / self._scale
        return self._target * (start + (1.0 - start) * step / self._total)

    def on_train_begin(self, logs=None):
        """Reads the target rate and the warm-up length."""
        optimizer = self.model.optimizer
        if isinstance(
            optimizer._learning_rate,
            keras.optimizers.schedules.LearningRateSchedule,
        ):
            raise TypeError(
                "LinearWarmup needs a fixed learning rate to warm up to, "
                "not a schedule. Received: learning_rate="
                f"{optimizer._learning_rate!r}"
            )
        # Keras skips on_train_end when fit raises or is interrupted (Ctrl-C
        # in a notebook); the next fit would take the warm-up rate for the
        # target. So the target lives on the optimizer until a clean end.
        target = getattr(optimizer, _TARGET_ATTR, None)
        if target is None:
            target = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
            setattr(optimizer, _TARGET_ATTR, target)
        self._target = target
        self._scale = float(
            self.scale or self.model.distribute_strategy.num_replicas_in_sync
        )
        self._steps_per_epoch = (self.params or {}).get("steps")
        self._offset = 0
        self._seen = 0
        if self.warmup_steps is not None:
            self._total = int(self.warmup_steps)
        elif self._steps_per_epoch:
            self._total = max(
                1, round(self.warmup_epochs * self._steps_per_epoch)
            )
        else:
            raise RuntimeError(
                "LinearWarmup cannot tell how many steps an epoch has; pass "
                "`warmup_steps`, or `steps_per_epoch` to fit. Received: "
                f"warmup_epochs={self.warmup_epochs!r}, warmup_steps=None"
            )

    def on_train_end(self, logs=None):
        """Restores the target rate."""
        if self._target is not None:
            self.model.optimizer.learning_rate = self._target
            if hasattr(self.model.optimizer, _TARGET_ATTR):
                delattr(self.model.optimizer, _TARGET_ATTR)

    def on_epoch_begin(self, epoch, logs=None):
        """Finds the global step the epoch starts at."""
        if self._steps_per_epoch:
            self._offset = epoch * self._steps_per_epoch
        else:
            # Unknown epoch length: count the steps this fit has run.
            self._offset = self._seen

    def on_train_batch_begin(self, batch, logs=None):
        """Sets the rate for the coming step(s)."""
        step = self._offset + batch
        if step <= self._total:
            self.model.optimizer.learning_rate = self.learning_rate(step)

    def on_train_batch_end(self, batch, logs=None):
        """Counts steps (up to the execution's last step)."""
        last = versions.batch_end_step(self.model, batch)
        self._seen = self._offset + last + 1
