"""Which strategies are ours, and of which kind: a leaf module.

Patches dispatch on this, so no module under `patches/` imports
`replicators/`. Each replicator class sets `replicator_kind` (one of
`KINDS`); a stock `tf.distribute` strategy has none.
"""

from __future__ import annotations

from typing import Any

# Local, MultiWorker, Tpu and AsyncReplicator's.
KINDS = ("local", "multi_worker", "tpu", "async")
# In-graph, with collective all-reduces ((MultiWorker)MirroredStrategy).
IN_GRAPH = ("local", "multi_worker")
KIND_ATTR = "replicator_kind"


def kind(strategy: Any) -> str | None:
    """The replicator kind of `strategy`, or None if it is not ours."""
    value = getattr(type(strategy), KIND_ATTR, None)
    return value if value in KINDS else None


def is_ours(strategy: Any) -> bool:
    """True for every keras-replicator backend."""
    return kind(strategy) is not None


def is_in_graph(strategy: Any) -> bool:
    """True for `LocalReplicator` and `MultiWorkerReplicator`."""
    return kind(strategy) in IN_GRAPH


def model_strategy(model: Any) -> Any:
    """The strategy a Keras model was built under (None if none)."""
    return getattr(model, "_distribute_strategy", None)
