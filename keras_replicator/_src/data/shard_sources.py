"""How to split a source dataset across input pipelines: by file or element.

`AutoShardPolicy.AUTO` silently falls back from file to element sharding
(`FILE` with fewer files than workers gives some nothing). Here we count the
files read and shard by file when every pipeline gets one, else by element.
"""

from __future__ import annotations

import tensorflow as tf

# TF's graph rewriter, as `experimental_distribute_dataset` uses to shard by
# file; no public op inserts a shard before the reader.
from keras_replicator._src.upstream import (
    tf_data_distribute as _tfdata_distribute,
)

FILE = "file"
ELEMENT = "element"

# Datasets that read files; their file list is what file sharding splits.
_READER_OPS = frozenset(
    {
        "TFRecordDataset",
        "TFRecordDatasetV2",
        "TextLineDataset",
        "FixedLengthRecordDataset",
        "FixedLengthRecordDatasetV2",
        "ArrayRecordDataset",
    }
)
# Datasets mapping each input element (a file) to a dataset via attr `f`.
_FANOUT_OPS = frozenset(
    {
        "FlatMapDataset",
        "InterleaveDataset",
        "ParallelInterleaveDataset",
        "ParallelInterleaveDatasetV2",
        "ParallelInterleaveDatasetV3",
        "ParallelInterleaveDatasetV4",
    }
)
# Element-preserving datasets between a file list and the reader fan-out.
_PASS_THROUGH_OPS = frozenset(
    {
        "ShuffleDataset",
        "ShuffleDatasetV2",
        "ShuffleDatasetV3",
        "PrefetchDataset",
        "CacheDatasetV2",
        "ModelDataset",
        "OptionsDataset",
    }
)


def count_files(dataset: tf.data.Dataset) -> int | None:
    """Counts the files a dataset reads, from its serialized graph.

    Recognises readers given a file list (`TFRecordDataset(files)`) and
    file lists fanned out to readers (`from_tensor_slices(files)
    .interleave(TFRecordDataset)`, and `list_files`, which lists eagerly).
    None when no countable files are read (tensors in memory, generators,
    unknown readers).
    """
    try:
        graph = tf.compat.v1.GraphDef.FromString(
            dataset._as_serialized_graph().numpy()  # noqa: SLF001
        )
    except (tf.errors.OpError, ValueError, TypeError):
        return None
    nodes = {node.name: node for node in graph.node}
    functions = {f.signature.name: f for f in graph.library.function}

    def reads_files(function_name, seen):
        if function_name in seen or function_name not in functions:
            return False
        seen.add(function_name)
        for node in functions[function_name].node_def:
            if node.op in _READER_OPS:
                return True
            for attr in node.attr.values():
                if attr.func.name and reads_files(attr.func.name, seen):
                    return True
        return False

    def source_size(name):
        # From a fan-out's input up to its file list.
        node = nodes.get(_node_name(name))
        while node is not None and node.op in _PASS_THROUGH_OPS:
            node = nodes.get(_node_name(node.input[0]))
        if node is None or node.op != "TensorSliceDataset":
            return None
        const = nodes.get(_node_name(node.input[0]))
        if const is None or const.op != "Const":
            return None
        dims = const.attr["value"].tensor.tensor_shape.dim
        return int(dims[0].size) if dims else None

    total = 0
    found = False
    for node in graph.node:
        if node.op in _FANOUT_OPS and reads_files(
            node.attr["f"].func.name, set()
        ):
            size = source_size(node.input[0])
            if size is None:
                return None
            total += size
            found = True
    return total if found else None


def _node_name(input_name: str) -> str:
    return input_name.split(":")[0].lstrip("^")


def choose_policy(num_files: int | None, num_pipelines: int) -> str:
    """`FILE` when every pipeline gets at least one file, else `ELEMENT`."""
    if num_files is not None and num_files >= num_pipelines:
        return FILE
    return ELEMENT


def shard_source(
    dataset: tf.data.Dataset, num_pipelines: int, pipeline_id: int
) -> tuple[tf.data.Dataset, str]:
    """`(shard, policy)`: pipeline `pipeline_id`'s part of `dataset`.

    `dataset` holds unbatched examples in a deterministic order; `policy` is
    `FILE` or `ELEMENT`.
    """
    if num_pipelines == 1:
        return dataset, ELEMENT
    policy = choose_policy(count_files(dataset), num_pipelines)
    if policy == ELEMENT:
        return dataset.shard(num_pipelines, pipeline_id), ELEMENT
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.FILE
    )
    sharded = _tfdata_distribute._AutoShardDataset(  # noqa: SLF001
        dataset.with_options(options), num_pipelines, pipeline_id
    )
    return sharded, FILE
