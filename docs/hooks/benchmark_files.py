"""MkDocs hook: the images of the benchmark records, beside the page that includes those records; and the tables
generated from the raw records (``checks_table.py``: the multi-GPU checks' table on the Distributed page).

docs/results.md includes benchmarks/RESULTS.md, whose images are linked relative to benchmarks/
(``results/<name>.png``). This adds each image of benchmarks/results/ to the site at that same relative
path, so the links resolve on the site as they do on GitHub.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mkdocs.structure.files import File

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def on_files(files, config):
    for image in sorted((BENCHMARKS / "results").glob("*.png")):
        files.append(File(f"results/{image.name}", str(BENCHMARKS), config["site_dir"], config["use_directory_urls"]))
    return files


def _checks_table():
    spec = importlib.util.spec_from_file_location(
        "_lce_patch_checks_table", Path(__file__).with_name("checks_table.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_page_markdown(markdown, page, config, files):
    return _checks_table().on_page_markdown(markdown, page, config, files)
