"""Every ```python block in README.md runs as written, in a fresh process.

Blocks fenced as ```python run; blocks meant only to be read are fenced as
```text or ```sh. A block that needs a cluster or a TPU is not fenced as
python.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _python_blocks():
    text = README.read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)
    return blocks


BLOCKS = _python_blocks()


def test_readme_has_python_examples():
    assert BLOCKS, "README.md has no ```python blocks to check"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        [sys.executable, "-c", BLOCKS[index]],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, (
        f"README block {index} failed:\n{BLOCKS[index]}\n"
        f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    )
