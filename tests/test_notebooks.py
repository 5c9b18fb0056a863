"""Every notebook runs top to bottom in a fresh kernel, then again in it.

The second pass re-runs every cell in the same kernel, as a user re-running a
notebook does: replicators are created again and must not break collectives.
"""

import os
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_twice_in_one_kernel(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    assert all(
        not cell.get("outputs") for cell in nb.cells if cell.cell_type == "code"
    ), f"{path.name} must be saved without outputs"
    client = NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    with client.setup_kernel(env=env):
        for run in range(2):
            for index, cell in enumerate(nb.cells):
                # Raises CellExecutionError, with the cell's traceback.
                client.execute_cell(cell, index)
            outputs = [o for c in nb.cells for o in c.get("outputs", [])]
            errors = [o for o in outputs if o.get("output_type") == "error"]
            assert not errors, f"run {run + 1}: {errors}"


def test_there_are_notebooks():
    names = {p.name for p in NOTEBOOKS}
    assert {
        "quickstart.ipynb",
        "custom_loop.ipynb",
        "multi_worker.ipynb",
    } <= names
