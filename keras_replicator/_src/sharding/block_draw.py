"""Initial values drawn block by block, never whole.

TensorFlow's stateless random ops (Philox, CPU and GPU) draw element `i`
from counter `i // 4` after the seed's, whatever the shape (truncated
normals: 256 counters per group of 4, for rejections). So rows `[a, b)` of a
full draw are a `(b - a, ...)` draw with the counter moved by `a`'s first
element, and Keras' own random initializers (`_DRAWN`, whose call returns the
backend's float32 Philox draw as it is) are drawn in chunks of rows, each cut
to the block's columns at once: one chunk is the transient, and the numbers
are one device's bit for bit (`tests/test_capacity.py`). `Zeros`, `Ones` and
a scalar `Constant` become a `Fill`; any other initializer (`Orthogonal`, a
user's) computes the full value once, which `sharded.create` cuts.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Any

import numpy as np
import tensorflow as tf

from keras_replicator._src.upstream import constant_initializers
from keras_replicator._src.upstream import gen_random
from keras_replicator._src.upstream import random_initializers

# Exact types: a subclass may transform the draw.
_DRAWN = frozenset(
    {
        random_initializers.RandomUniform,
        random_initializers.RandomNormal,
        random_initializers.TruncatedNormal,
        random_initializers.VarianceScaling,
        random_initializers.GlorotUniform,
        random_initializers.GlorotNormal,
        random_initializers.HeUniform,
        random_initializers.HeNormal,
        random_initializers.LecunUniform,
        random_initializers.LecunNormal,
    }
)
# Counters a Philox call consumes per group of 4 float32 outputs.
_COUNTERS_PER_GROUP = {"uniform": 1, "normal": 1, "truncated": 256}
_PHILOX = 1  # `tf.random.Algorithm.PHILOX`
# Elements per chunk of rows: 16 MB of float32.
CHUNK_ELEMENTS = 1 << 22

_local = threading.local()


class Draw:
    """A full-shaped draw that was not made: what to draw, for the blocks."""

    def __init__(self, kind, shape, seed, scale, shift):
        self.kind = kind
        self.shape = tuple(int(d) for d in shape)
        self.seed = seed
        self.scale = scale
        self.shift = shift

    def rows(self, start: int, stop: int) -> tf.Tensor:
        """Rows `[start, stop)` of the draw (`start * row` a multiple of 4)."""
        row = math.prod(self.shape[1:])
        first = start * row
        key, counter = gen_random.stateless_random_get_key_counter(self.seed)
        skip = first // 4 * _COUNTERS_PER_GROUP[self.kind]
        low, high = (int(c) for c in counter.numpy().astype(np.uint64))
        low += skip
        moved = np.array(
            [low % 2**64, (high + low // 2**64) % 2**64], dtype=np.uint64
        )
        op = {
            "uniform": gen_random.stateless_random_uniform_v2,
            "normal": gen_random.stateless_random_normal_v2,
            "truncated": gen_random.stateless_truncated_normal_v2,
        }[self.kind]
        drawn = op(
            [stop - start, *self.shape[1:]],
            key=key,
            counter=tf.constant(moved, tf.uint64),
            dtype=tf.float32,
            alg=_PHILOX,
        )
        # As `tf.random.stateless_*` do: `rnd * scale + shift`.
        return drawn * self.scale + self.shift

    def blocks(self, placement: Any, replicas: list[int]) -> dict:
        """`{replica: its block}` for `replicas`, drawn in chunks of rows."""
        begins = {r: placement.begin(r) for r in replicas}
        local = placement.local_shape
        low = min(b[0] for b in begins.values())
        high = max(b[0] + local[0] for b in begins.values())
        row = max(1, math.prod(self.shape[1:]))
        # A chunk starts where the draw's groups of 4 start.
        step = 4 // math.gcd(row, 4)
        start = low - low % step
        rows = max(step, CHUNK_ELEMENTS // row // step * step)
        pieces: dict[int, list] = {r: [] for r in replicas}
        while start < high:
            stop = min(high, start + rows)
            chunk = self.rows(start, stop)
            for r, begin in begins.items():
                top = max(start, begin[0])
                bottom = min(stop, begin[0] + local[0])
                if top >= bottom:
                    continue
                pieces[r].append(
                    tf.slice(
                        chunk,
                        [top - start, *begin[1:]],
                        [bottom - top, *local[1:]],
                    )
                )
            del chunk
            start = stop
        return {r: tf.concat(p, axis=0) for r, p in pieces.items()}


class Fill:
    """A constant full-shaped value (zeros: optimizer slots), not made."""

    def __init__(self, shape, value, dtype):
        self.shape = shape
        self.value = value
        self.dtype = dtype

    def blocks(self, placement: Any, replicas: list[int]) -> dict:
        """`{replica: its block}` for `replicas`."""
        return {
            r: tf.fill(placement.local_shape, tf.cast(self.value, self.dtype))
            for r in replicas
        }


def _fill_value(initializer: Any) -> float | None:
    """The constant a Keras `Zeros`, `Ones` or scalar `Constant` fills."""
    kind = type(initializer)
    if kind is constant_initializers.Zeros:
        return 0.0
    if kind is constant_initializers.Ones:
        return 1.0
    if kind is constant_initializers.Constant:
        value = getattr(initializer, "value", None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


@contextlib.contextmanager
def initializer_of(initializer: Any):
    """Notes the initializer a variable is being initialised with."""
    saved = getattr(_local, "initializer", None)
    _local.initializer = initializer
    try:
        yield
    finally:
        _local.initializer = saved


def _standing(value: Any) -> float | None:
    """A Python number from a scalar argument, or None."""
    value = tf.get_static_value(value)
    if value is None or np.ndim(value) != 0:
        return None
    return float(value)


def draw(value: Any, shape, dtype) -> Draw | Fill | Any:
    """Calls `value` (an initializer's closure): a `Draw`, a `Fill` or as is."""
    initializer = getattr(_local, "initializer", None)
    shape = tuple(int(d) for d in shape)
    fill = _fill_value(initializer)
    if fill is not None and len(shape) >= 1:
        return Fill(shape, fill, dtype)
    if (
        type(initializer) not in _DRAWN
        or int(gen_random.stateless_random_get_alg()) != _PHILOX
        or tf.as_dtype(dtype) != tf.float32
        or len(shape) < 1
        or 0 in shape
    ):
        return value()
    saved = getattr(_local, "drawing", None)
    _local.drawing = (shape, [])
    try:
        result = value()
    finally:
        _local.drawing = saved
    return result


def stand_in(kind: str, original, *args, **kwargs):
    """`tf.random.stateless_<kind>`, or a `Draw` while `draw` is asking.

    Installed by `patches/sharded_variables.py` in place of TensorFlow's
    `stateless_uniform`, `_normal` and `_truncated_normal`; every call but a
    variable's one full-shaped float32 Philox draw goes to TensorFlow.
    """
    drawing = getattr(_local, "drawing", None)
    if drawing is None:
        return original(*args, **kwargs)
    full_shape, made = drawing
    call = dict(zip(("shape", "seed"), args, strict=False))
    call.update(kwargs)
    shape, seed = call.get("shape"), call.get("seed")
    dtype = call.get("dtype", tf.float32)
    if kind == "uniform":
        low, high = call.get("minval", 0.0), call.get("maxval", 1.0)
        scale, shift = _standing(high - low), _standing(low)
    else:
        scale = _standing(call.get("stddev", 1.0))
        shift = _standing(call.get("mean", 0.0))
    if (
        made
        or len(args) > 2
        or shape is None
        or seed is None
        or tuple(int(d) for d in shape) != full_shape
        or tf.as_dtype(dtype) != tf.float32
        or None in (scale, shift)
        or call.get("alg") not in (None, "auto_select", "philox")
    ):
        return original(*args, **kwargs)
    made.append(Draw(kind, full_shape, seed, scale, shift))
    return made[-1]
