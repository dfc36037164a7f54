"""Per-token outputs stay in their mathematical range, with the precision the inputs allow, on
confident tokens too: entropy >= 0, log-probabilities <= 0, log(sum p**2) <= 0.

The entropy of a token whose distribution is nearly one-hot is tiny (1e-12 .. 0.05 here) while its
logits are large (|z| up to ~500 at temperature 0.1): written as ``lse - sum p z`` it cancels two
numbers of size |z| and came out negative or wrong by 10x. The op sums non-negative terms instead, so
its relative error is the one the fp32 logits themselves carry: a relative perturbation ``eps`` of
each logit moves the entropy by at most ~``2 eps max|z|`` relative (every term depends on
``z_j - max z``), so the bound checked is ``8 eps max|z|`` (measured: at most 2.7 eps max|z|).
"""

from __future__ import annotations

import pytest
import torch

from lce_patch import fused_linear_log_probs
from lce_patch.ops.linear_cross_entropy import naive_logits, naive_token_outputs

from .devices import BACKENDS, TRITON_DEVICE, device_of

# The Triton backend runs on the GPU under LCE_TEST_GPU=1, else in the CPU interpreter (devices.py).
TRITON_RUNS = "triton" in BACKENDS


def _confident_problem(vocab: int, rows: int = 24, dim: int = 16, seed: int = 0):
    """Rows from flat to near one-hot (hidden norms over 1.5 decades); every other target is the argmax,
    where the log-probability is the closest to 0."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, dim, generator=generator) * torch.logspace(-0.5, 1.0, rows).unsqueeze(1)
    weight = torch.randn(vocab, dim, generator=generator)
    labels = torch.randint(0, vocab, (rows,), generator=generator)
    labels[::2] = (hidden @ weight.t()).argmax(-1)[::2]
    return hidden, weight, labels


def _reference_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Float64 entropy to float64's relative precision: ``-sum p log p`` with the argmax's ``log p`` taken as
    ``-log1p(sum of the others' exp(z - max))`` (``log_softmax`` would give it as ``z - lse``, a difference
    of two numbers of size |z|, wrong by 1e-8 relative for an entropy of 1e-8)."""
    gaps = logits - logits.max(-1, keepdim=True).values
    is_max = torch.zeros_like(gaps, dtype=torch.bool).scatter_(-1, gaps.argmax(-1, keepdim=True), True)
    rest = torch.where(is_max, 0.0, gaps.exp()).sum(-1, keepdim=True)
    log_p = gaps - torch.log1p(rest)
    return -(log_p.exp() * log_p).sum(-1)


CASES = [(1.0, None), (0.1, None), (0.1, 30.0), (1.0, 30.0)]
_SETUPS = [("torch", torch.float32, 300), ("torch", torch.float64, 300)]
_SETUPS += [("triton", torch.float32, 300)] * TRITON_RUNS
PARAMS = [(*setup, *case) for setup in _SETUPS for case in CASES]
# Several vocabulary blocks and a masked tail; the interpreter takes ~18 s per case there, so on the CPU
# only the most confident case runs (temperature 0.1, no softcap)
PARAMS += [
    ("triton", torch.float32, 4173, *case)
    for case in CASES
    if TRITON_RUNS and (TRITON_DEVICE.type == "cuda" or case == (0.1, None))
]


@pytest.mark.parametrize(
    "backend, dtype, vocab, temperature, softcap",
    PARAMS,
    ids=[f"{b}-{str(d).split('.')[-1]}-V{v}-t{t}-softcap{s}" for b, d, v, t, s in PARAMS],
)
def test_entropy_log_probs_and_log_sum_sq_in_range(backend, dtype, vocab, temperature, softcap):
    hidden, weight, labels = _confident_problem(vocab)
    device = device_of(backend)
    out = fused_linear_log_probs(
        hidden.to(device, dtype),
        weight.to(device, dtype),
        labels.to(device),
        temperature=temperature,
        softcap=softcap,
        backend=backend,
        return_entropy=True,
        return_log_sum_sq_probs=True,
    )
    out = type(out)(*(t.cpu() if t is not None else None for t in out))
    assert (out.entropy >= 0).all(), out.entropy.min()
    assert (out.log_probs <= 0).all(), out.log_probs.max()
    assert (out.log_sum_sq_probs <= 0).all(), out.log_sum_sq_probs.max()

    wide = hidden.to(dtype).double(), weight.to(dtype).double()
    log_probs, _, _ = naive_token_outputs(*wide, labels, softcap=softcap, temperature=temperature)
    logits = naive_logits(*wide, softcap=softcap, temperature=temperature)
    entropy = _reference_entropy(logits)
    largest_logit = logits.abs().max().item()
    bound = 8 * torch.finfo(dtype).eps * largest_logit
    measured = entropy > 1e-12  # below, fp32's exponentials underflow (the op's value is then ~0, as it should be)
    if temperature < 1.0 or softcap is None:  # a softcap of 30 at temperature 1 saturates many logits: flatter rows
        assert (entropy[measured] < 0.05).sum() >= 3, "the problem must hold confident tokens"
    relative = ((out.entropy.double() - entropy).abs() / entropy)[measured]
    assert relative.max() <= bound, f"entropy relative error {relative.max():.3g} > {bound:.3g}"
    assert (out.entropy[~measured] <= 1e-10).all()
    log_prob_error = (out.log_probs.double() - log_probs).abs() / (1.0 + log_probs.abs())
    assert log_prob_error.max() <= bound
