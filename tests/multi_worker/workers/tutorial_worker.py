"""Worker of test_tf_tutorials.py: TensorFlow's tutorial loops on 2 workers.

Runs the training loops of "Custom training with tf.distribute.Strategy"
and "Multi-worker training with a custom training loop"
(`tests/tf_tutorials.py`) under one `MultiWorkerReplicator` and reports
their logs and weights.
"""

import keras_replicator as kr

# Create the replicator first: it splits the CPU before TF starts.
replicator = kr.MultiWorkerReplicator()

from tests import tf_tutorials  # noqa: E402
from tests.multi_worker import harness  # noqa: E402

results = {
    "custom_training": tf_tutorials.custom_training(replicator),
    "multi_worker_ctl": tf_tutorials.multi_worker_ctl(replicator),
    "transport": replicator.transport,
}
harness.write_result(results)
