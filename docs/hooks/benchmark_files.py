"""MkDocs hook: the images of the benchmark records, beside the page that includes those records.

docs/results.md includes benchmarks/RESULTS.md, whose images are linked relative to benchmarks/
(``results/<name>.png``). This adds each image of benchmarks/results/ to the site at that same relative
path, so the links resolve on the site as they do on GitHub.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def on_files(files, config):
    for image in sorted((BENCHMARKS / "results").glob("*.png")):
        files.append(File(f"results/{image.name}", str(BENCHMARKS), config["site_dir"], config["use_directory_urls"]))
    return files
