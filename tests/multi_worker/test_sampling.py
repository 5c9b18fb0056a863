"""Sampling loops under ModelParallel over 2 processes, over gRPC and MPI.

keras-hub's `generate` (greedy and top-k; a Llama with its own layout map
and a Qwen3 under `kr.auto_layout_map`) and a custom `tf.while_loop` over
a sharded `Dense`, on a (1, 2) mesh whose model axis spans the processes:
every rank returns one device's tokens and numbers, on every call. Over
MPI, before the ordering token (mpi_collectives.py), the loop's weight
gathers paired with the ones before it: each rank returned other tokens
(greedy), or one rank failed on an out-of-range index and the other hung
(top-k). The checks of a mismatched collective are test_mpi_faults.py's.
"""

import numpy as np
import pytest

from tests.multi_worker import harness
from tests.multi_worker import sampling_reference

pytestmark = pytest.mark.multi_worker

WORKER = harness.REPO_ROOT / "tests/multi_worker/workers/sampling_worker.py"


@pytest.fixture(scope="module")
def one_device():
    import keras

    keras.distribution.set_distribution(None)
    return sampling_reference.run()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("transport", ["grpc", "mpi"])
def test_sampling_loops_give_one_devices_tokens_on_every_rank(
    transport, one_device
):
    results = harness.run_workers(
        WORKER,
        num_workers=2,
        replicas_per_worker=1,
        timeout=480,
        transport=transport,
    )
    for r in results:
        assert r.result["transport"] == transport, r.result["transport"]
        outputs = r.result["outputs"]
        # The loops read blocks: each model's kernels and tables are split
        # in two (Llama's own map and `auto_layout_map` split every one of
        # at least `MIN_BYTES`), each device storing half of one dimension.
        split = r.result["split"]
        assert sorted(split) == ["auto", "custom_loop", "own"], split
        for layout, weights in split.items():
            assert weights, (layout, "no weight split")
            for path, (full, stored) in weights.items():
                assert len(stored) == 1, (path, stored)
                halved = [f // s for f, s in zip(full, stored[0], strict=True)]
                assert sorted(halved)[-1] == 2 and np.prod(halved) == 2, (
                    path,
                    full,
                    stored,
                )
        assert "loop_dense/kernel" in split["custom_loop"], split
        assert sorted(outputs) == sorted(one_device)
        for case, expected in one_device.items():
            for call, (got, want) in enumerate(
                zip(outputs[case], expected, strict=True)
            ):
                what = f"worker {r.index} {case} call {call}"
                if case == "custom_loop":
                    np.testing.assert_allclose(
                        got, want, rtol=1e-5, atol=1e-6, err_msg=what
                    )
                else:
                    np.testing.assert_array_equal(got, want, err_msg=what)
