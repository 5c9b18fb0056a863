"""The API reference covers the whole public API, from its docstrings.

The reference pages in docs/ are made of mkdocstrings entries
(`::: keras_replicator.Name`) that the site build (`make docs`) fills from
the docstrings, and fails on in strict mode when one does not resolve. These
tests fail when a public name has no entry or no docstring.
"""

import inspect
import pathlib
import re

import keras_replicator as kr

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAMESPACES = ("callbacks", "data", "layers")

# `::: identifier` at the start of a line (mkdocstrings' autodoc syntax).
_ENTRY = re.compile(r"^:::[ \t]+([\w.]+)", re.M)


def _public_names():
    names = {
        f"keras_replicator.{name}": getattr(kr, name) for name in kr.__all__
    }
    for namespace in NAMESPACES:
        module = getattr(kr, namespace)
        for name in module.__all__:
            names[f"keras_replicator.{namespace}.{name}"] = getattr(
                module, name
            )
    return names


def _documented():
    entries = set()
    for page in (ROOT / "docs").rglob("*.md"):
        entries.update(_ENTRY.findall(page.read_text(encoding="utf-8")))
    return entries


def test_every_public_name_has_an_api_entry():
    missing = sorted(set(_public_names()) - _documented())
    assert not missing, (
        f"public names without a `::: name` entry in docs/api/: {missing}"
    )


def test_api_entries_name_public_objects():
    # An entry for a name that left the API would document a ghost; private
    # paths are allowed (the methods every replicator shares live there).
    public = set(_public_names())
    stale = sorted(
        entry
        for entry in _documented()
        if "._src." not in entry
        and entry != "keras_replicator"
        and entry not in public
    )
    assert not stale, f"API entries for names not in any __all__: {stale}"


def test_every_public_name_has_a_docstring():
    undocumented = sorted(
        name
        for name, obj in _public_names().items()
        if not (inspect.getdoc(obj) or "").strip()
    )
    assert not undocumented, f"public names without a docstring: {undocumented}"


def test_namespaces_are_public():
    assert set(NAMESPACES) <= set(kr.__all__)
