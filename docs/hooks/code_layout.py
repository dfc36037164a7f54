"""MkDocs hook: the design page's "Layout of the code", generated from the package itself.

Every module and package of ``lce_patch`` is listed with the first paragraph of its own docstring, so the list
can neither miss a module nor disagree with it. The page marks the spot with ``<!-- code-layout -->``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lce_patch"
MARKER = "<!-- code-layout -->"


def _summary(path: Path) -> str:
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    first_paragraph = " ".join(docstring.strip().split("\n\n")[0].split())
    return re.sub(r":[a-z]+:`", "`", first_paragraph)  # Sphinx roles (:func:`x`) as plain code


def code_layout(package: Path = PACKAGE) -> str:
    """A nested Markdown list: each folder (with its ``__init__`` docstring), then its modules."""
    lines = []

    def walk(folder: Path, depth: int) -> None:
        indent = "    " * depth
        name = folder.relative_to(package.parent).as_posix() + "/"
        init = folder / "__init__.py"
        lines.append(f"{indent}- `{name}`: {_summary(init)}" if init.exists() else f"{indent}- `{name}`")
        for module in sorted(folder.glob("*.py")):
            if module.name != "__init__.py":
                lines.append(f"{indent}    - `{module.name}`: {_summary(module)}")
        for child in sorted(p for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
            walk(child, depth + 1)

    walk(package, 0)
    return "\n".join(lines)


def on_page_markdown(markdown, page, config, files):
    if MARKER in markdown:
        return markdown.replace(MARKER, code_layout())
    return markdown
