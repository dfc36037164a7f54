"""``python -m lce_patch.models``: print the supported-architectures list the README embeds."""

from .registry import architectures_markdown

print(architectures_markdown(), end="")
