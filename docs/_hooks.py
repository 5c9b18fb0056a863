"""MkDocs hooks: the pages may link to repository files outside docs/.

A page links to a repository file by its relative path from the page, such as
`../benchmarks/scaling.png` from `docs/speed.md`, so the link also works when
the Markdown is read on a code host. MkDocs only knows files under docs/; these
hooks add every repository file a page links to (under its repository path,
e.g. `benchmarks/scaling.png` in the site) and rewrite the page's links to
it. A link to a file that does not exist is left alone, so the strict build
reports it.
"""

import pathlib
import posixpath
import re

from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# Markdown links and images with a relative target: ](../x) or ](../x#anchor).
_LINK = re.compile(r"\]\((\.\./[^)\s#]+)(#[^)\s]*)?\)")


def _outside_target(page_uri: str, target: str) -> str | None:
    """Returns the repository path a page's `../` link names, if outside docs/.

    Args:
        page_uri: The page's path under docs/, such as `speed.md`.
        target: The link's target, such as `../benchmarks/scaling.png`.

    Returns:
        The repository-relative path (`benchmarks/scaling.png`) when the link
        leaves docs/ and names an existing file, else `None`.
    """
    path = posixpath.normpath(
        posixpath.join("docs", posixpath.dirname(page_uri), target)
    )
    if path.startswith(("docs/", "../")) or not (ROOT / path).is_file():
        return None
    return path


def on_files(files, config):
    """Adds the repository files outside docs/ that the pages link to."""
    wanted = set()
    for page in sorted(DOCS.rglob("*.md")):
        uri = page.relative_to(DOCS).as_posix()
        for target, _ in _LINK.findall(page.read_text(encoding="utf-8")):
            path = _outside_target(uri, target)
            if path is not None:
                wanted.add(path)
    for path in sorted(wanted):
        if files.get_file_from_path(path) is None:
            files.append(
                File(
                    path,
                    src_dir=str(ROOT),
                    dest_dir=config["site_dir"],
                    use_directory_urls=config["use_directory_urls"],
                )
            )
    return files


def on_page_markdown(markdown, page, config, files):
    """Points a page's links to repository files at their copies in the site."""
    uri = page.file.src_uri

    def rewrite(match):
        target, anchor = match.group(1), match.group(2) or ""
        path = _outside_target(uri, target)
        if path is None:
            return match.group(0)
        new = posixpath.relpath(path, posixpath.dirname(uri) or ".")
        return f"]({new}{anchor})"

    return _LINK.sub(rewrite, markdown)
