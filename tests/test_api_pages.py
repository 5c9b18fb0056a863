"""The API reference pages read in the repository, not only on the site.

A `::: name` entry is filled from the docstring by the site build; in the
repository it is one bare line. So each entry is followed by a line of
prose that names it and says what it is (entries without a heading of
their own, `show_root_heading: false`, sit under a written heading and
its prose).
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs" / "api").glob("*.md"))
# An entry, its indented options, then what follows it.
_ENTRY = re.compile(r"^:::[ \t]+([\w.]+)[ \t]*\n((?:[ \t]+\S.*\n)*)", re.M)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_api_entry_has_a_line_of_prose_under_it(page):
    text = page.read_text(encoding="utf-8")
    bare = []
    for entry in _ENTRY.finditer(text):
        if "show_root_heading: false" in entry.group(2):
            continue
        after = text[entry.end() :].lstrip("\n").split("\n", 1)[0]
        name = entry.group(1).rpartition(".")[2]
        if after.startswith(":::") or f"{name}" not in after:
            bare.append(entry.group(1))
    assert not bare, f"{page.name}: entries without a line of prose: {bare}"
