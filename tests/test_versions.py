"""Supported TensorFlow and Keras versions: declared once, checked at import."""

import os
import pathlib
import subprocess
import sys
import textwrap

import keras
import pytest
import tensorflow as tf
from keras.src.backend.tensorflow import distribution_lib as backend_lib

from keras_replicator._src import upstream
from keras_replicator._src.core import versions
from keras_replicator._src.patches import registry

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOUND = {"tensorflow": tf.__version__, "keras": keras.__version__}


def _import_keras_replicator_after(code):
    """Runs `code`, then `import keras_replicator`, in a fresh process."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
    )
    script = textwrap.dedent(code) + "\nimport keras_replicator\n"
    return subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_pyproject_declares_the_supported_ranges():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for name, spec in versions.SUPPORTED.items():
        assert f"{name}{spec}" in project["dependencies"]


def test_the_installed_pair_is_supported():
    versions.check()
    assert versions.installed() == FOUND


@pytest.mark.parametrize(
    ("found", "problem"),
    [
        ({"tensorflow": "2.18.0", "keras": "3.15.1"}, "TensorFlow 2.18.0 is"),
        ({"tensorflow": "2.19.0rc0", "keras": "3.15.1"}, "2.19.0rc0 is"),
        ({"tensorflow": "2.21.0", "keras": "3.9.0"}, "Keras 3.9.0 is"),
        (
            {"tensorflow": "2.18.1", "keras": "3.8.0"},
            "TensorFlow 2.18.1 and Keras 3.8.0 are",
        ),
        # Newer and older: the older one refuses, both are named.
        (
            {"tensorflow": "2.23.0", "keras": "3.9.0"},
            "TensorFlow 2.23.0 and Keras 3.9.0 are",
        ),
    ],
)
def test_versions_outside_the_range_are_refused(found, problem):
    with pytest.raises(ImportError) as raised:
        versions.check(found)
    message = str(raised.value)
    assert problem in message
    assert "tensorflow>=2.19,<2.23 and keras>=3.10,<3.17" in message
    received = f"tensorflow={found['tensorflow']}, keras={found['keras']}"
    assert message.endswith(f"Received: {received}")


@pytest.mark.parametrize(
    "found",
    [
        {"tensorflow": "2.19.0", "keras": "3.10.0"},
        {"tensorflow": "2.21.0rc1", "keras": "3.13.2"},
        {"tensorflow": "2.21.9", "keras": "3.15.99"},
        {"tensorflow": "2.22.0rc0", "keras": "3.16.0.dev2026102704"},
    ],
)
def test_versions_inside_the_range_are_accepted(found):
    versions.check(found)
    assert versions.newer(found) == []


@pytest.mark.parametrize(
    ("found", "newer"),
    [
        ({"tensorflow": "2.23.0", "keras": "3.15.1"}, ["TensorFlow 2.23.0"]),
        (
            {"tensorflow": "2.23.0rc0", "keras": "3.15.1"},
            ["TensorFlow 2.23.0rc0"],
        ),
        (
            {"tensorflow": "2.21.0", "keras": "3.17.0.dev1"},
            ["Keras 3.17.0.dev1"],
        ),
        (
            {"tensorflow": "3.0.0", "keras": "4.0.0"},
            ["TensorFlow 3.0.0", "Keras 4.0.0"],
        ),
    ],
)
def test_newer_releases_are_left_to_the_pins(found, newer):
    # Not refused by the range: `registry.check_pins` decides on them.
    versions.check(found)
    assert versions.newer(found) == newer


def test_a_newer_release_warns_when_every_pin_holds():
    found = {"tensorflow": "2.23.0", "keras": keras.__version__}
    holding = registry.Pin(
        "keras.src.backend.tensorflow.trainer",
        ("def test_step(self, data):",),
        attributes=(f"{upstream.TF_TRAINER}.test_step",),
    )
    with pytest.warns(versions.UntestedReleaseWarning) as warned:
        registry.check_pins(found, [_patch(pins=(holding,))])
    assert [str(w.message) for w in warned] == [
        "TensorFlow 2.23.0 is newer than keras-replicator's tested "
        "releases; every patch pin holds, so it runs untested."
    ]


def test_a_newer_release_is_refused_when_a_pin_fails():
    found = {"tensorflow": "2.21.0", "keras": "3.17.0"}
    failing = registry.Pin(
        "keras.src.backend.tensorflow.trainer",
        ("def test_step(self, data):", "no such line"),
        attributes=(f"{upstream.TF_TRAINER}._no_such_hook",),
    )
    with pytest.raises(ImportError) as raised:
        registry.check_pins(found, [_patch(pins=(failing,))])
    message = str(raised.value)
    assert message.startswith(
        "Keras 3.17.0 is newer than the supported releases, and patch "
        "'test_versions_missing_hook' pins code "
        "keras.src.backend.tensorflow.trainer no longer has: "
        f"['no such line', 'attribute {upstream.TF_TRAINER}._no_such_hook']. "
        "keras-replicator supports tensorflow>=2.19,<2.23"
    )
    assert message.endswith("Received: tensorflow=2.21.0, keras=3.17.0")


def test_the_pins_of_a_supported_release_are_left_to_the_tests():
    failing = registry.Pin("keras", ("no such line",))
    registry.check_pins(FOUND, [_patch(pins=(failing,))])


def test_import_of_a_newer_release_warns_in_one_line():
    # The real import, every registered pin compared with the source.
    result = _import_keras_replicator_after(
        """
        import tensorflow as tf
        tf.__version__ = "2.23.0"
        """
    )
    assert result.returncode == 0, result.stderr
    warned = [
        line
        for line in result.stderr.splitlines()
        if "UntestedReleaseWarning" in line
    ]
    assert warned == [
        "<string>:5: UntestedReleaseWarning: TensorFlow 2.23.0 is newer "
        "than keras-replicator's tested releases; every patch pin holds, "
        "so it runs untested."
    ]


def test_import_of_a_newer_release_lacking_a_private_hook_is_refused():
    result = _import_keras_replicator_after(
        f"""
        import tensorflow as tf
        tf.__version__ = "2.23.0"
        from keras.src.backend.tensorflow import trainer
        del trainer.{upstream.TF_TRAINER}.test_step
        """
    )
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "ImportError: TensorFlow 2.23.0 is newer than the supported "
        "releases, and patch 'exact_eval' needs `keras.src.backend."
        f"tensorflow.trainer.{upstream.TF_TRAINER}.test_step`, which it "
        "lacks."
    )
    assert last.endswith(
        f"Received: tensorflow=2.23.0, keras={keras.__version__}"
    )


def test_import_refuses_an_unsupported_tensorflow():
    # The real check, on the version TensorFlow reports.
    result = _import_keras_replicator_after(
        """
        import tensorflow as tf
        tf.__version__ = "2.18.0"
        """
    )
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: TensorFlow 2.18.0 is not supported.")
    assert "supports tensorflow>=2.19,<2.23 and keras>=3.10,<3.17" in last
    assert last.endswith(
        f"Received: tensorflow=2.18.0, keras={keras.__version__}"
    )


def test_import_reports_a_missing_private_hook():
    # As a Keras release without the private method a patch replaces.
    result = _import_keras_replicator_after(
        f"""
        from keras.src.backend.tensorflow import trainer
        del trainer.{upstream.TF_TRAINER}.test_step
        """
    )
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "ImportError: Patch 'exact_eval' needs `keras.src.backend."
        f"tensorflow.trainer.{upstream.TF_TRAINER}.test_step`, which the "
        "installed Keras or TensorFlow lacks."
    )
    assert last.endswith(
        f"Received: tensorflow={tf.__version__}, keras={keras.__version__}"
    )


class _Owner:
    def hook(self):
        return "stock"


def _patch(targets=(), pins=()):
    return registry.Patch(
        name="test_versions_missing_hook",
        targets=targets,
        applies_to=frozenset({"local"}),
        pins=pins,
        delete_when="never",
    )


def test_a_missing_replaced_attribute_fails_registration():
    target = registry.Target(_Owner, "_gone", lambda original, self: None)
    with pytest.raises(ImportError, match=r"needs `tests\.test_versions\."):
        registry.register(_patch(targets=(target,)))
    assert "test_versions_missing_hook" not in {
        p.name for p in registry.patches()
    }


def test_a_missing_pinned_attribute_fails_registration():
    pin = registry.Pin(
        "keras.src.backend.tensorflow.trainer",
        (),
        attributes=(f"{upstream.TF_TRAINER}._no_such_hook",),
    )
    with pytest.raises(
        ImportError,
        match="needs `keras.src.backend.tensorflow.trainer."
        f"{upstream.TF_TRAINER}._no_such_hook`",
    ):
        registry.register(_patch(pins=(pin,)))


def test_a_pin_of_other_releases_is_not_checked():
    pin = registry.Pin(
        "keras.src.backend.tensorflow.trainer",
        (),
        attributes=(f"{upstream.TF_TRAINER}._no_such_hook",),
        keras="<3.0",
    )
    assert not pin.applies()
    registry._check_hooks(_patch(pins=(pin,)))


def test_an_optional_target_may_be_missing():
    assert not hasattr(backend_lib, "_keras_replicator_no_such_hook")
    target = registry.Target(
        backend_lib,
        "_keras_replicator_no_such_hook",
        lambda original: original,
        optional=True,
    )
    registry._check_hooks(_patch(targets=(target,)))
