"""docs/api.md matches the public API's docstrings, and covers all of it."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _gen():
    spec = importlib.util.spec_from_file_location(
        "gen_api", ROOT / "docs" / "gen_api.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_matches_docstrings():
    gen = _gen()
    expected = gen.render()
    actual = (ROOT / "docs" / "api.md").read_text()
    assert actual == expected, "run: python docs/gen_api.py"


def test_every_public_name_has_a_docstring():
    for name, obj in _gen()._entries():
        assert (obj.__doc__ or "").strip(), f"{name} has no docstring"
