"""Patched models under transformers' native distributed API, ``DistributedConfig``, on CPU processes (gloo).

``from_pretrained(..., distributed_config=DistributedConfig(tp_size=T, fsdp_size=F))`` lays the model out on one
device mesh: tensor parallelism (the LM head a vocab-sharded DTensor, on which the patched forward runs the
vocabulary-parallel loss), FSDP2 (``fully_shard``: the head weight gathered inside the head's call, where the
patched forward reads it), or both (the head a DTensor over the two dimensions, gathered along FSDP's inside
the call, vocab-sharded along TP's); also HSDP (``dp_replicate_size``: replicas of an FSDP2 group) and
transformers' sequence-parallel plan. Each data-parallel rank takes its own rows of the batch, with the whole
batch's ``num_items_in_batch`` and its loss times the data-parallel size (FSDP2 averages the gradients), as the
Trainer does. The loss (summed over the data-parallel ranks) and every gradient (gathered whole) must equal one
unpatched process on the whole model and batch; so must the unpatched distributed model (a check of the setup).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import transformers
from transformers import AutoModelForCausalLM

import lce_patch
import lce_patch.models.forward as lce_forward
from tests.models.tiny import tiny_model
from tests.multiprocess import run_ranks
from tests.ops.helpers import rel_err

DistributedConfig = getattr(transformers, "DistributedConfig", None)
pytestmark = [
    pytest.mark.slow,  # launched process groups
    pytest.mark.skipif(
        DistributedConfig is None
        or not {"tp_size", "fsdp_size"} <= {f.name for f in dataclasses.fields(DistributedConfig)},
        reason=f"transformers {transformers.__version__} has no DistributedConfig(tp_size=, fsdp_size=)",
    ),
]

VOCAB = 127  # odd: uneven vocabulary shards
ROWS = 4  # sequences in the whole batch


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _step(model, batch, scale: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    (loss * scale).backward()
    return loss.detach(), {name: _full(p.grad) for name, p in model.named_parameters() if p.grad is not None}


def _worker(rank: int, world_size: int, path: str, tp_size: int, fsdp_size: int, extra: dict) -> None:
    sizes = dict(tp_size=tp_size, fsdp_size=fsdp_size, **extra)
    # data-parallel ranks: FSDP's, times the replicas of HSDP (dp_replicate_size); each takes its own rows and
    # scales its loss by their count (the gradients are averaged over all of them)
    dp_size = fsdp_size * extra.get("dp_replicate_size", 1)
    model = AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(**sizes), dtype=torch.float32
    )
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    reference.train()
    assert isinstance(model.lm_head.weight, torch.distributed.tensor.DTensor)
    if "dp_replicate_size" in extra:  # HSDP: the head replicated over the replicas, sharded within each
        placements = model.lm_head.weight.placements
        assert len(placements) == 2 and placements[0].is_replicate() and placements[1].is_shard(), placements

    gen = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, VOCAB, (ROWS, 13), generator=gen)
    labels = input_ids.clone()
    labels[0, :4] = -100
    labels[3, 5:] = -100  # uneven counts over the FSDP ranks
    num_items = torch.tensor(int((labels[:, 1:] != -100).sum()))
    ref_loss, ref_grads = _step(reference, dict(input_ids=input_ids, labels=labels, num_items_in_batch=num_items))

    dp_index = rank // tp_size  # the mesh's (..., dp_replicate, fsdp, tp) order
    rows = slice(dp_index * ROWS // dp_size, (dp_index + 1) * ROWS // dp_size)
    batch = dict(input_ids=input_ids[rows], labels=labels[rows], num_items_in_batch=num_items)

    def whole_batch_loss(loss: torch.Tensor) -> torch.Tensor:
        total = loss.clone() if rank % tp_size == 0 else torch.zeros_like(loss)  # one rank per data-parallel index
        dist.all_reduce(total)
        return total

    loss, grads = _step(model, batch, scale=dp_size)  # unpatched: the setup agrees with one process
    assert rel_err(whole_batch_loss(loss), ref_loss) <= 1e-5
    for name, grad in grads.items():
        assert rel_err(grad, ref_grads[name]) <= 1e-5, f"unpatched, rank {rank}: {name}"

    lce_patch.apply_fused_lce(model)
    heads = []
    original = lce_forward.fused_linear_cross_entropy

    def recorded(hidden, weight, *args, **kwargs):
        heads.append(weight)
        return original(hidden, weight, *args, **kwargs)

    lce_forward.fused_linear_cross_entropy = recorded
    try:
        loss, grads = _step(model, batch, scale=dp_size)
    finally:
        lce_forward.fused_linear_cross_entropy = original
    (weight,) = heads
    if tp_size > 1:  # the vocabulary-parallel op, on this rank's rows of the whole head
        assert isinstance(weight, torch.distributed.tensor.DTensor) and weight.shape[0] == VOCAB
        assert weight.to_local().shape[0] < VOCAB
    else:  # FSDP2 gathered the whole head inside its call
        assert not isinstance(weight, torch.distributed.tensor.DTensor) and weight.shape[0] == VOCAB
    assert rel_err(whole_batch_loss(loss), ref_loss) <= 1e-5, (float(loss), float(ref_loss))
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert rel_err(grad, ref_grads[name]) <= 1e-5, f"rank {rank}: {name} {rel_err(grad, ref_grads[name])}"


@pytest.mark.parametrize(
    "arch,tp_size,fsdp_size,extra",
    [
        ("llama", 2, 1, {}),
        ("gemma2", 2, 1, {}),  # gemma2: final_logit_softcapping=2.0 (tiny.py), through the vocabulary-parallel op
        ("qwen2", 2, 1, {}),
        ("llama", 1, 2, {}),  # FSDP2 gathers the whole head, as DDP has it: the softcap path is the one-GPU op's
        ("llama", 2, 2, {}),
        ("gemma2", 2, 2, {}),
        ("llama", 1, 2, {"dp_replicate_size": 2}),  # HSDP: two replicas of a two-way FSDP2, the head whole inside
        # transformers' sequence-parallel plan (in 5.24 the head still gets replicated hidden states)
        ("llama", 2, 1, {"enable_sequence_parallel": True}),
    ],
    ids=[
        "tensor-parallel-llama",
        "tensor-parallel-gemma2",
        "tensor-parallel-qwen2",
        "fsdp2-llama",
        "tp-x-fsdp2-llama",
        "tp-x-fsdp2-gemma2",
        "hsdp-llama",
        "tensor-parallel-sequence-parallel-llama",
    ],
)
def test_patched_model_under_distributed_config(arch, tp_size, fsdp_size, extra, tmp_path):
    tiny_model(arch, vocab_size=VOCAB, tie_word_embeddings=True).save_pretrained(tmp_path)
    world = tp_size * fsdp_size * extra.get("dp_replicate_size", 1)
    run_ranks(_worker, world, str(tmp_path), tp_size, fsdp_size, extra)
