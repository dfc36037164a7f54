"""The cross-entropy ops take their options as one :class:`CrossEntropyOptions` (``options=``) as well as
keywords: the same call either way, built by the one builder both functions share; one form or the other."""

from __future__ import annotations

import pytest
import torch

from lce_patch import fused_linear_cross_entropy, fused_linear_log_probs
from lce_patch.ops.linear_cross_entropy import (
    LOG_PROBS_KEYWORDS,
    LOSS_KEYWORDS,
    CrossEntropyOptions,
    ExtraOutputs,
    build_options,
)

from .devices import BACKENDS, on
from .helpers import leaf, make_inputs

LOSS_CASES = [
    dict(),
    dict(reduction="sum", label_smoothing=0.1, z_loss=1e-3, softcap=5.0, logit_scale=0.5),
    dict(reduction="none", shift=True, chunk_size=8),
    dict(skip_ignored=True, return_lse=True, return_token_accuracy=True, return_predicted_tokens=True),
    dict(num_valid_tokens=29, fp32_weight_grad=True),
]
LOG_PROBS_CASES = [
    dict(),
    dict(temperature=0.7, softcap=4.0, return_entropy=True, return_is_top1=True, chunk_size=8),
    dict(shift=True, return_mean_logits=True, return_log_sum_sq_probs=True, skip_ignored=True),
    dict(precompute_grad=True, num_valid_tokens=29),
]


def _leaves(backend: str):
    hidden, weight, labels, _ = make_inputs(seed=3)
    hidden, weight, labels = on(backend, hidden, weight, labels)
    return leaf(hidden, torch.float32, device=hidden.device), leaf(weight, torch.float32, device=hidden.device), labels


def _outputs(result) -> list[torch.Tensor]:
    return [t for t in (result if isinstance(result, tuple) else (result,)) if isinstance(t, torch.Tensor)]


def _run_both(function, backend: str, keywords: dict, build):
    """The function's outputs and gradients with ``keywords``, then with the options object built from them."""
    results = []
    for form in ({**keywords, "backend": backend}, {"options": build({**keywords, "backend": backend})}):
        hidden, weight, labels = _leaves(backend)
        out = function(hidden, weight, labels, **form)
        outs = _outputs(out)
        differentiable = [t for t in outs if t.requires_grad]
        if differentiable:
            sum(t.sum() for t in differentiable).backward()
        results.append([*outs, hidden.grad, weight.grad])
    return results


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("keywords", LOSS_CASES)
def test_loss_options_object_equals_keywords(backend, keywords):
    with_keywords, with_object = _run_both(fused_linear_cross_entropy, backend, keywords, build_options)
    assert len(with_keywords) == len(with_object)
    for a, b in zip(with_keywords, with_object, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("keywords", LOG_PROBS_CASES)
def test_log_probs_options_object_equals_keywords(backend, keywords):
    def build(given):
        return build_options(given, log_probs=True)

    with_keywords, with_object = _run_both(fused_linear_log_probs, backend, keywords, build)
    for a, b in zip(with_keywords, with_object, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)


def test_the_builder_gathers_the_return_flags_into_want():
    options = build_options({"return_lse": True, "return_predicted_tokens": True, "z_loss": 0.5})
    assert options.want == ExtraOutputs(lse=True, predicted=True) and options.z_loss == 0.5
    assert options.reduction == "mean"
    assert build_options({"return_entropy": True}, log_probs=True).reduction == "none"
    assert build_options(dict(LOSS_KEYWORDS)) == CrossEntropyOptions()
    assert build_options(dict(LOG_PROBS_KEYWORDS), log_probs=True) == CrossEntropyOptions(reduction="none")
    with pytest.raises(ValueError, match="return_lse"):
        build_options({"return_lse": 1})


@pytest.mark.parametrize(
    "function, given",
    [
        (fused_linear_cross_entropy, dict(reduction="sum")),
        (fused_linear_cross_entropy, dict(return_lse=True)),
        (fused_linear_cross_entropy, dict(logit_scale=1)),  # an int is not the float default: given
        (fused_linear_log_probs, dict(return_entropy=True)),
        (fused_linear_log_probs, dict(temperature=2.0)),
    ],
)
def test_options_and_keywords_together_are_refused(function, given):
    hidden, weight, labels = _leaves("torch")
    reduction = "none" if function is fused_linear_log_probs else "mean"
    with pytest.raises(
        TypeError, match=rf"options= was given together with the option keyword\(s\) \['{next(iter(given))}'\]"
    ):
        function(hidden, weight, labels, options=CrossEntropyOptions(reduction=reduction), **given)


def test_keywords_at_their_defaults_beside_options_are_no_conflict():
    hidden, weight, labels = _leaves("torch")
    options = CrossEntropyOptions(reduction="sum", backend="torch")
    expected = fused_linear_cross_entropy(hidden, weight, labels, reduction="sum", backend="torch")
    got = fused_linear_cross_entropy(hidden, weight, labels, options=options, ignore_index=-100, shift=False)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("function", [fused_linear_cross_entropy, fused_linear_log_probs])
@pytest.mark.parametrize("options", [{"reduction": "sum"}, ("mean",), "mean", ExtraOutputs()])
def test_an_options_object_of_another_type_is_refused(function, options):
    hidden, weight, labels = _leaves("torch")
    with pytest.raises(TypeError, match="options must be a CrossEntropyOptions, got"):
        function(hidden, weight, labels, options=options)


@pytest.mark.parametrize(
    "function, options, named",
    [
        (fused_linear_cross_entropy, CrossEntropyOptions(temperature=2.0), "temperature"),
        (fused_linear_cross_entropy, CrossEntropyOptions(precompute_grad=True), "precompute_grad"),
        (fused_linear_cross_entropy, CrossEntropyOptions(want=ExtraOutputs(entropy=True)), "want.entropy"),
        (fused_linear_cross_entropy, CrossEntropyOptions(use_triton=True), "use_triton"),
        (fused_linear_cross_entropy, CrossEntropyOptions(shift_rows=4), "shift_rows"),
        (fused_linear_log_probs, CrossEntropyOptions(), "reduction"),
        (fused_linear_log_probs, CrossEntropyOptions(reduction="none", z_loss=0.1), "z_loss"),
        (fused_linear_log_probs, CrossEntropyOptions(reduction="none", want=ExtraOutputs(lse=True)), "want.lse"),
    ],
)
def test_an_options_object_setting_what_the_function_does_not_take_is_refused(function, options, named):
    hidden, weight, labels = _leaves("torch")
    with pytest.raises(ValueError, match=rf"options sets \[[^]]*'{named}'"):
        function(hidden, weight, labels, options=options)


def test_an_options_object_still_meets_the_call_checks():
    hidden, weight, labels = _leaves("torch")
    with pytest.raises(ValueError, match="needs a scalar reduction"):
        fused_linear_cross_entropy(
            hidden, weight, labels, options=CrossEntropyOptions(reduction="none"), num_items_in_batch=3
        )
