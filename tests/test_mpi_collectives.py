"""The MPI transport's ops (mpi_collectives.py) in one MPI process.

A process that mpiexec did not start is an MPI world of one (MPICH's
singleton start), so a sum or a gather over the ranks is the value itself:
that checks every dtype's round trip through MPI (bfloat16 and float16 sum
as float32, gathers move bits), the shapes TensorFlow sees, and the order
of a graph's MPI ops, in a subprocess of its own, so MPI never starts in
the test process. Two ranks are tests/multi_worker/test_mpi_transport.py's.
"""

import json
import subprocess
import sys

import pytest
import tensorflow as tf

from keras_replicator._src import mpi_collectives

SCRIPT = r"""
import json
import tensorflow as tf
from keras_replicator._src import mpi_collectives as mc

values = [
    tf.constant([1.5, -2.25], tf.bfloat16),
    tf.constant(3, tf.int32),
    tf.constant([[1.0, 2.0], [3.0, 4.0]], tf.float64),
    tf.constant([0.5], tf.float16),
    tf.range(5, dtype=tf.float32),
    tf.constant([7], tf.int64),
]
out = {"sums": [
    [r.dtype.name, r.shape.as_list(), r.numpy().tolist()]
    for r in mc.all_reduce_sum(values)
]}
out["gathers"] = [
    [g.dtype.name, g.numpy().tolist()]
    for g in (
        mc.all_gather(tf.constant([True, False])),
        mc.all_gather(tf.constant([[1.5], [-3.0]], tf.bfloat16)),
        mc.all_gather(tf.constant([[1, 2, 3]], tf.int32)),
        mc.all_gather(tf.constant([[1.0], [2.0]]), equal=True),
    )
]
out["alltoall"] = [
    [t.dtype.name, t.shape.as_list(), t.numpy().tolist()]
    for t in (
        mc.all_to_all(tf.constant([[True, False]])),
        mc.all_to_all(tf.constant([[[1.5], [-3.0]]], tf.bfloat16)),
        mc.all_to_all(tf.constant([[1.0, 2.0, 3.0]])),
    )
]

@tf.function
def step(a, b):
    # Independent of each other: only the chain orders them.
    x = mc.all_reduce_sum([a])[0]
    y = mc.all_reduce_sum([b, b])[1]
    z = mc.all_gather(a, equal=True)
    assert z.shape.as_list() == [3], z.shape
    assert mc.all_gather(b).shape.as_list() == [None, 2]
    return x + 1, y * 2, z

graph = step.get_concrete_function(
    tf.TensorSpec([3]), tf.TensorSpec([2, 2])
).graph
calls = [op for op in graph.get_operations() if op.type == "PyFunc"]
out["chain"] = [[c.name for c in op.control_inputs] for op in calls]
out["names"] = [op.name for op in calls]
x, y, z = step(tf.ones([3]), tf.ones([2, 2]))
out["step"] = [x.numpy().tolist(), y.numpy().tolist(), z.shape.as_list()]

# A gather of equal lengths that are not static (ModelParallel's padded
# rows): its header holds every dimension equal, and one Allgather moves
# the bytes; a gather of unequal lengths takes the lengths from the
# headers (no exchange of its own).
arrivals = []
agree = mc._agree


def _agree(*args, **kwargs):
    arrivals.append(mc._KIND_NAMES[args[1]])
    return agree(*args, **kwargs)


mc._agree = _agree

@tf.function(input_signature=[tf.TensorSpec([None])])
def dynamic(a):
    return mc.all_gather(a, equal=True), mc.all_gather(a)

equal, unequal = dynamic(tf.constant([1.0, 2.0, 3.0]))
out["dynamic"] = [equal.numpy().tolist(), unequal.numpy().tolist(), arrivals]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def one_rank():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_sum_over_one_rank_keeps_every_dtype_shape_and_value(one_rank):
    assert one_rank["sums"] == [
        ["bfloat16", [2], [1.5, -2.25]],
        ["int32", [], 3],
        ["float64", [2, 2], [[1.0, 2.0], [3.0, 4.0]]],
        ["float16", [1], [0.5]],
        ["float32", [5], [0.0, 1.0, 2.0, 3.0, 4.0]],
        ["int64", [1], [7]],
    ]


def test_a_gather_over_one_rank_moves_bits_unchanged(one_rank):
    assert one_rank["gathers"] == [
        ["bool", [True, False]],
        ["bfloat16", [[1.5], [-3.0]]],
        ["int32", [[1, 2, 3]]],
        ["float32", [[1.0], [2.0]]],
    ]


def test_an_all_to_all_over_one_rank_moves_bits_unchanged(one_rank):
    assert one_rank["alltoall"] == [
        ["bool", [1, 2], [[True, False]]],
        ["bfloat16", [1, 2, 1], [[[1.5], [-3.0]]]],
        ["float32", [1, 3], [[1.0, 2.0, 3.0]]],
    ]


def test_a_graphs_mpi_ops_run_in_program_order(one_rank):
    # Each waits for the one made before it, whatever TensorFlow could run
    # first: every rank issues them in the same order.
    names = one_rank["names"]
    assert len(names) == 4
    assert one_rank["chain"][0] == []
    for previous, deps in zip(names, one_rank["chain"][1:], strict=False):
        assert previous in deps
    assert one_rank["step"] == [[2.0, 2.0, 2.0], [[2.0, 2.0], [2.0, 2.0]], [3]]


def test_mpi_carries_one_replica_per_process():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with pytest.raises(ValueError, match="Received: 2 replicas"):
        mpi_collectives.install(strategy.extended)


def test_a_gather_of_equal_unknown_lengths_is_one_allgather(one_rank):
    # Each checks its header first: the equal gather every dimension, the
    # unequal one all but the first, whose lengths the headers carry.
    equal, unequal, arrivals = one_rank["dynamic"]
    assert equal == unequal == [1.0, 2.0, 3.0]
    assert arrivals == ["an all-gather of equal lengths", "an all-gather"]
