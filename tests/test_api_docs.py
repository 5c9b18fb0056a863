"""The API reference covers the whole public API, from its docstrings.

The reference pages in docs/ are made of mkdocstrings entries
(`::: keras_replicator.Name`) that the site build (`make docs`) fills from
the docstrings, and fails on in strict mode when one does not resolve. These
tests fail when a public name has no entry or no docstring, and when
README.md, a page of docs/ or a public docstring names a `kr.`,
`keras_replicator.` or `keras.distribution.` name that does not exist.
"""

import importlib
import inspect
import pathlib
import re

import keras_replicator as kr

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAMESPACES = ("callbacks", "data", "layers")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# `::: identifier` at the start of a line (mkdocstrings' autodoc syntax).
_ENTRY = re.compile(r"^:::[ \t]+([\w.]+)", re.M)
# A name a page or docstring tells the reader to use, in prose or code
# (`kr.is_chief()`, `keras_replicator.data.shard`,
# `keras.distribution.initialize()`), with its attributes.
_USED = re.compile(
    r"(?<![\w.])(kr|keras_replicator|keras\.distribution)((?:\.[A-Za-z_]\w*)+)"
)


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


def _exists(root, attributes):
    path = "keras_replicator" if root == "kr" else root
    value = importlib.import_module(path)
    for attribute in attributes:
        path += f".{attribute}"
        try:
            value = getattr(value, attribute)
        except AttributeError:
            try:  # A module not imported yet (`keras_replicator._src...`).
                value = importlib.import_module(path)
            except ImportError:
                return False
    return True


def _texts():
    for page in PAGES:
        yield page.relative_to(ROOT).as_posix(), page.read_text("utf-8")
    for name, obj in _public_names().items():
        yield f"the docstring of {name}", inspect.getdoc(obj) or ""


def test_every_name_the_pages_use_exists():
    # Prose and ```text blocks too: ```python blocks also run
    # (tests/test_doc_examples.py), the others never do.
    missing = []
    for where, text in _texts():
        for used in _USED.finditer(text):
            if not _exists(used.group(1), used.group(2).split(".")[1:]):
                line = text.count("\n", 0, used.start()) + 1
                missing.append(f"{where}:{line}: {used.group(0)}")
    assert not missing, f"names that do not exist: {missing}"


def test_the_name_check_sees_a_missing_name():
    assert _exists("kr", ["process_index"])
    assert _exists("keras.distribution", ["initialize"])
    assert _exists("keras_replicator", ["_src", "distribution", "processes"])
    assert not _exists("kr", ["no_such_name"])
    assert not _exists("keras.distribution", ["no_such_name"])
    assert not _exists("keras_replicator", ["_src", "no_such_module"])
