"""The recipes are scripts, not a package: make ``import sft`` / ``import train`` / ``import _running`` work."""

import sys
from pathlib import Path

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
if str(RECIPES_DIR) not in sys.path:
    sys.path.insert(0, str(RECIPES_DIR))
