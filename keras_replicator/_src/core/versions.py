"""The TensorFlow and Keras versions keras-replicator supports, checked once.

The patches (`patches/`) replace and mirror private Keras and TensorFlow
code, which changes between releases, so the package supports the releases
it was tested on and refuses older ones when it is imported
(`keras_replicator/_src/__init__.py` calls `check`), with an `ImportError`
naming what it found and what it supports. A private attribute a patch
needs and a supported version lacks is reported the same way when the
patch registers (`patches/registry.py`), never as an `AttributeError`
inside `fit`.

A release newer than the range (`newer`) is not refused outright: users
upgrade TensorFlow the day it ships, and most releases leave the private
code the patches mirror alone. Once every patch has registered,
`registry.check_pins` compares each pin with the installed code: if all
hold, the import goes on with one `UntestedReleaseWarning`; a pin that
fails refuses the import, naming the pin and the release.

`pyproject.toml` declares the same ranges (`tests/test_versions.py` keeps
them equal). Tested: each supported TensorFlow with the oldest and the
newest Keras it installs with (`TESTED`); Keras releases in between are
untested but expected to work.

Version-conditional code elsewhere asks `keras_before("3.11")` and says in
a comment which releases it serves and when it can go: when the oldest
supported Keras has the newer behaviour.
"""

from __future__ import annotations

import functools

from packaging import specifiers
from packaging import version

# The releases supported, as pip specifiers (pyproject.toml's, too).
SUPPORTED = {
    "tensorflow": ">=2.19,<2.23",
    "keras": ">=3.10,<3.17",
}
# The (TensorFlow, Keras) pairs the test suite runs on (`make test` on
# 2.21.0 + 3.15.1, `make test-compat` on the others): the last two are the
# next releases' candidate and nightly builds (the Makefile's
# COMPAT_NEXT_PAIRS).
TESTED = (
    ("2.19.1", "3.10.0"),
    ("2.20.0", "3.12.0"),
    ("2.21.0", "3.15.1"),
    ("2.22.0rc0", "3.15.1"),
    ("2.21.0", "3.16.0.dev (nightly)"),
)
_NAMES = {"tensorflow": "TensorFlow", "keras": "Keras"}


class UntestedReleaseWarning(UserWarning):
    """A TensorFlow or Keras newer than the supported range is imported."""


def installed() -> dict[str, str]:
    """The versions of TensorFlow and Keras this process imports."""
    import keras
    import tensorflow as tf

    return {"tensorflow": tf.__version__, "keras": keras.__version__}


def supported_range() -> str:
    """The supported ranges and tested pairs, in words, for messages."""
    ranges = " and ".join(f"{name}{spec}" for name, spec in SUPPORTED.items())
    tested = ", ".join(
        f"TensorFlow {tf_v} + Keras {keras_v}" for tf_v, keras_v in TESTED
    )
    return f"keras-replicator supports {ranges} (tested: {tested})"


def unsupported(problem: str, found: dict[str, str] | None = None):
    """The `ImportError` for an unsupported TensorFlow or Keras.

    Args:
        problem: What is wrong, one sentence.
        found: The versions found; defaults to `installed()`.

    Returns:
        An `ImportError` saying `problem`, what is supported and how to get
        it, then `Received:` the versions found.
    """
    found = installed() if found is None else found
    received = ", ".join(f"{name}={v}" for name, v in found.items())
    pins = " ".join(f'"{name}{spec}"' for name, spec in SUPPORTED.items())
    return ImportError(
        f"{problem} {supported_range()}. Install a supported pair, e.g. "
        f"`pip install {pins}`. Received: {received}"
    )


def check(found: dict[str, str] | None = None) -> None:
    """Raises unless TensorFlow and Keras are supported or newer versions.

    A newer version (`newer`) passes here; the patches' pins decide on it
    once they have registered (`registry.check_pins`).

    Args:
        found: `{"tensorflow": version, "keras": version}`; defaults to
            the versions this process imports.

    Raises:
        ImportError: If either version is older than `SUPPORTED`, or is
            outside it and not newer (a pre-release of the first
            supported release).
    """
    found = installed() if found is None else found
    outside = [
        f"{_NAMES[name]} {found[name]}"
        for name, spec in SUPPORTED.items()
        if not _contains(spec, found[name])
    ]
    # Refused with every version outside the range named, a newer one too.
    if len(outside) > len(newer(found)):
        verb = "is" if len(outside) == 1 else "are"
        raise unsupported(
            f"{' and '.join(outside)} {verb} not supported.", found
        )


def newer(found: dict[str, str] | None = None) -> list[str]:
    """The versions newer than every supported release, as "TensorFlow 2.23.0".

    Args:
        found: `{"tensorflow": version, "keras": version}`; defaults to
            the versions this process imports.

    Returns:
        "TensorFlow x" and/or "Keras y", in that order; empty when both
        are in (or below) the range.
    """
    found = installed() if found is None else found
    return [
        f"{_NAMES[name]} {found[name]}"
        for name, spec in SUPPORTED.items()
        if not _contains(spec, found[name]) and _above(spec, found[name])
    ]


def matches(package: str, spec: str) -> bool:
    """Whether the installed `package` ("tensorflow" or "keras") is in `spec`.

    An empty `spec` matches every version.
    """
    return not spec or _contains(spec, _installed_version(package))


def keras_before(release: str) -> bool:
    """Whether the installed Keras is older than `release` (e.g. "3.11")."""
    return version.Version(_installed_version("keras")) < version.Version(
        release
    )


def batch_end_step(model, batch: int) -> int:
    """The last step of the execution whose `on_train_batch_end` got `batch`.

    Keras 3.11 and later pass that step; Keras 3.10 passes the execution's
    first step (its loops yield `(step, iterator)`, not `(begin_step,
    end_step, iterator)`), and an execution runs `steps_per_execution`
    steps, as 3.11 counts them.
    TODO: delete when the oldest supported Keras is 3.11.
    """
    if keras_before("3.11"):
        return batch + (getattr(model, "steps_per_execution", 1) or 1) - 1
    return batch


@functools.cache
def _installed_version(package: str) -> str:
    return installed()[package]


def _above(spec: str, found: str) -> bool:
    # Above the range's upper bound: 2.23.0, and its pre-releases 2.23.0rc0
    # and 2.23.0.dev1, for "<2.23".
    found = version.Version(found)
    uppers = [
        s for s in specifiers.SpecifierSet(spec) if s.operator in ("<", "<=")
    ]
    return bool(uppers) and all(
        found > version.Version(s.version)
        or (
            s.operator == "<"
            and version.Version(found.base_version)
            >= version.Version(s.version)
        )
        for s in uppers
    )


def _contains(spec: str, found: str) -> bool:
    # Pre-releases of a supported release count (2.21.0rc1); a "<2.22"
    # bound still excludes 2.22's.
    return specifiers.SpecifierSet(spec).contains(found, prereleases=True)
