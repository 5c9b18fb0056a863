"""`replicator.wrap_optimizer`: average gradients over every replica once.

Every Keras optimizer under our replicators already averages gradients once
(`gradients.py`, applied by `patches/replica_mean.py`). `ReplicatedOptimizer`
takes aggregation over from its inner optimizer (whose own reduction it
switches off) to add packs of a chosen size, 16-bit compression, and
micro-batch accumulation with one all-reduce per update.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import tensorflow as tf

from keras_replicator._src import collectives
from keras_replicator._src import gradients
from keras_replicator._src.core import validation

COMPRESSIONS = {None: None, "bf16": tf.bfloat16, "fp16": tf.float16}
# Pack size: big enough to amortize per-collective overhead, small enough
# for packs to overlap (Horovod's fusion buffer is 64 MiB).
DEFAULT_BYTES_PER_PACK = 32 * 2**20


@keras.saving.register_keras_serializable(package="keras_replicator")
class ReplicatedOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras optimizer to average gradients over all replicas.

    Made by `replicator.wrap_optimizer`. In a custom loop, compute a plain
    per-replica mean loss (not divided by the replica count; any loss works,
    since under our replicators Keras does not pre-divide losses) and call
    `apply_gradients(zip(grads, variables))` or `apply(grads, variables)` in
    the replica function, as on one device. Gradients are averaged once over
    every replica of every worker (weighted by each replica's example count
    when the step's input is a batch), then the inner optimizer applies
    them. Under `model.fit` it trains exactly as the plain optimizer.

    With `accumulation_steps=N`, each call adds to per-replica accumulators
    and every N-th all-reduces their mean and updates: N micro-batches of
    global batch B train like one step at N * B. `iterations` counts updates.

    Checkpoints hold the inner optimizer's variables plus, with
    accumulation, the accumulators (on-read, averaged when saved) and a
    micro-step counter, so they restore mid-accumulation, also onto another
    replica count. `get_config`/`from_config` round-trip everything. Do not
    use the inner optimizer alone afterwards: its cross-replica sum is off.

    Args:
        inner_optimizer: The `keras.optimizers.Optimizer` to wrap.
        accumulation_steps: Micro-batches per update. Defaults to 1.
        compression: None, `"bf16"` or `"fp16"`: the dtype gradients are
            all-reduced in, then cast back. Defaults to None (own dtype).
        bytes_per_pack: Target bytes per packed all-reduce; 0 packs all into
            one. Defaults to 32 MiB.
        name: The optimizer's name. Defaults to None.
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        accumulation_steps: int = 1,
        compression: str | None = None,
        bytes_per_pack: int = DEFAULT_BYTES_PER_PACK,
        name: str | None = None,
        **kwargs,
    ):
        _validate(inner_optimizer, accumulation_steps, compression)
        validation.check_non_negative_int("bytes_per_pack", bytes_per_pack)
        super().__init__(learning_rate=0.0, name=name, **kwargs)
        self.inner_optimizer = inner_optimizer
        self.accumulation_steps = accumulation_steps
        self.compression = compression
        self.bytes_per_pack = bytes_per_pack
        _disable_inner_all_reduce(inner_optimizer)

    def build(self, var_list: Sequence[keras.Variable]) -> None:
        """Creates the inner optimizer's variables and the accumulators."""
        self.inner_optimizer.build(var_list)
        if self.accumulation_steps > 1:
            self._micro_steps = self.add_variable(
                (),
                initializer="zeros",
                dtype="int64",
                aggregation="only_first_replica",
                name="micro_steps",
            )
            # ON_READ: replicas add to their own copy; saving reads the mean,
            # which after restore all-reduces to the same mean gradient.
            self._accumulators = []
            for v in var_list:
                acc = keras.Variable(
                    initializer="zeros",
                    shape=v.shape,
                    dtype=v.dtype,
                    trainable=False,
                    aggregation="mean",
                    synchronization="on_read",
                    name=f"{v.path.replace('/', '_')}_accumulator",
                )
                self._track_variable(acc)
                self._accumulators.append(acc)
        super().build(var_list)

    @property
    def variables(self) -> list[keras.Variable]:
        """The wrapper's own variables, then the inner optimizer's."""
        return self._variables + self.inner_optimizer.variables

    @property
    def iterations(self):
        """The number of updates applied (not micro-batches)."""
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self):
        """The inner optimizer's learning rate."""
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    def scale_loss(self, loss):
        """Scales `loss` as the inner optimizer does (e.g. loss scaling).

        Args:
            loss: A replica's loss.

        Returns:
            The inner optimizer's `scale_loss(loss)`.
        """
        return self.inner_optimizer.scale_loss(loss)

    def apply(self, grads, trainable_variables=None):
        """Averages `grads` over all replicas, then updates the variables.

        Call it in the replica function (`step_fn`, `strategy.run`, a
        `train_step`), the same number of times on every replica.

        Args:
            grads: A list of gradients (None for a variable without one).
            trainable_variables: The variables, in the order of `grads`.
                May be omitted once the optimizer is built.

        Raises:
            RuntimeError: If called in cross-replica context.
        """
        if tf.distribute.in_cross_replica_context():
            raise RuntimeError(
                "`apply` and `apply_gradients` of a wrapped optimizer must "
                "run in a replica context: inside the `step_fn` of "
                "`replicator.replicate`, inside `strategy.run`, or inside a "
                "Keras `train_step`."
            )
        if not self.built:
            self._build_outside_function(trainable_variables)
        if trainable_variables is None:
            trainable_variables = self._trainable_variables
        grads = list(grads)
        trainable_variables = list(trainable_variables)
        if self.accumulation_steps == 1:
            self._reduce_and_apply(grads, trainable_variables)
        else:
            self._accumulate(grads, trainable_variables)

    def _build_outside_function(self, trainable_variables):
        """Builds the optimizer eagerly, even from a replicated tf.function.

        Variables first created in a `tf.function` under a strategy make
        TensorFlow add an initialisation `tf.cond` that fails with "You must
        feed a value for placeholder tensor" (plain Keras optimizers too,
        unless built first); so build in cross-replica context, lifted out.
        """
        if trainable_variables is None:
            raise ValueError(
                "The first call of `apply` must pass the variables, or call "
                "`optimizer.build(variables)` first. Received: "
                "trainable_variables=None"
            )

        def build(strategy=None):
            with tf.init_scope(), keras.name_scope(self.name, caller=self):
                if strategy is None:
                    self.build(trainable_variables)
                    return
                with strategy.scope():
                    self.build(trainable_variables)

        if tf.executing_eagerly() or not tf.distribute.has_strategy():
            build()
        else:
            tf.distribute.get_replica_context().merge_call(build)

    def _reduce_and_apply(self, grads, trainable_variables):
        ctx = tf.distribute.get_replica_context()
        reduced = gradients.wrapped_gradients(
            [None if g is None else _to_dense(g) for g in grads],
            ctx,
            wire_dtype=COMPRESSIONS[self.compression],
            options=tf.distribute.experimental.CommunicationOptions(
                bytes_per_pack=self.bytes_per_pack
            ),
        )
        with gradients.receiving_reduced(self):
            self.inner_optimizer.apply(reduced, trainable_variables)

    def _accumulate(self, grads, trainable_variables):
        accumulators = [
            self._accumulators[self._get_variable_index(v)]
            for v in trainable_variables
        ]
        for acc, g in zip(accumulators, grads, strict=True):
            if g is not None:
                acc.assign_add(tf.convert_to_tensor(g))
        self._micro_steps.assign_add(1)
        steps = self.accumulation_steps

        def is_update_step():
            return tf.equal(tf.math.floormod(self._micro_steps.value, steps), 0)

        def apply_accumulated():
            mean = [
                None if g is None else acc.value / steps
                for acc, g in zip(accumulators, grads, strict=True)
            ]
            self._reduce_and_apply(mean, trainable_variables)
            for acc in accumulators:
                acc.assign(tf.zeros_like(acc.value))

        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            tf.cond(is_update_step(), apply_accumulated, _no_op)
            return

        # (MultiWorker)MirroredStrategy on CPU forbid a merge_call inside a
        # replica-side tf.cond: decide cross-replica, as LossScaleOptimizer
        # does, and re-enter the replicas in the chosen branch.
        def cross_replica(strategy):
            tf.cond(
                is_update_step(),
                lambda: strategy.extended.call_for_each_replica(
                    apply_accumulated
                ),
                _no_op,
            )

        tf.distribute.get_replica_context().merge_call(cross_replica)

    def finalize_variable_values(self, var_list):
        """Lets the inner optimizer finalize, e.g. swap in EMA weights."""
        self.inner_optimizer.finalize_variable_values(var_list)

    def get_config(self):
        """The inner optimizer's config and the wrapper's options."""
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(
                self.inner_optimizer
            ),
            "accumulation_steps": self.accumulation_steps,
            "compression": self.compression,
            "bytes_per_pack": self.bytes_per_pack,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Rebuilds the wrapper and its inner optimizer from `get_config`."""
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)


def wrap_optimizer(
    strategy: tf.distribute.Strategy,
    optimizer: keras.optimizers.Optimizer,
    accumulation_steps: int = 1,
    compression: str | None = None,
    bytes_per_pack: int = DEFAULT_BYTES_PER_PACK,
) -> ReplicatedOptimizer:
    """Wraps `optimizer` to average gradients over every replica of `strategy`.

    See `ReplicatorMixin.wrap_optimizer`.

    Args:
        strategy: The replicator the optimizer trains under.
        optimizer: A `keras.optimizers.Optimizer` created under
            `strategy.scope()`.
        accumulation_steps: Micro-batches per update. Defaults to 1.
        compression: None, `"bf16"` or `"fp16"`. Defaults to None.
        bytes_per_pack: Target bytes per packed all-reduce. Defaults to
            32 MiB.

    Returns:
        A `ReplicatedOptimizer`.

    Raises:
        TypeError: If `optimizer` is not a Keras optimizer.
        ValueError: If an option is out of range, or `optimizer` was created
            outside `strategy.scope()`.
    """
    _validate(optimizer, accumulation_steps, compression)
    owner = getattr(optimizer, "_distribution_strategy", strategy)
    if owner is not strategy:
        raise ValueError(
            "Create the optimizer inside `with replicator.scope():` (its "
            "variables must be replicated). Received: optimizer="
            f"{optimizer!r}, created under {owner!r}"
        )
    with strategy.scope():
        return ReplicatedOptimizer(
            optimizer,
            accumulation_steps=accumulation_steps,
            compression=compression,
            bytes_per_pack=bytes_per_pack,
        )


def all_reduce_mean(
    grads: Sequence[tf.Tensor | None],
    compression: str | None = None,
    bytes_per_pack: int = DEFAULT_BYTES_PER_PACK,
) -> list[tf.Tensor | None]:
    """Averages gradients over all replicas in a few packed all-reduces.

    One all-reduce per wire dtype (`compression`), which TensorFlow splits
    into packs of about `bytes_per_pack` (0: one pack). Gradients are divided
    by the replica count before the sum, so float16 sums cannot overflow.
    Returns them in the order and dtypes of `grads`; None passes through.
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return list(grads)
    scale = 1.0 / ctx.num_replicas_in_sync
    wire = COMPRESSIONS[compression]
    sent = []
    for g in grads:
        if g is None:
            sent.append(None)
            continue
        g = _to_dense(g) * tf.cast(scale, g.dtype)
        if wire is not None and g.dtype.is_floating and g.dtype.size > 2:
            g = tf.cast(g, wire)
        sent.append(g)
    options = tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=bytes_per_pack
    )
    reduced = collectives.all_reduce(ctx, "sum", sent, options)
    return [
        None if r is None else tf.cast(r, g.dtype)
        for r, g in zip(reduced, grads, strict=True)
    ]


def _validate(optimizer, accumulation_steps, compression) -> None:
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "`optimizer` must be a `keras.optimizers.Optimizer`. Received: "
            f"optimizer={optimizer!r} of type {type(optimizer).__name__}"
        )
    if isinstance(optimizer, ReplicatedOptimizer):
        raise ValueError(
            "`optimizer` is already wrapped; wrap the inner optimizer once. "
            f"Received: optimizer={optimizer!r}"
        )
    validation.check_positive_int("accumulation_steps", accumulation_steps)
    if compression not in COMPRESSIONS:
        raise ValueError(
            f"`compression` must be one of {tuple(COMPRESSIONS)}. Received: "
            f"compression={compression!r}"
        )
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise ValueError(
            "Use `accumulation_steps` of `wrap_optimizer` instead of the "
            "optimizer's own `gradient_accumulation_steps`: Keras "
            "all-reduces inside a `tf.cond`, which MirroredStrategy refuses, "
            "and would reduce every micro-batch. Received: "
            "gradient_accumulation_steps="
            f"{optimizer.gradient_accumulation_steps!r}"
        )


def _disable_inner_all_reduce(optimizer) -> None:
    """Turns off the cross-replica gradient sum of `optimizer` (and inners).

    Keras' TF optimizer sums in `_all_reduce_sum_gradients`; after the
    wrapper's mean that would multiply by the replica count. A
    LossScaleOptimizer's inner optimizer reduces too.
    """
    while optimizer is not None:
        if not hasattr(optimizer, "_all_reduce_sum_gradients"):
            raise TypeError(
                "wrap_optimizer needs Keras 3's TensorFlow optimizer, whose "
                "`_all_reduce_sum_gradients` it replaces (set KERAS_BACKEND="
                f"tensorflow). Received: optimizer={optimizer!r}"
            )
        # Gradients come already reduced: pass them on as a list.
        optimizer._all_reduce_sum_gradients = list
        optimizer = getattr(optimizer, "inner_optimizer", None)


def _to_dense(g):
    # IndexedSlices (embedding gradients) cannot be packed with dense ones.
    return tf.convert_to_tensor(g)


def _no_op():
    return None
