"""The wheel installs and runs where the checkout is not.

`python -m build` makes the sdist and the wheel (without build isolation:
the dev extra brings the setuptools that `build-system.requires` asks for,
so this runs offline). The wheel must hold the whole package and the
`keras-replicator` command, and nothing of the checkout's tests, notebooks
or examples. It is then installed, with no dependencies, into a fresh
virtual environment, where `keras-replicator --help` and README's
quickstart run from an empty directory.

The fresh environment gets the runtime dependencies without downloading
them again: its site-packages links, file by file, exactly the
distributions `keras-replicator` requires (recursively, as its wheel's
metadata says) from the environment running the tests, each one's files
as its RECORD lists them. `pip check` there proves the set complete.
Nothing else comes along: not the test environment's own (editable)
keras_replicator, not the dev tools.
"""

import configparser
import email
import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys
import tarfile
import zipfile

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "keras_replicator"
ENTRY_POINT = "keras-replicator = keras_replicator._src.cli.main:main"
# Folders of the checkout that must not be installed.
NOT_SHIPPED = ("tests", "notebooks", "examples", "benchmarks", "docs")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", out],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    # setuptools printed a deprecation block (three times) for the old
    # `license = { text = ... }` table.
    assert "deprecat" not in log.lower(), log[-4000:]
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return wheel, sdist


def _wheel_metadata(wheel):
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_string(z.read(name).decode())


def test_wheel_holds_the_package_and_the_command(dist):
    wheel, _ = dist
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (entry_points,) = [
            n for n in names if n.endswith(".dist-info/entry_points.txt")
        ]
        scripts = configparser.ConfigParser()
        scripts.read_string(z.read(entry_points).decode())
    tops = {name.split("/")[0] for name in names}
    dist_info = next(t for t in tops if t.endswith(".dist-info"))
    assert tops == {PACKAGE, dist_info}, tops
    assert not [n for n in names if n.split("/")[0] in NOT_SHIPPED]
    sources = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / PACKAGE).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert f"{PACKAGE}/_src/replicators/local.py" in sources
    assert sources - names == set(), "modules missing from the wheel"
    assert {n for n in names if n.endswith(".py")} == sources
    assert f"{dist_info}/licenses/LICENSE" in names
    command = ENTRY_POINT.split(" = ")
    assert scripts["console_scripts"][command[0]] == command[1]


def test_wheel_metadata_has_license_and_extras(dist):
    meta = _wheel_metadata(dist[0])
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["License"] is None, "the deprecated free-text license"
    assert meta.get_all("License-File") == ["LICENSE"]
    extras = set(meta.get_all("Provides-Extra"))
    assert {"gpu", "demo", "mpi", "datasets", "hub", "dev"} <= extras
    requires = meta.get_all("Requires-Dist")
    assert 'tensorflow[and-cuda]<2.23,>=2.19; extra == "gpu"' in requires
    assert any(r.startswith("scikit-learn") for r in requires if "demo" in r)
    # keras-hub is the `hub` extra's alone, and `dev` (the tests) has it.
    hub = [r for r in requires if r.startswith("keras-hub")]
    assert hub == ['keras-hub>=0.20; extra == "hub"'], hub
    (dev,) = [r for r in requires if r.startswith("keras-replicator[")]
    assert Requirement(dev).extras == {"demo", "hub", "tuner"}, dev
    assert Requirement(dev).marker.evaluate({"extra": "dev"}), dev


def test_sdist_holds_what_builds_the_wheel(dist):
    _, sdist = dist
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"LICENSE", "README.md", "pyproject.toml"} <= names
    assert f"{PACKAGE}/__init__.py" in names
    assert not [n for n in names if n.split("/")[0] in NOT_SHIPPED]


def _runtime_closure(wheel, extras=()):
    """Every distribution the wheel needs at run time, with its extras."""

    def wanted(req, extras):
        return req.marker is None or any(
            req.marker.evaluate({"extra": e}) for e in ("", *extras)
        )

    requires = _wheel_metadata(wheel).get_all("Requires-Dist")
    todo = [r for r in map(Requirement, requires) if wanted(r, extras)]
    closure = {}
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in closure and set(req.extras) <= closure[name]:
            continue
        closure[name] = closure.get(name, set()) | set(req.extras)
        dist = importlib.metadata.distribution(name)
        for line in dist.requires or ():
            sub = Requirement(line)
            if wanted(sub, tuple(closure[name])):
                todo.append(sub)
    return sorted(closure)


def _link_outside_site_packages(names, site_packages):
    """Links the distributions' files outside site-packages, as pip puts them.

    Their commands (`bin/`: MPICH's mpiexec) and shared libraries (`lib/`:
    its libmpi, which mpi4py loads from the environment's prefix).
    """
    for name in names:
        dist = importlib.metadata.distribution(name)
        for file in dist.files or ():
            if file.parts[0] != "..":
                continue
            target = pathlib.Path(dist.locate_file(file)).resolve()
            link = pathlib.Path(os.path.normpath(site_packages / file))
            if target.exists() and not os.path.lexists(link):
                link.parent.mkdir(parents=True, exist_ok=True)
                os.symlink(target, link)


def _link_distributions(names, site_packages):
    """Links the distributions' recorded files into `site_packages`.

    A folder that holds only their recorded files is linked whole (one
    symlink for TensorFlow's 22,000 files: symlinks are slow on some
    disks); a folder they share with other distributions (`google/`) is
    made, and its recorded entries are linked one by one.
    """
    recorded = set()
    sources = set()
    for name in names:
        dist = importlib.metadata.distribution(name)
        assert dist.files, f"{name} has no RECORD"
        sources.add(str(dist.locate_file("")))
        # Not `../../bin` scripts.
        recorded.update(str(f) for f in dist.files if f.parts[0] != "..")
    (source,) = sources
    folders = set()
    for file in recorded:
        folder = os.path.dirname(file)
        while folder and folder not in folders:
            folders.add(folder)
            folder = os.path.dirname(folder)

    def only_recorded(rel):
        for path, _, files in os.walk(os.path.join(source, rel)):
            for file in files:
                if os.path.relpath(os.path.join(path, file), source) not in (
                    recorded
                ):
                    return False
        return True

    def link(rel):
        target = os.path.join(source, rel)
        if rel in recorded or only_recorded(rel):
            os.symlink(target, os.path.join(site_packages, rel))
            return
        os.mkdir(os.path.join(site_packages, rel))
        for child in sorted(os.listdir(target)):
            child = os.path.join(rel, child)
            if child in recorded or child in folders:
                link(child)

    for top in sorted({f.split("/")[0] for f in recorded}):
        link(top)


def _readme_quickstart():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"^```python\n(.*?)^```$", section, re.M | re.S)
    return block


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory):
    """A fresh environment: the wheel and its runtime dependencies only."""
    return _fresh_venv(dist, tmp_path_factory)


@pytest.fixture(scope="module")
def mpi_venv(dist, tmp_path_factory):
    """A fresh environment: `pip install "keras-replicator[mpi]"`."""
    return _fresh_venv(dist, tmp_path_factory, extras=("mpi",))


def _fresh_venv(dist, tmp_path_factory, extras=()):
    wheel, _ = dist
    root = tmp_path_factory.mktemp("venv")
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", root], check=True
    )
    env = _clean_env(root)
    python = root / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site_packages = pathlib.Path(
        subprocess.run(
            [python, "-c", purelib],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        ).stdout.strip()
    )
    names = _runtime_closure(wheel, extras)
    _link_distributions(names, site_packages)
    if extras:
        # An extra's commands and libraries (MPICH's), as pip installs them.
        _link_outside_site_packages(names, site_packages)
    # This environment's pip, run by the fresh one's Python.
    pip = [sys.executable, "-m", "pip", "--python", python]
    quiet = ["--disable-pip-version-check", "--no-input", "-q"]
    target = f"{wheel}[{','.join(extras)}]" if extras else wheel
    install = subprocess.run(
        [*pip, "install", *quiet, "--no-deps", "--no-index", target],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    check = subprocess.run(
        [*pip, "check", *quiet], capture_output=True, text=True, env=env
    )
    assert check.returncode == 0, check.stdout + check.stderr
    return root


def _clean_env(venv):
    """The environment variables, without a path into the checkout."""
    # PYTHONPATH would put the checkout (and its egg-info) first: pip would
    # see keras-replicator installed already, and Python would import it.
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
    }
    env.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        TF_CPP_MIN_LOG_LEVEL="3",
        KERAS_BACKEND="tensorflow",
    )
    return env


def _run_in(venv, args, tmp_path):
    """Runs `args` with the venv's tools, from an empty folder."""
    return subprocess.run(
        args,
        cwd=tmp_path,
        env=_clean_env(venv),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_installed_package_is_the_wheel(venv, tmp_path):
    result = _run_in(
        venv,
        [
            venv / "bin" / "python",
            "-c",
            "import importlib.util, importlib.metadata as m;"
            f"print(importlib.util.find_spec({PACKAGE!r}).origin);"
            "print(m.distribution('keras-replicator').locate_file(''));"
            # The dev tools did not come along.
            "print(importlib.util.find_spec('pytest'))",
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    origin, location, pytest_spec = result.stdout.split()
    assert pytest_spec == "None"
    site_packages = pathlib.Path(location)
    assert site_packages.is_relative_to(venv)
    # A real file in the venv, not a link into the checkout.
    init = pathlib.Path(origin)
    assert init == site_packages / PACKAGE / "__init__.py"
    assert not init.is_symlink()


def test_command_runs_from_the_wheel(venv, tmp_path):
    result = _run_in(venv, ["keras-replicator", "--help"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for command in ("demo", "launch", "tf-config", "env"):
        assert command in result.stdout


def test_readme_quickstart_trains_from_the_wheel(venv, tmp_path):
    code = _readme_quickstart()
    assert "model.fit(" in code
    result = _run_in(venv, [venv / "bin" / "python", "-c", code], tmp_path)
    assert result.returncode == 0, (
        f"{code}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    )
    assert "Epoch 2/2" in result.stdout, result.stdout[-2000:]


def test_the_gemma_example_names_the_hub_extra_from_the_wheel(venv, tmp_path):
    # The wheel alone has no keras-hub: the example says which extra brings
    # it, in one line, instead of a traceback.
    script = ROOT / "examples" / "gemma_model_parallel.py"
    result = _run_in(venv, [venv / "bin" / "python", script], tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert 'pip install "keras-replicator[hub]"' in line, line


_TENSORBOARD = """
import os, sys
import keras, numpy as np
import keras_replicator as kr
with kr.LocalReplicator(1).scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
model.fit(np.ones((8, 4)), np.ones((8, 1)), epochs=2, verbose=0,
          callbacks=[keras.callbacks.TensorBoard(sys.argv[1])])
events = [f for _, _, fs in os.walk(sys.argv[1]) for f in fs
          if f.startswith("events.out.tfevents")]
print("EVENTS", len(events))
"""


def test_tensorboard_callback_works_from_the_wheel(venv, tmp_path):
    # TensorFlow 2.21 no longer brings tensorboard: the package does.
    result = _run_in(
        venv,
        [venv / "bin" / "python", "-c", _TENSORBOARD, tmp_path / "logs"],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("EVENTS")]
    assert int(line.split()[1]) >= 1, result.stdout


def test_the_mpi_extra_brings_a_working_mpiexec(mpi_venv, tmp_path):
    # `launch --transport mpi` finds the extra's mpiexec beside Python.
    script = tmp_path / "sum.py"
    script.write_text(
        "import keras_replicator as kr\n"
        "import tensorflow as tf\n"
        "r = kr.MultiWorkerReplicator()\n"
        "total = r.reduce('SUM', r.run(lambda: tf.constant(1.0)), None)\n"
        "print('TRANSPORT', r.transport, float(total))\n"
    )
    result = _run_in(
        mpi_venv,
        [
            mpi_venv / "bin" / "keras-replicator",
            "launch",
            "--workers",
            "2",
            "--replicas-per-worker",
            "1",
            "--transport",
            "mpi",
            "--",
            mpi_venv / "bin" / "python",
            script,
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for worker in (0, 1):
        assert f"[worker {worker}] TRANSPORT mpi 2.0" in result.stdout, (
            result.stdout[-3000:]
        )
