"""Every ```python block in README.md and docs/ runs as written.

Each block runs in a fresh process, from an empty directory. Blocks meant
only to be read (they need a cluster, a TPU or a script around them) are
fenced as ```text, ```sh, ```bash or ```yaml; only ```python, ```py and
```python3 fences run.
"""

import pathlib
import re

import pytest

from tests.multi_worker import harness

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_LINES = 200

_FENCE = re.compile(r"^```[ \t]*(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
_RUNNABLE = ("python", "py", "python3")
# What a page may import beyond keras-replicator's requirements, and the
# extra (pyproject.toml) that installs it.
EXTRAS = {
    "keras_hub": "hub",
    "keras_tuner": "tuner",
    "mpi4py": "mpi",
    "sklearn": "demo",
    "tensorflow_datasets": "datasets",
}
_IMPORT = re.compile(r"^\s*(?:import|from)\s+(\w+)", re.M)


def _python_blocks():
    blocks = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        name = page.relative_to(ROOT).as_posix()
        for match in _FENCE.finditer(text):
            if match.group(1).lower() in _RUNNABLE:
                line = text.count("\n", 0, match.start()) + 1
                blocks.append((f"{name}:{line}", match.group(2)))
    return blocks


BLOCKS = _python_blocks()


def test_readme_and_pages_have_python_examples():
    pages = {label.split(":")[0] for label, _ in BLOCKS}
    assert "README.md" in pages, "README.md has no ```python block to run"
    assert len(pages) > 1, "no page in docs/ has a ```python block to run"


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; keep it at most "
        f"{README_MAX_LINES} and move details into a page in docs/"
    )


def test_readme_documentation_list_names_each_page_once():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Documentation\n", 1)[1].split("\n## ", 1)[0]
    lines = section.strip().splitlines()
    # One item per page: "- [Page](link): ...", its continuation lines
    # indented under it, no blank line or stray fragment between.
    strays = [ln for ln in lines if not ln.startswith(("- ", "  ")) or not ln]
    assert not strays, f"README's Documentation list has strays: {strays}"
    links = re.findall(r"\]\(([^)]+)\)", section)
    repeated = sorted({link for link in links if links.count(link) > 1})
    assert not repeated, f"README's Documentation list repeats {repeated}"


def test_a_block_that_needs_an_extra_says_which():
    # A reader who copies a block must know what to install first: the
    # block, or the paragraph that introduces it, names the extra.
    unsaid = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in _FENCE.finditer(text):
            code = match.group(2)
            before = text[: match.start()].rstrip().rsplit("\n\n", 1)[-1]
            for module in sorted(set(_IMPORT.findall(code)) & set(EXTRAS)):
                extra = f"[{EXTRAS[module]}]"
                if extra not in before and extra not in code:
                    line = text.count("\n", 0, match.start()) + 1
                    name = page.relative_to(ROOT).as_posix()
                    unsaid.append(f"{name}:{line} imports {module}: {extra}")
    assert not unsaid, f"blocks that do not name their extra: {unsaid}"


def test_readme_links_exist():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)\s#]+)[^)]*\)", text):
        if "://" in target:
            continue
        assert (ROOT / target).exists(), f"README.md links to {target}"


@pytest.mark.parametrize(
    "label, code", BLOCKS, ids=[label for label, _ in BLOCKS]
)
def test_python_block_runs(label, code, tmp_path):
    # A fresh process (from the tests' zygote, which imported TensorFlow
    # and Keras once), in an empty directory.
    result = harness.run_python(["-c", code], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, (
        f"the block at {label} failed:\n{code}\n"
        f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    )
