"""The patched loss when each rank holds a slice of the sequence (context parallelism, Ulysses), simulated in one
process: the loss and every gradient equal one process on the whole sequence.

What the ranks see is built as transformers 5.24's Trainer and DeepSpeed's Ulysses data loader build it:

- **context parallelism** (``ParallelismConfig(cp_size=R)``, FSDP2): ``_prepare_context_parallel_inputs`` makes
  ``shift_labels`` from the whole ``labels`` (pad with -100, drop the first), then torch's ``context_parallel``
  shards ``input_ids``, ``labels`` and ``shift_labels`` along the sequence in its load-balanced order (2R chunks;
  rank r holds chunks r and 2R-1-r). ``num_items_in_batch`` is the count of valid ``shift_labels`` over the
  accumulated micro-batches, gathered over the R ranks (which hold the same batch) and divided by ``cp_size``; the
  model is called with it, and ``compute_loss`` multiplies the loss by the number of processes. FSDP averages the
  gradients over the ranks; the logged loss is the mean over the ranks.
- **Ulysses** (``sp_size=R, sp_backend="deepspeed"``): the data loader makes ``shift_labels`` the same way and keeps
  rank r's contiguous chunk; ``deepspeed_sp_compute_loss`` calls the model with ``labels=shift_labels`` (no
  ``num_items_in_batch``: the Trainer sets ``model_accepts_loss_kwargs=False``), gathers each rank's mean loss and
  weighs it by the rank's valid labels (a rank with none is masked out). Its all-gather is differentiable (the
  backward sums every rank's gradient into each rank's loss) and DeepSpeed averages the gradients over the R ranks,
  so the step's gradient is the gradient of the combined loss, which one backward through every rank's loss gives.

The rank's hidden states are the whole sequence's (torch's ring attention, Ulysses' all-to-all): the decoder runs on
the whole sequence in every simulated rank and hands the head that rank's positions, so each rank's backward reaches
the decoder as the real ones do. Gradients of the simulated ranks add up in one model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.modeling_outputs import BaseModelOutputWithPast

import lce_patch
from tests.models.tiny import VOCAB, assert_close, tiny_model

IGNORE = -100
SEQ = 16


def _positions(seq_len: int, ranks: int, mode: str) -> list[torch.Tensor]:
    """The sequence positions each rank holds."""
    if mode == "ulysses":
        return list(torch.arange(seq_len).chunk(ranks))
    chunks = torch.arange(seq_len).chunk(2 * ranks)  # torch's load-balanced order for causal attention
    return [torch.cat([chunks[r], chunks[2 * ranks - 1 - r]]) for r in range(ranks)]


def _shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """As the Trainer and DeepSpeed's data loader build them: label t + 1 at position t, -100 at the end."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[:, 1:].contiguous()


def _micro_batches(empty_rank_positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two micro-batches of 2 x SEQ with different valid counts (so that per-micro-batch and global normalizations
    differ); in the second, every label a rank scores is ignored at ``empty_rank_positions``."""
    gen = torch.Generator().manual_seed(3)
    batches = []
    for step in range(2):
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
        labels = ids.clone()
        labels[0, : 3 + 4 * step] = IGNORE
        labels[1, 5:7] = IGNORE
        if step == 1:
            # shift_labels[t] = labels[t + 1]: ignore the labels the positions' targets come from
            targets = empty_rank_positions + 1
            labels[:, targets[targets < SEQ]] = IGNORE
        batches.append((ids, labels))
    return batches


class _WholeSequenceDecoder:
    """Stands in for the decoder's forward on one simulated rank: runs it on the whole sequence and returns the
    rank's positions (what ring attention or Ulysses hand the head)."""

    def __init__(self, decoder: torch.nn.Module, full_ids: torch.Tensor, positions: torch.Tensor) -> None:
        self.forward = decoder.forward
        self.full_ids = full_ids
        self.positions = positions

    def __call__(self, input_ids=None, **kwargs):
        assert input_ids.shape[1] == len(self.positions)  # the rank's slice of the input reached the decoder
        hidden = self.forward(input_ids=self.full_ids, use_cache=False).last_hidden_state
        return BaseModelOutputWithPast(last_hidden_state=hidden[:, self.positions])


def _rank_loss(model, ids, labels, positions, **call) -> torch.Tensor:
    decoder = model.get_decoder()
    decoder.forward = _WholeSequenceDecoder(decoder, ids, positions)
    try:
        return model(input_ids=ids[:, positions], labels=labels, use_cache=False, **call).loss
    finally:
        del decoder.forward


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def _reference(model, batches, per_micro_batch_mean: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, whole sequences: the Trainer's loss over the accumulated micro-batches (normalized by the
    valid shifted labels of all of them, or, as the Trainer does under Ulysses, each micro-batch's mean / steps)."""
    model.zero_grad(set_to_none=True)
    total = sum(int((_shift_labels(labels) != IGNORE).sum()) for _, labels in batches)
    logged = 0.0
    for ids, labels in batches:
        if per_micro_batch_mean:
            loss = model(input_ids=ids, labels=labels, use_cache=False).loss / len(batches)
        else:
            loss = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(total), use_cache=False).loss
        loss.backward()
        logged += float(loss.detach())
    return logged, _grads(model)


def _context_parallel(model, batches, ranks: int) -> tuple[float, dict[str, torch.Tensor], list[float]]:
    model.zero_grad(set_to_none=True)
    positions = _positions(SEQ, ranks, "cp")
    # gathered over the ranks (each counts the whole batch it holds), divided by cp_size
    counts = [sum((_shift_labels(labels) != IGNORE).sum() for _, labels in batches) for _ in range(ranks)]
    num_items = torch.stack(counts).sum() / ranks
    logged, rank_losses = 0.0, []
    for ids, labels in batches:
        shift = _shift_labels(labels)
        for pos in positions:
            loss = _rank_loss(model, ids, labels[:, pos], pos, shift_labels=shift[:, pos], num_items_in_batch=num_items)
            assert torch.isfinite(loss)
            rank_losses.append(float(loss.detach()))
            loss = loss * ranks  # compute_loss: times num_processes // tp_size
            loss.backward()
            logged += float(loss.detach()) / ranks  # the logged loss: the mean over the ranks
    for p in model.parameters():  # FSDP's reduce-scatter averages over the ranks
        if p.grad is not None:
            p.grad /= ranks
    return logged, _grads(model), rank_losses


def _ulysses(model, batches, ranks: int) -> tuple[float, dict[str, torch.Tensor], list[float]]:
    model.zero_grad(set_to_none=True)
    positions = _positions(SEQ, ranks, "ulysses")
    logged, rank_losses = 0.0, []
    for ids, labels in batches:
        shift = _shift_labels(labels)
        losses, good = [], []
        for pos in positions:
            # deepspeed_sp_compute_loss: labels = shift_labels (the loader dropped the labels)
            losses.append(_rank_loss(model, ids, shift[:, pos], pos, shift_labels=shift[:, pos]))
            good.append((shift[:, pos] != IGNORE).view(-1).sum())
            rank_losses.append(float(losses[-1].detach()))
        losses_stacked, good_stacked = torch.stack(losses), torch.stack(good)
        mask = good_stacked > 0
        safe = torch.where(mask, losses_stacked, torch.zeros_like(losses_stacked))
        loss = (safe * good_stacked).sum() / good_stacked.sum().clamp(min=1)
        loss = loss / len(batches)  # training_step: not scaled for accumulation by the model
        loss.backward()
        logged += float(loss.detach())
    return logged, _grads(model), rank_losses


def _assert_same(loss, grads, ref_loss, ref_grads, rel, what):
    assert abs(loss - ref_loss) <= rel * abs(ref_loss), f"{what}: loss {loss} vs {ref_loss}"
    assert grads.keys() == ref_grads.keys(), what
    for name, grad in grads.items():
        assert torch.isfinite(grad).all(), f"{what}: {name} has a non-finite gradient"
        assert_close(grad, ref_grads[name], rel=rel, what=f"{what} {name}", floor=1e-3 * ref_grads[name].abs().max())


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_context_parallel_slices_equal_whole_sequence(model_type, ranks):
    model = tiny_model(model_type, max_position_embeddings=SEQ)
    unpatched = copy.deepcopy(model)
    lce_patch.apply_fused_lce(model, backend="torch")
    model.train()
    unpatched.train()
    # rank 0 holds chunks 0 and 2R-1: in the second micro-batch, none of its labels is valid
    batches = _micro_batches(_positions(SEQ, ranks, "cp")[0])
    ref_loss, ref_grads = _reference(unpatched, batches, per_micro_batch_mean=False)
    fused_loss, fused_grads = _reference(model, batches, per_micro_batch_mean=False)
    _assert_same(fused_loss, fused_grads, ref_loss, ref_grads, 1e-5, "one process, patched")
    for net, what in ((model, "patched"), (unpatched, "unpatched")):
        loss, grads, rank_losses = _context_parallel(net, batches, ranks)
        assert rank_losses[ranks] == 0.0, f"{what}: the rank with no valid label gives a finite zero"
        _assert_same(loss, grads, ref_loss, ref_grads, 1e-5, f"context parallel {ranks} ranks, {what}")


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_ulysses_slices_equal_whole_sequence(model_type, ranks):
    model = tiny_model(model_type, max_position_embeddings=SEQ)
    unpatched = copy.deepcopy(model)
    lce_patch.apply_fused_lce(model, backend="torch")
    model.train()
    unpatched.train()
    batches = _micro_batches(_positions(SEQ, ranks, "ulysses")[0])  # rank 0's slice all ignored, second step
    ref_loss, ref_grads = _reference(unpatched, batches, per_micro_batch_mean=True)
    for net, what in ((model, "patched"), (unpatched, "unpatched")):
        loss, grads, rank_losses = _ulysses(net, batches, ranks)
        # the rank with no valid label: its mean over no token is NaN, as Hugging Face's loss gives it, and the
        # Trainer's combination masks it out; its gradients are zeros, not NaN
        assert rank_losses[ranks] != rank_losses[ranks], f"{what}: NaN expected"
        _assert_same(loss, grads, ref_loss, ref_grads, 1e-5, f"Ulysses {ranks} ranks, {what}")


def test_pre_shifted_labels_are_not_shifted_again():
    # A slice's shift_labels are taken as they are: the patched loss on one slice equals the unpatched one, and
    # differs from shifting the slice's labels inside it (which would drop the label across the boundary).
    model = tiny_model("llama", max_position_embeddings=SEQ)
    unpatched = copy.deepcopy(model)
    lce_patch.apply_fused_lce(model, backend="torch")
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    shift = _shift_labels(ids)
    pos = torch.arange(SEQ // 2)
    fused = _rank_loss(model, ids, ids[:, pos], pos, shift_labels=shift[:, pos])
    plain = _rank_loss(unpatched, ids, ids[:, pos], pos, shift_labels=shift[:, pos])
    shifted_inside = _rank_loss(model, ids, ids[:, pos], pos)
    assert_close(fused, plain, what="loss")
    assert abs(float(fused) - float(shifted_inside)) > 1e-4
