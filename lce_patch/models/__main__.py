"""``python -m lce_patch.models``: print the architecture list that docs/models.md embeds."""

from .registry import architectures_markdown

print(architectures_markdown(), end="")
