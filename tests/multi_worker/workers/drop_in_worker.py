"""Worker of test_drop_in.py: every drop-in row on 2 workers x 2 replicas.

Runs each row of `tests/drop_in_cases.py` with `model.fit` under one
`MultiWorkerReplicator`, then `replicate` with a Keras `Loss` object in
`step_fn` (wrapped and plain optimizer), and reports weights and logs.
"""

import keras_replicator as kr

# Create the replicator first: it splits the CPU before TF starts.
replicator = kr.MultiWorkerReplicator()

import traceback  # noqa: E402

import numpy as np  # noqa: E402

from tests import drop_in_cases as cases  # noqa: E402
from tests import test_drop_in  # noqa: E402
from tests.multi_worker import harness  # noqa: E402

results = {}
# Sorted: every worker must run the rows (and their collectives) in the
# same order.
for name in sorted(cases.ROWS):
    try:
        results[name] = cases.run(name, replicator)
    except Exception:  # Reported per row; the next row still runs.
        results[name] = {"error": traceback.format_exc()[-2000:]}
for wrap in (True, False):
    weights, losses = test_drop_in.replicated_loss_object(replicator, wrap)
    results[f"loss_object_{'wrapped' if wrap else 'plain'}"] = {
        "weights": [np.asarray(w).tolist() for w in weights],
        "losses": losses,
    }
harness.write_result(results)
