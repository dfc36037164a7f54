"""Patched models under transformers' tensor parallelism (``tp_plan="auto"``) on 2 CPU processes (gloo).

The LM head is then a vocab-sharded DTensor (``colwise_gather_output``); the patched forward runs the
vocabulary-parallel loss on it. Loss and every parameter's gradient (DTensor shards gathered) must equal
one unpatched process on the whole model and batch; the unpatched TP model must too (a check of the
setup), and ``revert_fused_lce`` must give the unpatched TP model back.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

import lce_patch
from lce_patch.ops.linear_cross_entropy import vocab_parallel
from tests.models.tiny import tiny_model
from tests.multiprocess import run_ranks
from tests.ops.helpers import rel_err

pytestmark = pytest.mark.slow  # launched process groups

# Odd vocabulary: uneven shards (64 + 63 rows). Both tie the head to the embedding.
ARCHS = {
    "llama": dict(vocab_size=127, tie_word_embeddings=True),
    "gemma2": dict(vocab_size=127),  # final_logit_softcapping=2.0 (tiny.py)
    "qwen2": dict(vocab_size=127, tie_word_embeddings=False),
}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _loss_and_grads(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    grads = {name: _full(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    return out, grads


def _tp_worker(rank, world_size, path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tp_plan= is deprecated in recent transformers, current in older
        model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    reference.train()
    assert isinstance(model.lm_head.weight, torch.distributed.tensor.DTensor)

    gen = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, 127, (2, 13), generator=gen)
    labels = input_ids.clone()
    labels[0, :4] = -100
    batch = dict(input_ids=input_ids, labels=labels, num_items_in_batch=torch.tensor(19))

    ref_out, ref_grads = _loss_and_grads(reference, batch)
    tp_out, tp_grads = _loss_and_grads(model, batch)  # unpatched tensor parallelism: the setup agrees
    assert rel_err(tp_out.loss, ref_out.loss) <= 1e-5

    lce_patch.apply_fused_lce(model)
    calls = []
    original_run = vocab_parallel.ShardRowPass.run

    def counted(self, raw, *args):
        calls.append(raw.shape)
        return original_run(self, raw, *args)

    vocab_parallel.ShardRowPass.run = counted
    try:
        out, grads = _loss_and_grads(model, batch)
    finally:
        vocab_parallel.ShardRowPass.run = original_run
    local_vocab = model.lm_head.weight.to_local().shape[0]
    assert calls and all(shape[1] == local_vocab < 127 for shape in calls), calls  # a shard, never all of V
    assert out.logits is None
    assert rel_err(out.loss, ref_out.loss) <= 1e-5, (float(out.loss), float(ref_out.loss))
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert rel_err(grad, ref_grads[name]) <= 1e-5, f"rank {rank}: {name} {rel_err(grad, ref_grads[name])}"

    # Evaluation that keeps the logits: the whole [B, T, V] logits on every rank, and the fused loss.
    model.eval()
    lce_patch.apply_fused_lce(model, return_logits_in_eval=True)
    with torch.no_grad():
        out = model(**batch)
        expected = reference(**batch)
    assert rel_err(out.logits, expected.logits) <= 1e-5 and rel_err(out.loss, expected.loss) <= 1e-5

    lce_patch.revert_fused_lce(model)
    model.train()
    out, grads = _loss_and_grads(model, batch)
    assert rel_err(out.loss, ref_out.loss) <= 1e-5 and out.logits.shape == (2, 13, 127)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_patched_model_under_tensor_parallelism(arch, tmp_path):
    tiny_model(arch, **ARCHS[arch]).save_pretrained(tmp_path)
    run_ranks(_tp_worker, 2, str(tmp_path))
