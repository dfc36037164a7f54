"""The loss options through a patched model: the model's ``class_weights``, a call's ``token_weights`` (shifted
with the labels), and the ``lse`` / ``token_accuracy`` outputs, against float64 references built from the
unpatched model's logits and torch's own cross-entropy (``F.cross_entropy(weight=...)``); on both backends, in
training, in evaluation (logits returned), on the unfused path (a hook on the head), and their bad inputs.

The torch backend runs the patched model in float64 (loss rounded to float32 as Hugging Face returns it;
gradients float64); the Triton backend (the CPU interpreter) in float32, compared at 2e-5.
"""

from __future__ import annotations

import copy
import pickle
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from transformers.modeling_outputs import CausalLMOutputWithPast

import lce_patch
from lce_patch import FusedLCECallback
from lce_patch.models import is_patched
from lce_patch.models.options import LCEOptions
from lce_patch.ops.core.backend import triton_usable

from .tiny import VOCAB, assert_close, assert_grads_match, tiny_model

BACKENDS = ["torch"] + (["triton"] if triton_usable(torch.device("cpu")) else [])
LSE_AND_ACCURACY = dict(return_lse=True, return_token_accuracy=True, return_predicted_tokens=True)


def _batch(seed: int = 1) -> dict:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (2, 12), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -3:] = 0  # right padding
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[0, :4] = -100  # a prompt
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def _weights(seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """(class weights [V], token weights [2, 12]); a few zeros among both."""
    generator = torch.Generator().manual_seed(seed)
    class_weights = torch.rand(VOCAB, generator=generator, dtype=torch.float64) * 2
    class_weights[::9] = 0.0
    token_weights = torch.rand(2, 12, generator=generator, dtype=torch.float64) * 3
    token_weights[0, 7] = 0.0
    return class_weights, token_weights


def _shifted(labels: torch.Tensor, fill) -> torch.Tensor:
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], fill)], 1)


def reference_loss(
    logits, labels, *, class_weights=None, token_weights=None, num_items=None, shift_labels=None, label_smoothing=0.0
):
    """The loss in float64 from the full logits and torch's cross-entropy (``weight=``, ``label_smoothing=``):
    label t (and its weight) scored at position t - 1, or ``shift_labels`` (and the weights) as given."""
    if shift_labels is None:
        targets = _shifted(labels, -100)
        weights = None if token_weights is None else _shifted(token_weights, 0.0)
    else:
        targets, weights = shift_labels, token_weights
    flat = targets.reshape(-1)
    class_weights = None if class_weights is None else class_weights.double()
    per_token = F.cross_entropy(
        logits.double().reshape(-1, VOCAB),
        flat,
        weight=class_weights,
        reduction="none",
        label_smoothing=label_smoothing,
    )
    if weights is not None:
        per_token = per_token * weights.double().reshape(-1)
    if num_items is not None:
        return per_token.sum() / num_items
    valid = flat != -100
    return per_token.sum() / (valid.sum() if class_weights is None else class_weights[flat[valid]].sum())


def _models(backend: str, **options):
    """(patched model, float64 unpatched copy): the patched one float64 on the torch backend, float32 on Triton."""
    model = tiny_model("llama")
    reference = copy.deepcopy(model).double()
    if backend == "torch":
        model.double()
    lce_patch.apply_fused_lce(model, backend=backend, chunk_size=8, **options)
    return model, reference


def _tolerance(backend: str) -> float:
    return 1e-9 if backend == "torch" else 2e-5


CASES = {
    "class_weights": dict(class_weights=True),
    "class_weights-num_items": dict(class_weights=True, num_items=torch.tensor(29)),
    "token_weights": dict(token_weights=True),
    "token_weights-num_items": dict(token_weights=True, num_items=17),
    "both": dict(class_weights=True, token_weights=True),
    "both-shift_labels": dict(class_weights=True, token_weights=True, shift_labels=True),
    "class_weights-smoothing": dict(class_weights=True, label_smoothing=0.1),
    "both-smoothing-num_items": dict(class_weights=True, token_weights=True, label_smoothing=0.2, num_items=31),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_training_loss_and_gradients_match_torch(backend, case):
    case = CASES[case]
    class_weights, token_weights = _weights()
    class_weights = class_weights if case.get("class_weights") else None
    token_weights = token_weights if case.get("token_weights") else None
    batch = _batch()
    if case.get("shift_labels"):  # as context parallelism passes them: used (with the weights) as given
        batch["shift_labels"] = _shifted(batch["labels"], -100)
        batch["shift_labels"][0, 6] = -100
    num_items = case.get("num_items")
    label_smoothing = case.get("label_smoothing", 0.0)
    model, reference = _models(backend, class_weights=class_weights, label_smoothing=label_smoothing)
    model.train()
    reference.train()
    call = dict(batch, num_items_in_batch=num_items) if num_items is not None else batch
    out = model(**call, token_weights=None if token_weights is None else token_weights.to(model.dtype))
    assert out.logits is None
    logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = reference_loss(
        logits, batch["labels"], class_weights=class_weights, token_weights=token_weights, num_items=num_items,
        shift_labels=batch.get("shift_labels"), label_smoothing=label_smoothing,
    )  # fmt: skip
    assert out.loss.dtype == torch.float32
    assert_close(out.loss, expected, rel=max(_tolerance(backend), 1e-6), what="loss")
    out.loss.backward()
    expected.backward()
    assert_grads_match(model, reference, rel=_tolerance(backend))


def test_reference_is_torch_cross_entropy_with_weight():
    """The reference's class-weighted mean is F.cross_entropy(weight=...)'s own "mean", with label smoothing too."""
    logits = torch.randn(2, 12, VOCAB, dtype=torch.float64)
    labels = _batch()["labels"]
    class_weights, _ = _weights()
    for smoothing in (0.0, 0.1):
        expected = F.cross_entropy(
            logits.reshape(-1, VOCAB),
            _shifted(labels, -100).reshape(-1),
            weight=class_weights,
            label_smoothing=smoothing,
        )
        actual = reference_loss(logits, labels, class_weights=class_weights, label_smoothing=smoothing)
        torch.testing.assert_close(actual, expected)


def test_token_weight_goes_with_its_label():
    """token_weights[b, t] weighs labels[b, t] (scored at position t - 1), as the labels are shifted."""
    model, reference = _models("torch")
    batch = _batch()
    token_weights = torch.zeros(2, 12, dtype=torch.float64)
    token_weights[1, 5] = 1.0
    seen = []
    model.model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(set(kwargs)), with_kwargs=True)
    loss = model(**batch, token_weights=token_weights, num_items_in_batch=1).loss
    assert seen and "token_weights" not in seen[0]  # the decoder never sees it
    logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = F.cross_entropy(logits[1, 4], batch["labels"][1, 5])
    assert_close(loss, expected, rel=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_evaluation_with_logits_uses_the_weights(backend):
    """Evaluation returns the logits beside the fused loss; that loss has the training loss's definition, and
    so does the loss of an evaluation that returns no logits."""
    class_weights, token_weights = _weights(3)
    token_weights = token_weights.to(torch.float64 if backend == "torch" else torch.float32)
    model, reference = _models(backend, class_weights=class_weights)
    model.eval()
    batch = _batch(4)
    with torch.no_grad():
        out = model(**batch, token_weights=token_weights)
        logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        expected = reference_loss(logits, batch["labels"], class_weights=class_weights, token_weights=token_weights)
        assert_close(out.logits, logits, rel=1e-5, what="eval logits")
        assert_close(out.loss, expected, rel=max(_tolerance(backend), 1e-6), what="eval loss")
        with lce_patch.models.loss_only():
            loss_only = model(**batch, token_weights=token_weights)
        assert loss_only.logits is None
        assert_close(loss_only.loss, expected, rel=max(_tolerance(backend), 1e-6), what="loss-only eval loss")


def test_unfused_call_computes_the_same_loss_from_the_logits():
    """A hook on the LM head makes the call run the model's own forward: its loss_function then computes the
    fused loss's definition from the logits (class and token weights, z_loss, num_items_in_batch, the shift)."""
    class_weights, token_weights = _weights(5)
    model, reference = _models("torch", class_weights=class_weights, z_loss=1e-2, **LSE_AND_ACCURACY)
    fused_model = copy.deepcopy(model)
    model.train()
    fused_model.train()
    batch = dict(_batch(6), num_items_in_batch=torch.tensor(23))
    handle = model.lm_head.register_forward_hook(lambda module, args, output: None)
    with pytest.warns(UserWarning, match="hook"):
        unfused = model(**batch, token_weights=token_weights)
    fused = fused_model(**batch, token_weights=token_weights)
    assert unfused.logits is not None and fused.logits is None
    assert_close(unfused.loss, fused.loss, rel=1e-6, what="loss")
    assert_close(unfused.lse, fused.lse, rel=1e-6, what="lse")  # both fp32
    assert float(unfused.token_accuracy) == float(fused.token_accuracy)
    assert torch.equal(unfused.predicted_tokens, fused.predicted_tokens)
    unfused.loss.backward()
    fused.loss.backward()
    assert_grads_match(model, fused_model, rel=1e-9)
    handle.remove()
    # logits_to_keep (here every position) is fused too: the kept positions' loss, the weights applied
    kept = model(**batch, token_weights=token_weights, logits_to_keep=12)
    assert kept.logits is None
    assert_close(kept.loss, fused.loss, rel=1e-6, what="logits_to_keep loss")

    # label smoothing with the class weights: as the op defines it
    for m in (model, fused_model):
        lce_patch.apply_fused_lce(m, backend="torch", class_weights=class_weights, label_smoothing=0.1, z_loss=1e-3)
    handle = model.lm_head.register_forward_hook(lambda module, args, output: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unfused = model(**_batch(7), token_weights=token_weights)
    assert_close(unfused.loss, fused_model(**_batch(7), token_weights=token_weights).loss, rel=1e-6)
    handle.remove()


def test_custom_loss_function_with_weights_is_refused():
    def my_loss(logits, labels, **kwargs):
        return logits.float().mean()

    class_weights, token_weights = _weights()
    model, _ = _models("torch", class_weights=class_weights)
    model.loss_function = my_loss
    model.train()
    with pytest.raises(ValueError, match="custom loss_function.*cannot apply class_weights or token_weights"):
        model(**_batch())
    # the extra outputs alone: the custom loss, and lse / token_accuracy from its logits
    lce_patch.apply_fused_lce(model, backend="torch", **LSE_AND_ACCURACY)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model(**_batch())
    assert out.loss.item() == pytest.approx(out.logits.float().mean().item())
    assert out.lse.shape == (2, 12) and out.token_accuracy.dim() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_and_token_accuracy_on_the_output(backend):
    model, reference = _models(backend, **LSE_AND_ACCURACY)
    batch = _batch(8)
    with torch.no_grad():
        logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"]
    # about half of the valid labels are the argmax of the position before them
    argmax_next = torch.cat([labels[:, :1], logits.argmax(-1)[:, :-1]], 1)
    pick = (torch.arange(24).view(2, 12) % 2 == 0) & (labels != -100)
    batch["labels"] = labels = torch.where(pick, argmax_next, labels)
    targets = _shifted(labels, -100)
    valid = targets != -100
    expected_lse = torch.where(valid, torch.logsumexp(logits, -1), 0.0)
    expected_accuracy = ((logits.argmax(-1) == targets) & valid).sum() / valid.sum()
    expected_predicted = torch.where(valid, logits.argmax(-1), -100)
    assert 0.3 < float(expected_accuracy) < 1.0

    model.train()
    out = model(**batch)
    assert isinstance(out, CausalLMOutputWithPast) and out.logits is None
    assert out.lse is out["lse"] and out.token_accuracy is out["token_accuracy"]
    assert out.lse.shape == labels.shape and out.token_accuracy.shape == ()
    assert not out.lse.requires_grad and not out.token_accuracy.requires_grad
    assert_close(out.lse, expected_lse, rel=_tolerance(backend), what="lse")
    assert float(out.token_accuracy) == pytest.approx(float(expected_accuracy), abs=1e-7)
    assert out.predicted_tokens.dtype == torch.int64 and torch.equal(out.predicted_tokens, expected_predicted)
    assert_close(out.loss, reference_loss(logits, labels), rel=1e-6, what="loss")
    # through the pytree round trip (DDP, FSDP, torch.compile) and pickling: the fields stay
    leaves, spec = pytree.tree_flatten(out)
    for copied in (pytree.tree_unflatten(leaves, spec), pickle.loads(pickle.dumps(out))):
        assert type(copied) is type(out) and torch.equal(copied.lse, out.lse)
    # return_dict=False: appended, in the order the output's to_tuple() gives
    as_tuple = model(**batch, return_dict=False)
    assert len(as_tuple) == len(out.to_tuple()) and torch.equal(as_tuple[-3], out.lse)
    assert torch.equal(as_tuple[-1], out.predicted_tokens)
    # evaluation: the logits as well
    model.eval()
    with torch.no_grad():
        out = model(**batch)
    assert_close(out.logits, logits, rel=1e-5, what="eval logits")
    assert_close(out["lse"], expected_lse, rel=_tolerance(backend), what="eval lse")
    assert float(out.token_accuracy) == pytest.approx(float(expected_accuracy), abs=1e-7)
    assert torch.equal(out.predicted_tokens, expected_predicted)
    # no labels: no loss, nothing attached
    assert "lse" not in model(input_ids=batch["input_ids"]).keys()


def test_bad_options_and_inputs_are_refused():
    model = tiny_model("llama")
    cases = [
        (dict(class_weights=torch.ones(VOCAB - 1)), r"class_weights must have one weight per vocabulary entry .*128"),
        (dict(class_weights=torch.ones(2, VOCAB)), r"class_weights must be a 1-D tensor \[V\], got shape \(2, 128\)"),
        (dict(class_weights=torch.tensor([1.0] * (VOCAB - 1) + [-1.0])), r"class_weights must be finite and >= 0, got -1.0"),
        (dict(class_weights=torch.ones(VOCAB).index_fill(0, torch.tensor([3]), float("nan"))), "class_weights must be finite and >= 0, got nan"),
        (dict(class_weights=torch.ones(VOCAB, dtype=torch.long)), "class_weights must be a floating-point tensor"),
        (dict(class_weights=[1.0] * VOCAB), "class_weights must be a torch.Tensor"),
        (dict(return_lse="yes"), "return_lse must be a bool"),
    ]  # fmt: skip
    for options, message in cases:
        with pytest.raises(ValueError, match=f"^lce_patch: {message}"):
            lce_patch.apply_fused_lce(model, **options)
        assert not is_patched(model)
    with pytest.raises(ValueError, match="class_weights must be finite"):
        FusedLCECallback(class_weights=-torch.ones(VOCAB))  # at construction, like the other options

    lce_patch.apply_fused_lce(model, backend="torch")
    batch = _batch()
    calls = [
        (dict(batch, token_weights=torch.ones(24)), r"token_weights must have the shape of labels \(2, 12\) .* got \(24,\)"),
        (dict(batch, shift_labels=batch["labels"], token_weights=torch.ones(2, 11)), r"shape of shift_labels \(2, 12\)"),
        (dict(batch, token_weights=torch.ones(2, 12, dtype=torch.long)), "token_weights must be a floating-point tensor"),
        (dict(input_ids=batch["input_ids"], token_weights=torch.ones(2, 12)), "only when it is given labels"),
        (dict(batch, token_weights=-torch.ones(2, 12)), "token_weights must be finite and >= 0, got -1.0"),  # the op's
    ]  # fmt: skip
    model.train()
    for call, message in calls:
        with pytest.raises(ValueError, match=message):
            model(**call)


def test_models_with_different_class_weights_stay_independent():
    class_weights, _ = _weights(9)
    other = torch.rand(VOCAB, dtype=torch.float64)
    given = class_weights.clone()
    first, reference = _models("torch", class_weights=given)
    second, _ = _models("torch", class_weights=other)
    given.fill_(1.0)  # the options keep their own copy
    options = first._lce_patch_options
    assert options != second._lce_patch_options
    same = LCEOptions(backend="torch", chunk_size=8, class_weights=class_weights.clone())
    assert options == same and hash(options) == hash(same)  # compared by value
    assert options != LCEOptions(backend="torch", chunk_size=8)
    batch = _batch(10)
    logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    for model, weights in ((first, class_weights), (second, other)):
        model.train()
        assert_close(model(**batch).loss, reference_loss(logits, batch["labels"], class_weights=weights), rel=1e-6)
    # the copy the op reads is made once per device and dtype, not per step
    copies = dict(options.class_weights._copies)
    first(**batch)
    assert list(copies) == [(torch.device("cpu"), torch.float64)]
    assert (
        options.class_weights._copies == copies
        and options.class_weights.on("cpu", torch.float64) is copies[(torch.device("cpu"), torch.float64)]
    )
    # deep copies and pickles keep the weights
    for copied in (copy.deepcopy(first), pickle.loads(pickle.dumps(first))):
        assert copied._lce_patch_options == options
        assert_close(copied(**batch).loss, first(**batch).loss, rel=1e-12)


def test_revert_leaves_nothing_behind():
    class_weights, token_weights = _weights()
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    before = set(vars(model)), set(vars(model.lm_head))
    lce_patch.apply_fused_lce(model, class_weights=class_weights, **LSE_AND_ACCURACY)
    model.train()
    model(**_batch(), token_weights=token_weights).loss.backward()
    lce_patch.revert_fused_lce(model)
    assert (set(vars(model)), set(vars(model.lm_head))) == before
    assert not is_patched(model)
    reference.train()
    out, ref = model(**_batch()), reference(**_batch())
    assert type(out) is type(ref) and torch.equal(out.loss, ref.loss) and torch.equal(out.logits, ref.logits)


def test_class_patch_with_class_weights():
    from transformers import LlamaForCausalLM

    class_weights, _ = _weights(11)
    try:
        lce_patch.apply_fused_lce("llama", backend="torch", class_weights=class_weights, return_token_accuracy=True)
        model = tiny_model("llama").double()
        reference = copy.deepcopy(model)  # patched too (by its class): called without labels, its own logits
        model.train()
        batch = _batch(12)
        out = model(**batch)
        logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        assert_close(out.loss, reference_loss(logits, batch["labels"], class_weights=class_weights), rel=1e-6)
        assert out.token_accuracy is not None
        lce_patch.apply_fused_lce("llama", backend="torch", class_weights=torch.ones(3))  # no instance to check
        with pytest.raises(ValueError, match=r"class_weights must have shape \(128,\)"):
            model(**batch)  # the op's check, at the first call
    finally:
        lce_patch.revert_fused_lce("llama")
    assert not hasattr(LlamaForCausalLM, "_lce_patch_options")


def test_trainer_and_trl_integrations():
    """The callback keeps lse / token_accuracy / predicted_tokens out of the Trainer's predictions; TRL's fused head, whose loss
    the patched forward does not compute, refuses the options."""
    from lce_patch.integrations.shared import log_prob_options as _op_kwargs
    from lce_patch.integrations.trainer import _ignoring_extra_outputs

    config = types.SimpleNamespace(keys_to_ignore_at_inference=["past_key_values"])
    trainer = types.SimpleNamespace(model=types.SimpleNamespace(config=config))
    extras = ["lse", "token_accuracy", "predicted_tokens"]
    assert _ignoring_extra_outputs(trainer, (), {}) == ((), {"ignore_keys": ["past_key_values", *extras]})
    assert _ignoring_extra_outputs(trainer, (["x"],), {}) == ((), {"ignore_keys": ["x", *extras]})
    for options in (
        dict(class_weights=torch.ones(VOCAB)),
        dict(return_lse=True),
        dict(return_token_accuracy=True),
        dict(return_predicted_tokens=True),
    ):
        with pytest.raises(ValueError, match="cannot apply under TRL's fused LM head"):
            _op_kwargs(options)
    assert _op_kwargs(dict(backend="torch", return_lse=False)) == {"backend": "torch"}


def test_callback_passes_the_options_on():
    class_weights, _ = _weights(13)
    model = tiny_model("llama")
    FusedLCECallback(class_weights=class_weights, return_lse=True).patch_model(model)
    assert model._lce_patch_options == LCEOptions(class_weights=class_weights, return_lse=True)


def test_compiled_patched_model_with_the_options_trains_like_eager():
    """Under torch.compile: the same loss, outputs and gradients, and no graph break (the output class with the
    extra fields is made by apply_fused_lce, the class weights' copy is a cache hit)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    class_weights, token_weights = _weights(14)
    eager = tiny_model("llama")
    compiled = copy.deepcopy(eager)
    for model in (eager, compiled):
        lce_patch.apply_fused_lce(model, backend="torch", class_weights=class_weights, **LSE_AND_ACCURACY)
        model.train()
    compiled.compile(backend="aot_eager", fullgraph=True)
    batch = _batch(15)
    counters.clear()
    out = compiled(**batch, token_weights=token_weights.float())
    expected = eager(**batch, token_weights=token_weights.float())
    assert not counters["graph_break"]
    assert type(out) is type(expected)
    for name in ("loss", "lse", "token_accuracy"):
        assert_close(out[name], expected[name], rel=1e-6, what=name)
    out.loss.backward()
    expected.loss.backward()
    assert_grads_match(compiled, eager)
    torch._dynamo.reset()


def test_unregistered_model_with_the_options_passes_its_self_check():
    """allow_unregistered's self-check compares the head with the model's own loss, so it runs without the options
    that change the loss; the model then trains with them."""
    from transformers import LlamaForCausalLM

    class Passthrough(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    class_weights, _ = _weights(16)
    model = Passthrough(tiny_model("llama").config).double()
    reference = copy.deepcopy(model)
    lce_patch.apply_fused_lce(model, allow_unregistered=True, backend="torch", class_weights=class_weights)
    assert model._lce_patch_options.class_weights is not None
    batch = _batch(17)
    logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    model.train()
    assert_close(model(**batch).loss, reference_loss(logits, batch["labels"], class_weights=class_weights), rel=1e-6)
