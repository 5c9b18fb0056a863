"""Worker of test_keras_tuner.py: `RandomSearch` under `launch --workers 2`.

Each worker runs the same search (its own folder: keras-tuner writes its
trials there) with `distribution_strategy=kr.auto()`, and writes the
trials.
"""

import os
import sys

import keras_replicator as kr

replicator = kr.auto()

from tests import keras_tuner_search  # noqa: E402
from tests.multi_worker import harness  # noqa: E402

directory = os.path.join(sys.argv[1], f"worker{harness.task_index()}")
harness.write_result(keras_tuner_search.search(directory, replicator))
