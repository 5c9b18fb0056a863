"""The paper's three workloads: each example's --smoke run, end to end.

Each runs as its own process (as a user runs it), with a bounded timeout,
and prints a final `RESULT {json}` line that the test checks. And every
example that needs a package keras-replicator does not require says so at
its top, and without it stops with one line naming the install.
"""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multi_worker import harness

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# The packages an example may import beyond keras-replicator's
# requirements, and the install that brings each (pyproject.toml's
# extras; gymnasium is in none but `dev`).
OPTIONAL = {
    "keras_hub": ("keras-hub", 'pip install "keras-replicator[hub]"'),
    "sklearn": ("scikit-learn", 'pip install "keras-replicator[demo]"'),
    "gymnasium": ("gymnasium", "pip install gymnasium"),
}
# What keras-replicator's own install brings.
REQUIRED = {"keras", "keras_replicator", "numpy", "tensorflow"}


def _smoke(name, *args, timeout=180):
    # A fresh process, from the tests' zygote (TensorFlow imported once).
    proc = harness.run_python(
        [str(EXAMPLES / name), "--smoke", *args], timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.timeout(200)
def test_resnet_smoke_learns():
    result = _smoke("resnet.py", "--accumulation-steps", "2")
    assert result["initial_accuracy"] < 0.3
    assert result["final_accuracy"] > 0.8


@pytest.mark.timeout(200)
def test_sngan_smoke_moves_samples_onto_the_modes():
    result = _smoke("sngan.py")
    # Generated points start ~1.7 from the nearest mode (the ring's radius
    # is 2) and must end much closer, spread over most modes.
    assert result["final_mode_distance"] < 0.6 * result["initial_mode_distance"]
    assert result["final_modes"] >= 6


@pytest.mark.timeout(200)
def test_d4pg_smoke_return_improves():
    pytest.importorskip("gymnasium")
    result = _smoke("d4pg.py")
    # Random-ish start: about -1000 or worse; must gain several hundred.
    assert result["final_return"] > result["initial_return"] + 300


def _needs(path):
    """The optional packages `path` imports, or the kr demo's digits."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
            # `demo.load_digits_split` reads scikit-learn's digits.
            if node.module == "keras_replicator._src" and any(
                a.name == "demo" for a in node.names
            ):
                imported.add("sklearn")
    third_party = imported - set(sys.stdlib_module_names) - REQUIRED
    unknown = third_party - set(OPTIONAL)
    assert not unknown, f"{path.name} imports {unknown}: add it to OPTIONAL"
    return sorted(third_party)


def _examples_needing():
    return [
        (path.name, module)
        for path in sorted(EXAMPLES.glob("*.py"))
        for module in _needs(path)
    ]


def test_the_gemma_example_is_among_those_that_need_a_package():
    assert ("gemma_model_parallel.py", "keras_hub") in _examples_needing()


@pytest.mark.parametrize("name, module", _examples_needing())
def test_an_example_without_its_package_names_the_install_in_one_line(
    name, module
):
    package, install = OPTIONAL[module]
    path = EXAMPLES / name
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    # At the top: in the docstring's first 30 lines.
    top = " ".join("\n".join(docstring.splitlines()[:30]).split())
    assert install in top, f"{name}'s docstring does not say: {install}"
    # As if the package were not installed: `find_spec` returns None.
    code = (
        f"import runpy, sys; sys.modules[{module!r}] = None; "
        f"sys.argv = [{str(path)!r}]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"This example needs {package}: {install}"), line
