"""The one registry of every Keras/TensorFlow attribute this package replaces.

A `Patch` declares:

- `targets`: `Target(owner, name, function)`; `function(original, *args,
  **kwargs)` gets the replaced object (taken at install, never at import)
  first, to fall back to stock behaviour. A property target replaces its
  getter (`function(original_getter, self)`); an `optional` one may be
  missing on the owner (a backend hook TensorFlow's backend never defined:
  `original` is None and uninstalling removes it);
- `applies_to`: the replicator kinds (`core.traits.KINDS`) whose replicators
  install it when created (nothing else installs patches);
- `pins`: `Pin(module, lines, attributes=..., keras=..., tensorflow=...)`,
  the source lines and private attributes of one module it mirrors or relies
  on, per release range (one pin per variant). `tests/test_patches.py` fails
  for every pin of the installed releases whose lines changed;
- `delete_when`: the upstream fix (issue) after which it can go.

Non-optional targets and pinned attributes must exist: `register` (at
import) and `install` raise the unsupported-version `ImportError`
(`core/versions.py`) naming the attribute, not an `AttributeError` inside
`fit`. On a release newer than the supported range, `check_pins` also
compares every pin's lines with the installed source.

One patch owns each attribute (a second registration raises); behaviours on
one method are composed inside the owner (see `trainer_loops`). Replacements
dispatch on the strategy (`core.traits`): no strategy, or a stock
`tf.distribute` one, runs the original.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
import sys
import threading
import types
import warnings
from collections.abc import Callable
from collections.abc import Iterable
from typing import Any

from keras_replicator._src.core import traits
from keras_replicator._src.core import versions

_MISSING = object()


@dataclasses.dataclass(frozen=True)
class Target:
    """One attribute a patch replaces.

    Attributes:
        owner: The class or module whose attribute is replaced.
        name: The attribute's name.
        function: `function(original, *args, **kwargs)`, the replacement.
        optional: Whether the owner may lack the attribute (the patch then
            adds it). Defaults to `False`: a missing attribute means an
            unsupported Keras or TensorFlow.
    """

    owner: Any
    name: str
    function: Callable[..., Any]
    optional: bool = False


@dataclasses.dataclass(frozen=True)
class Pin:
    """Upstream code a patch relies on, all in one module.

    Attributes:
        module: The dotted name of the upstream module.
        lines: Lines (stripped) that must appear in its source.
        attributes: Dotted names in the module (`"Trainer._symbolic_build"`)
            the patch reads or calls without replacing them; each must
            exist. Defaults to none.
        keras: The Keras releases the pin describes, as a pip specifier
            (`"<3.11"`). Defaults to `""`: every supported release.
        tensorflow: The same for TensorFlow.
    """

    module: str
    lines: tuple[str, ...]
    attributes: tuple[str, ...] = ()
    keras: str = ""
    tensorflow: str = ""

    def applies(self) -> bool:
        """Whether the pin describes the installed Keras and TensorFlow."""
        return versions.matches("keras", self.keras) and versions.matches(
            "tensorflow", self.tensorflow
        )


@dataclasses.dataclass(frozen=True)
class Patch:
    """A process-wide replacement of Keras/TensorFlow attributes.

    Attributes:
        name: A unique name (the patch module's name).
        targets: The attributes it replaces.
        applies_to: The replicator kinds that install it.
        pins: Upstream source lines it mirrors or relies on.
        delete_when: The upstream fix after which it can be deleted.
    """

    name: str
    targets: tuple[Target, ...]
    applies_to: frozenset[str]
    pins: tuple[Pin, ...]
    delete_when: str

    def __post_init__(self):
        unknown = set(self.applies_to) - set(traits.KINDS)
        if unknown:
            raise ValueError(
                f"`applies_to` must name replicator kinds {traits.KINDS}. "
                f"Received: applies_to={sorted(self.applies_to)}"
            )


_lock = threading.RLock()
_patches: dict[str, Patch] = {}
_owners: dict[tuple[int, str], str] = {}
# Patch name -> [(target, the owner's own entry or _MISSING, the object the
# attribute resolved to)], while installed.
_installed: dict[str, list[tuple[Target, Any, Any]]] = {}


def register(patch: Patch) -> Patch:
    """Adds `patch` to the registry; returns it.

    Raises:
        ValueError: If its name is taken, or another patch already owns
            one of its attributes.
        ImportError: If an attribute it replaces (not `optional`) or one
            its pins name is missing: an unsupported Keras or TensorFlow.
    """
    _check_hooks(patch)
    with _lock:
        if patch.name in _patches:
            raise ValueError(
                f"A patch named {patch.name!r} is already registered. "
                f"Received: patch={patch.name!r}"
            )
        for target in patch.targets:
            key = (id(target.owner), target.name)
            if key in _owners:
                raise ValueError(
                    f"`{_qualname(target)}` is already replaced by patch "
                    f"{_owners[key]!r}; one patch owns each attribute, "
                    "compose behaviours inside it. Received: "
                    f"patch={patch.name!r}"
                )
        for target in patch.targets:
            _owners[(id(target.owner), target.name)] = patch.name
        _patches[patch.name] = patch
    return patch


def patches() -> tuple[Patch, ...]:
    """Every registered patch, in registration order."""
    return tuple(_patches.values())


def register_pins(name: str, pins: tuple[Pin, ...], reason: str) -> Patch:
    """Pins private code read outside the patches (`upstream/`'s names).

    Checked as a patch's pins are, for a holder with no targets that is not
    among `patches()`. `reason` says when the pins can go. Returns it.
    """
    holder = Patch(
        name=name,
        targets=(),
        applies_to=frozenset(),
        pins=pins,
        delete_when=reason,
    )
    _check_hooks(holder)
    with _lock:
        _pin_holders[name] = holder
    return holder


def pin_holders() -> tuple[Patch, ...]:
    """Every `register_pins` holder, in registration order."""
    return tuple(_pin_holders.values())


_pin_holders: dict[str, Patch] = {}


def for_kind(kind: str) -> tuple[str, ...]:
    """The names of the patches that replicators of `kind` install."""
    return tuple(p.name for p in _patches.values() if kind in p.applies_to)


def install(names: Iterable[str]) -> None:
    """Installs the named patches (each idempotent).

    Originals are taken now, from the owners' own `__dict__`, so `uninstall`
    puts back exactly what was there (or removes an inherited attribute).

    Raises:
        KeyError: If a name is not registered.
        ImportError: If an attribute it replaces is missing (see
            `register`).
    """
    with _lock:
        for name in names:
            patch = _patches[name]
            if name in _installed:
                continue
            _check_targets(patch)
            saved = []
            for target in patch.targets:
                here = vars(target.owner).get(target.name, _MISSING)
                original = getattr(target.owner, target.name, None)
                setattr(
                    target.owner, target.name, _bind(target.function, original)
                )
                saved.append((target, here, original))
            _installed[name] = saved


def uninstall(names: Iterable[str]) -> None:
    """Restores the originals of the named patches (each idempotent)."""
    with _lock:
        for name in names:
            for target, here, _ in reversed(_installed.pop(name, [])):
                if here is _MISSING:
                    delattr(target.owner, target.name)
                else:
                    setattr(target.owner, target.name, here)


def uninstall_all() -> None:
    """Restores every original (for tests and clean shutdown)."""
    with _lock:
        uninstall(list(reversed(list(_installed))))


def installed(name: str | None = None) -> bool | tuple[str, ...]:
    """Whether patch `name` is installed; with no name, the installed ones."""
    with _lock:
        if name is None:
            return tuple(_installed)
        return name in _installed


def original(owner: Any, name: str) -> Any:
    """What `owner.name` resolves to unpatched, for a patch's helpers."""
    with _lock:
        for saved in _installed.values():
            for target, _, resolved in saved:
                if target.owner is owner and target.name == name:
                    return resolved
    return getattr(owner, name)


def check_pins(
    found: dict[str, str] | None = None, checked: Iterable[Patch] | None = None
) -> None:
    """Accepts a newer TensorFlow or Keras only if every patch pin holds.

    Does nothing for supported releases (their pins are tested). On a newer
    release every pin describing it must find its lines and attributes; then
    one `UntestedReleaseWarning` says it runs untested.

    Args:
        found: `{"tensorflow": version, "keras": version}`; defaults to
            the versions this process imports.
        checked: The patches whose pins are compared; defaults to all.

    Raises:
        ImportError: Naming the release, the patch and what its pin no
            longer finds.
    """
    above = versions.newer(found)
    if not above:
        return
    release = " and ".join(above)
    verb = "is" if len(above) == 1 else "are"
    holders = (*patches(), *pin_holders()) if checked is None else checked
    for patch in holders:
        for pin in patch.pins:
            if not pin.applies():
                continue
            module = importlib.import_module(pin.module)
            source = inspect.getsource(module)
            gone = [line for line in pin.lines if line not in source]
            gone += [
                f"attribute {dotted}"
                for dotted in pin.attributes
                if _resolve(module, dotted) is _MISSING
            ]
            if gone:
                raise versions.unsupported(
                    f"{release} {verb} newer than the supported releases, "
                    f"and patch {patch.name!r} pins code {pin.module} no "
                    f"longer has: {gone}.",
                    found,
                )
    warnings.warn(
        f"{release} {verb} newer than keras-replicator's tested releases; "
        "every patch pin holds, so it runs untested.",
        versions.UntestedReleaseWarning,
        stacklevel=_importer_stacklevel(),
    )


def _importer_stacklevel() -> int:
    # The first frame outside this package and the import machinery (which
    # `warnings` does not count): the user's `import keras_replicator`.
    frame, level = sys._getframe(2), 2
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("importlib._bootstrap"):
            frame = frame.f_back
            continue
        if not name.startswith("keras_replicator"):
            break
        frame, level = frame.f_back, level + 1
    return level


def _resolve(module, dotted: str) -> Any:
    owner = module
    for part in dotted.split("."):
        owner = getattr(owner, part, _MISSING)
        if owner is _MISSING:
            break
    return owner


def _bind(function, original):
    if isinstance(original, property):
        getter = original.fget

        @functools.wraps(getter)
        def read(self):
            return function(getter, self)

        read.__keras_replicator_patch__ = True
        return property(read, original.fset, original.fdel, original.__doc__)

    @functools.wraps(original or function)
    def replacement(*args, **kwargs):
        return function(original, *args, **kwargs)

    replacement.__keras_replicator_patch__ = True
    return replacement


def _check_hooks(patch: Patch) -> None:
    """Raises the unsupported-version error for a missing private hook."""
    _check_targets(patch)
    for pin in patch.pins:
        if not pin.applies():
            continue
        module = importlib.import_module(pin.module)
        for dotted in pin.attributes:
            if _resolve(module, dotted) is _MISSING:
                raise _missing(patch, f"{pin.module}.{dotted}")


def _check_targets(patch: Patch) -> None:
    for target in patch.targets:
        if not target.optional and not hasattr(target.owner, target.name):
            if isinstance(target.owner, types.ModuleType):
                dotted = f"{target.owner.__name__}.{target.name}"
            else:
                dotted = f"{target.owner.__module__}.{_qualname(target)}"
            raise _missing(patch, dotted)


def _missing(patch: Patch, dotted: str) -> ImportError:
    above = versions.newer()
    if above:
        verb = "is" if len(above) == 1 else "are"
        return versions.unsupported(
            f"{' and '.join(above)} {verb} newer than the supported "
            f"releases, and patch {patch.name!r} needs `{dotted}`, which "
            "it lacks."
        )
    return versions.unsupported(
        f"Patch {patch.name!r} needs `{dotted}`, which the installed Keras "
        "or TensorFlow lacks."
    )


def _qualname(target: Target) -> str:
    owner = getattr(target.owner, "__qualname__", None) or getattr(
        target.owner, "__name__", repr(target.owner)
    )
    return f"{owner}.{target.name}"


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def call_original(original: Callable[..., Any], *args, **kwargs) -> Any:
    """Calls `original` as if no patch stood between it and its caller.

    A warning whose `stacklevel` points at the caller would name this
    package's file; it is attributed to the first caller outside the
    package, with its module, so filters by module still apply
    (`replicators/multi_worker.py` keeps Keras' warnings to the chief).
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = original(*args, **kwargs)
    for warning in caught:
        filename, lineno = warning.filename, warning.lineno
        module, frame = _module_of(filename), None
        if _is_ours(filename):
            frame = sys._getframe(1)
            while frame is not None and _is_ours(frame.f_code.co_filename):
                frame = frame.f_back
        if frame is not None:
            filename, lineno = frame.f_code.co_filename, frame.f_lineno
            module = frame.f_globals.get("__name__", module)
        warnings.warn_explicit(
            warning.message, warning.category, filename, lineno, module=module
        )
    return result


def _is_ours(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep)


def _module_of(filename: str) -> str | None:
    for name, module in list(sys.modules.items()):
        if getattr(module, "__file__", None) == filename:
            return name
    return None
