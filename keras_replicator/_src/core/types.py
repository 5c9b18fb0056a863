"""Type aliases shared by the package."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

Tensor = tf.Tensor | tf.Variable
# A tensor, or a nest (list, tuple, dict) of tensors.
TensorTree = Tensor | Sequence[Any] | Mapping[str, Any]
