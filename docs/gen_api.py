"""Generates docs/api.md from the public API's signatures and docstrings.

    python docs/gen_api.py          # rewrite docs/api.md
    python docs/gen_api.py --check  # exit 1 if docs/api.md is out of date

tests/test_api_docs.py runs the check, so the reference always matches the
docstrings.
"""

import inspect
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "api.md"


def _entries():
    import keras_replicator as kr

    namespaces = [("kr", kr)]
    for name in ("callbacks", "layers", "data"):
        namespaces.append((f"kr.{name}", getattr(kr, name)))
    for prefix, module in namespaces:
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj):
                continue
            yield f"{prefix}.{name}", obj


def _signature(obj):
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""


def render() -> str:
    lines = [
        "# API reference",
        "",
        "Generated from the docstrings by `python docs/gen_api.py`; do not",
        "edit by hand. `import keras_replicator as kr`.",
        "",
    ]
    entries = list(_entries())
    lines.append("## Contents")
    lines.append("")
    for name, _ in entries:
        anchor = name.replace(".", "").lower()
        lines.append(f"- [`{name}`](#{anchor})")
    lines.append("")
    for name, obj in entries:
        kind = "class" if inspect.isclass(obj) else "function"
        lines.append(f"## {name}")
        lines.append("")
        lines.append(f"```python\n{kind} {name}{_signature(obj)}\n```")
        lines.append("")
        doc = inspect.getdoc(obj) or "(no docstring)"
        lines.append(doc)
        lines.append("")
    return "\n".join(lines)


def main():
    text = render()
    if "--check" in sys.argv:
        if not OUT.exists() or OUT.read_text() != text:
            print("docs/api.md is out of date: run python docs/gen_api.py")
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
