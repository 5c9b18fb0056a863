"""Keeps TensorFlow out of `keras-replicator --help`, `launch` and `tf-config`.

The command's entry point, `keras_replicator._src.cli.main`, lives inside
the package, so Python runs `keras_replicator/__init__.py` before it; that
file imports TensorFlow (5-8 s and a screen of C++ logs on a small machine)
for the public names and splits the CPU at import. In the command's own
process, and only there, the package skips those imports (`defer`), and the
commands that need TensorFlow (`env`, `demo`) load them first (`load`), so
they run exactly as after a plain `import keras_replicator`. Every other
program, a training script, a notebook or a worker the launcher starts,
imports the package as before.

TensorFlow-free: this module is imported by `keras_replicator/__init__.py`
before anything else.
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

# None until `defer` decides, once per process; then whether the package's
# imports are still waiting for `load`.
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

    True only in the `keras-replicator` command's process, before `load`.

    Returns:
        True to skip them (the package then loads them on first attribute
        access, or when a command calls `load`).
    """
    global _deferred
    if _deferred is None:
        _deferred = _is_the_command()
    return _deferred


def load() -> types.ModuleType:
    """Runs the package's deferred imports, once; returns the package.

    Does nothing when the package was imported in full (every process but
    the command's, or after a first call).

    Returns:
        The `keras_replicator` module, with every public name.
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

    Args:
        name: A public name of the package, such as `"LocalReplicator"`.

    Returns:
        Its value.

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
