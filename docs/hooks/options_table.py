"""MkDocs hook: the table of a patched model's options and the axolotl plugin's keys, generated from the options
registry (``LCEOptions`` in ``lce_patch/models/options.py``: each field's default and ``_option(...)`` entry), so
the pages can neither miss an option nor disagree with the code.

The pages mark the spots with ``<!-- options-table -->`` and ``<!-- axolotl-keys -->``. The registry is read from
the source (its entries are literals), so the docs build needs no torch.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

OPTIONS_FILE = Path(__file__).resolve().parents[2] / "lce_patch" / "models" / "options.py"
OPTIONS_MARKER = "<!-- options-table -->"
AXOLOTL_MARKER = "<!-- axolotl-keys -->"
# The plugin's own key, beside those of the options (lce_patch/integrations/axolotl/plugin.py)
PLUGIN_KEY = ("`lce_patch`", "on when the plugin is listed", "`false` keeps the plugin loaded but off")
_YAML = {"None": "unset", "True": "`true`", "False": "`false`"}  # a default as the YAML key writes it


class Entry(NamedTuple):
    name: str
    default: str  # as Python writes it
    doc: str
    flags: frozenset[str]


def read_registry(path: Path = OPTIONS_FILE) -> list[Entry]:
    """The registry's entries in declaration order: each ``name: type = _option(default, doc, flag=True, ...)``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "LCEOptions")
    entries = []
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Call):
            call = node.value
            if getattr(call.func, "id", None) != "_option":
                continue
            default, doc = call.args
            flags = frozenset(
                k.arg for k in call.keywords if isinstance(k.value, ast.Constant) and k.value.value is True
            )
            entries.append(Entry(node.target.id, ast.unparse(default), ast.literal_eval(doc), flags))
    return entries


def _reach(entry: Entry) -> str:
    """Where the option reaches beyond the patched model's loss: TRL's trainers built on the ops."""
    if "changes_loss" in entry.flags:
        return "changes the loss: left at its default there"
    if "adds_output" in entry.flags:
        return "adds an output: left unset there"
    ops = [
        what
        for flag, what in (("log_probs", "log-probabilities"), ("divergence", "divergences"))
        if flag in entry.flags
    ]
    return " and ".join(ops) if ops else ""


def options_table(entries: list[Entry]) -> str:
    lines = [
        "| option | default | what it does | under TRL's trainers served by the ops | axolotl key |",
        "|---|---|---|---|---|",
    ]
    for entry in entries:
        key = f"`lce_patch_{entry.name}`" if "axolotl" in entry.flags else ""
        lines.append(f"| `{entry.name}` | `{entry.default}` | {entry.doc} | {_reach(entry)} | {key} |")
    return "\n".join(lines)


def axolotl_keys(entries: list[Entry]) -> str:
    lines = ["| key | default | what it does |", "|---|---|---|", "| {} | {} | {} |".format(*PLUGIN_KEY)]
    for entry in entries:
        if "axolotl" in entry.flags:
            default = _YAML.get(entry.default, f"`{entry.default.strip(chr(39))}`")
            lines.append(f"| `lce_patch_{entry.name}` | {default} | {entry.doc} |")
    return "\n".join(lines)


def on_page_markdown(markdown, page, config, files):
    if OPTIONS_MARKER in markdown or AXOLOTL_MARKER in markdown:
        entries = read_registry()
        markdown = markdown.replace(OPTIONS_MARKER, options_table(entries))
        markdown = markdown.replace(AXOLOTL_MARKER, axolotl_keys(entries))
    return markdown
