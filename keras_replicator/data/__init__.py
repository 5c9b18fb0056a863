"""The dataset sharder: shards, shuffles and batches unbatched examples.

`keras_replicator.data.shard(...)` makes an input function of per-replica
batches; `replicator.distribute(...)` makes a distributed dataset for
`model.fit` and `model.evaluate`.
"""

from keras_replicator._src.data.dataset_sharder import ShardedInput
from keras_replicator._src.data.dataset_sharder import shard

__all__ = (
    "ShardedInput",
    "shard",
)
