"""Keras' own tf.distribute tests pass with our replicator as the strategy.

The installed keras wheel ships its TensorFlow distribute tests. They are
copied out unchanged but for the strategy (`tf.distribute.MirroredStrategy(
["CPU:0", "CPU:1"])` becomes `kr.LocalReplicator(devices=["CPU:0",
"CPU:1"])`) and run in a fresh pytest process, so a Keras upgrade re-checks
them. They apply gradients inside `strategy.run` and expect tf.distribute's
convention (each replica's gradient is its share; the shares are summed),
and they train with `fit`. The same files also run as shipped, with stock
`MirroredStrategy`, as the reference.
"""

import os
import pathlib
import re
import subprocess
import sys

import keras
import pytest

KERAS_ROOT = pathlib.Path(keras.__file__).parent
TEST_FILES = (
    "src/backend/tensorflow/distribute_test.py",
    "src/backend/tensorflow/optimizer_distribute_test.py",
    "src/callbacks/swap_ema_weights_test.py",
)
STOCK = 'tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])'
OURS = 'kr.LocalReplicator(devices=["CPU:0", "CPU:1"])'


def _copy_tests(destination, replace):
    copied = []
    for relative in TEST_FILES:
        source = (KERAS_ROOT / relative).read_text()
        assert source.count(STOCK), f"{relative} no longer uses {STOCK}"
        if replace:
            source = source.replace(STOCK, OURS)
            # The one added line: the import the replacement needs.
            source = re.sub(
                r"^import ",
                "import keras_replicator as kr\nimport ",
                source,
                count=1,
                flags=re.M,
            )
        target = destination / pathlib.Path(relative).name
        target.write_text(source)
        copied.append(target.name)
    return copied


@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", ["stock_mirrored", "local_replicator"])
def test_keras_distribute_tests_pass(tmp_path, strategy):
    files = _copy_tests(tmp_path, replace=strategy == "local_replicator")
    # An empty config: Keras' tests run with pytest's defaults, not ours.
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = dict(os.environ, KERAS_BACKEND="tensorflow")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        + files,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "failed" not in summary and "error" not in summary, summary
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    # 21 tests; the tf_keras variant of test_single_step skips without
    # tf_keras installed.
    assert passed >= 20, summary
