"""Writes a tiny Llama and its tokenizer to a folder, for the front-end tests: ``python frontend_model.py DIR``.

Run with the front end's own interpreter, so that the model is saved by the transformers the front end loads it
with. The tokenizer is the recipes' embedded one (byte-level BPE trained on ``recipes/data/chat.jsonl``, with a chat
template), built offline; the model, of the tests' tiny shape, has fresh weights from seed 0 and a vocabulary padded
past the tokenizer's, as real vocabularies are. Nothing is downloaded.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main(path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    sys.path[:0] = [str(REPO), str(REPO / "recipes")]
    from _loading import build_embedded_tokenizer

    from tests.models.tiny import COMMON_CONFIG  # the tests' tiny shape

    tokenizer = build_embedded_tokenizer()
    config = LlamaConfig(
        **{**COMMON_CONFIG, "vocab_size": len(tokenizer) + 8, "max_position_embeddings": 256},
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
