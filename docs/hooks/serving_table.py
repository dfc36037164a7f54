"""MkDocs hook: the Trainer and TRL page's trainer table, generated from the serving table
(``lce_patch/integrations/serving.py``), so the page can neither miss a served trainer nor disagree with the code.

The page marks the spot with ``<!-- serving-table -->``. The serving module imports only the standard library and
is loaded from its file, so the docs build needs neither torch nor TRL.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SERVING = Path(__file__).resolve().parents[2] / "lce_patch" / "integrations" / "serving.py"
MARKER = "<!-- serving-table -->"


def _serving():
    spec = importlib.util.spec_from_file_location("_lce_patch_serving_table", SERVING)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _experimental(row) -> bool:
    return row.module.startswith("trl.experimental.")


def _labels(rows, seen: set[str]) -> str:
    """The rows' class names (module-qualified where a name repeats), "(experimental)" once if all are."""
    names = []
    for row in rows:
        names.append(f"`{row.module}.{row.name}`" if row.name in seen else f"`{row.name}`")
        seen.add(row.name)
    if all(_experimental(row) for row in rows):
        return ", ".join(names) + " (experimental)"
    return ", ".join(name + (" (experimental)" if _experimental(row) else "") for name, row in zip(names, rows))


def serving_table(rows=None) -> str:
    """The TRL rows as a Markdown table; consecutive rows served and tested alike share a line."""
    rows = [row for row in (rows if rows is not None else _serving().ROWS) if row.module.split(".")[0] == "trl"]
    groups: list[list] = []
    for row in rows:
        if groups and (groups[-1][-1].how, groups[-1][-1].tested) == (row.how, row.tested):
            groups[-1].append(row)
        else:
            groups.append([row])
    seen: set[str] = set()
    lines = ["| Trainer | How it is served | Tested here |", "|---|---|---|"]
    lines += [f"| {_labels(group, seen)} | {group[0].how} | {group[0].tested} |" for group in groups]
    return "\n".join(lines)


def on_page_markdown(markdown, page, config, files):
    if MARKER in markdown:
        return markdown.replace(MARKER, serving_table())
    return markdown
