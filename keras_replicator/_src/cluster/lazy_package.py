"""Keeps TensorFlow out of `keras-replicator --help`, `launch` and `tf-config`.

The command's entry point, `keras_replicator._src.cli.main`, is inside the
package, so Python first runs `keras_replicator/__init__.py`, which imports
TensorFlow for the public names (5-8 s and a screen of C++ logs on a small
machine) and splits the CPU. Only in the command's own process, the package
skips those imports (`defer`); commands needing TensorFlow (`env`, `demo`)
`load` them first, exactly as a plain `import keras_replicator` would.
Scripts, notebooks and launched workers import the package as before.
TensorFlow-free: `keras_replicator/__init__.py` imports it before anything.
"""

from __future__ import annotations

import importlib
import os
import sys
import types

PACKAGE = "keras_replicator"
# The console script `keras-replicator` (pyproject.toml) and the module it
# runs, which `python -m` runs too.
COMMAND = "keras-replicator"
CLI_MODULE = "keras_replicator._src.cli.main"

# None until `defer` decides (once per process); then whether imports await
# `load`.
_deferred: bool | None = None


def _is_the_command() -> bool:
    """Whether this process is starting the `keras-replicator` command."""
    # The console script: its path is argv[0] while it imports the CLI.
    name = os.path.basename(sys.argv[0]) if sys.argv else ""
    if name in (COMMAND, f"{COMMAND}.exe"):
        return True
    # `python -m <module>`: argv[0] is "-m" until the module is found, and
    # the module's name is in the interpreter's own arguments.
    if sys.argv[:1] != ["-m"]:
        return False
    argv = list(getattr(sys, "orig_argv", ()))
    for i, arg in enumerate(argv[1:], start=1):
        if arg == "-m":
            return argv[i + 1 : i + 2] == [CLI_MODULE]
        if arg.startswith("-m"):
            return arg[2:] == CLI_MODULE
    return False


def defer() -> bool:
    """Whether `keras_replicator/__init__.py` should skip its imports now.

    True only in the `keras-replicator` command's process, before `load`; the
    package then loads them on first attribute access or on `load`.
    """
    global _deferred
    if _deferred is None:
        _deferred = _is_the_command()
    return _deferred


def load() -> types.ModuleType:
    """Runs the package's deferred imports, once; returns the package.

    A no-op if the package was imported in full (every process but the
    command's, or after a first call).
    """
    global _deferred
    package = sys.modules[PACKAGE]
    if _deferred:
        _deferred = False
        # The version check `keras_replicator/_src/__init__.py` skipped.
        from keras_replicator._src.core import versions

        versions.check()
        # Runs `__init__.py` again in the same module object, now with its
        # imports: submodules imported meanwhile (the CLI) stay as they are.
        importlib.reload(package)
    return package


def attribute(name: str):
    """The package's `name`, loading the package first if it waits.

    The package's module `__getattr__` while its imports are deferred.

    Raises:
        AttributeError: If the package has no such name.
    """
    package = load()
    try:
        return package.__dict__[name]
    except KeyError:
        raise AttributeError(
            f"module {PACKAGE!r} has no attribute {name!r}"
        ) from None
