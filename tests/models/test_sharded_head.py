"""A head weight that is a plain local shard (tensor parallelism outside DTensor) is refused, never trained on.

DeepSpeed's AutoTP replaces ``lm_head`` with its own layers, whose weight is one rank's rows of the vocabulary
(``LinearLayer``, ``VocabParallelLinear``) or columns of the hidden size (``LmHeadLinearAllreduce``); a loss over
it would drop every label another rank holds. The patched forward refuses such a head, by class and by shape,
with an error naming the fix; a vocab-sharded DTensor (transformers' tensor parallelism) is what it reads
(tests/models/test_tensor_parallel.py, test_distributed_config.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lce_patch
from tests.models.tiny import tiny_model

REPO = Path(__file__).resolve().parents[2]
# DeepSpeed installed apart from the test environment (.ci/run puts it there): importing it changes what
# transformers and accelerate do elsewhere, so only a launched process sees it.
DEEPSPEED_SITE = Path(os.environ.get("LCE_TEST_DEEPSPEED_SITE", REPO / ".ci-deps" / "deepspeed"))


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    return dict(input_ids=ids, labels=ids)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
@pytest.mark.parametrize("rows", [64, 50])  # half of the vocabulary of 128 (two ranks), a third-ish (uneven)
def test_a_local_shard_of_the_head_is_refused(arch, rows):
    model = tiny_model(arch, vocab_size=128, tie_word_embeddings=False)
    lce_patch.apply_fused_lce(model)
    shard = torch.nn.Linear(model.config.hidden_size, rows, bias=False)
    with torch.no_grad():
        shard.weight.copy_(model.lm_head.weight[:rows])
    model.lm_head = shard  # as a tensor-parallel engine outside DTensor leaves it on one rank
    with pytest.raises(RuntimeError, match=rf"{rows} rows for a vocabulary of 128.*DistributedConfig\(tp_size=N\)"):
        model(**_batch(128))


def test_a_whole_head_slightly_smaller_than_the_config_vocabulary_still_trains():
    # Some models' heads have a few rows fewer than their config's vocabulary (padding rows of the embedding):
    # not a shard.
    model = tiny_model("llama", vocab_size=128, tie_word_embeddings=False)
    reference = tiny_model("llama", vocab_size=128, tie_word_embeddings=False)
    for m in (model, reference):
        head = torch.nn.Linear(m.config.hidden_size, 120, bias=False)
        with torch.no_grad():
            head.weight.copy_(m.lm_head.weight[:120])
        m.lm_head = head
    lce_patch.apply_fused_lce(model)
    batch = _batch(120)
    loss = model(**batch).loss
    logits = reference(input_ids=batch["input_ids"]).logits  # (Hugging Face's loss views the logits as [-1, 128])
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)


_DEEPSPEED_SCRIPT = """
import torch
import lce_patch
from deepspeed.module_inject.layers import LinearLayer, LmHeadLinearAllreduce, VocabParallelLinear
from lce_patch.models.head import head_call
from tests.models.tiny import tiny_model

ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
for layer, kwargs in ((LinearLayer, dict(gather_output=True)), (LmHeadLinearAllreduce, {}), (VocabParallelLinear, {})):
    model = tiny_model("llama", vocab_size=128, tie_word_embeddings=False)
    lce_patch.apply_fused_lce(model)
    model.lm_head = layer(model.lm_head, None, **kwargs)  # AutoTP's replacement (no group here: one process)
    for call in (
        lambda: model(input_ids=ids, labels=ids),  # the patched forward
        lambda: head_call(model.lm_head, lambda w, b, h: h, torch.zeros(2, 9, 32)),  # the trainers' head calls
    ):
        try:
            call()
        except NotImplementedError as err:
            assert f"DeepSpeed AutoTP's deepspeed.module_inject.layers.{layer.__name__}" in str(err), err
            assert "DistributedConfig(tp_size=N)" in str(err) and "keep lm_head out of AutoTP" in str(err), err
        else:
            raise AssertionError(f"{layer.__name__}: not refused")
print("refused", flush=True)
"""


@pytest.mark.skipif(
    not (DEEPSPEED_SITE / "deepspeed").is_dir(),
    reason=f"DeepSpeed not installed in {DEEPSPEED_SITE} (.ci/run installs it there)",
)
def test_deepspeed_autotp_heads_are_refused_by_name():
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{DEEPSPEED_SITE}", "DS_ACCELERATOR": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", _DEEPSPEED_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "refused" in result.stdout, (result.stdout + result.stderr)[-4000:]
