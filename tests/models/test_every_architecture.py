"""Every causal-LM and image-text-to-text type of the installed transformers, patched against unpatched.

A tiny random model of each type (``zoo.py``; with images, ``zoo_vision.py``) is patched and compared
with an untouched copy: the training loss and the gradient of every parameter (on logits scaled to a
standard deviation of 50, where a missing softcap or scale shows), the inference logits, ``generate()``
and the revert. What a type gets decides how it is patched:

- registered (``lce_patch.supported_architectures()``): ``apply_fused_lce(model)`` with no options, and
  every comparison must hold;
- listed in ``UNSUPPORTED``, or computing its loss inline on the installed transformers
  (``lce_patch.models.unsupported_architectures()``): refused by default, and the self-check of
  ``allow_unregistered=True`` must refuse it too (no type passes the check and then trains differently);
- neither (a type a newer transformers added): patched through ``allow_unregistered=True``; if the
  check accepts it, every comparison must hold, which is the forward-compatibility promise.
"""

from __future__ import annotations

import copy

import pytest
import torch

import lce_patch
from lce_patch.models import UNSUPPORTED, is_patched, unsupported_architectures
from lce_patch.models.lookups import is_registered

from .tiny import assert_trains_equal
from .zoo import CONFIG_MAPPING, EXCLUDED, NO_GENERATE, ZOO_TRANSFORMERS, ZOO_TYPES, build_tiny, text_batch
from .zoo_vision import VISION_TYPES, build_tiny_vision, vision_batch

LOGIT_STD = 50.0
# Registered types whose forward cannot run without images: proven by test_with_images alone.
IMAGES_REQUIRED = {"blip-2", "instructblip"}


class _ScaledHeadInput:
    """Forward pre-hook on the LM head: hidden states times a factor giving raw logits of std ``LOGIT_STD``.

    The factor is measured on the first call (the reference model) and reused for the patched one.
    """

    def __init__(self) -> None:
        self.factor: float | None = None

    def __call__(self, module: torch.nn.Module, args: tuple) -> tuple:
        hidden = args[0]
        if self.factor is None:
            with torch.no_grad():
                std = float((hidden.float() @ module.weight.float().t()).std())
            self.factor = LOGIT_STD / std if std > 0 else 1.0
        return (hidden * self.factor, *args[1:])


def _classified(model: torch.nn.Module, model_type: str) -> str:
    # A new type whose auto mapping names a registered class (transformers 5.24 maps exaone to
    # LlamaForCausalLM) is that class's model: accepted by default, and held to every comparison.
    if model_type in lce_patch.supported_architectures() or is_registered(model):
        return "registered"
    return "unsupported" if model_type in unsupported_architectures() else "unclassified"


def _patch(model: torch.nn.Module, model_type: str) -> bool:
    """Patch as a user would; False when the type is (rightly) refused."""
    kind = _classified(model, model_type)
    if kind == "registered":
        lce_patch.apply_fused_lce(model, backend="torch")
        return True
    with pytest.raises(ValueError, match="not a supported architecture"):
        lce_patch.apply_fused_lce(model, backend="torch")
    if kind == "unsupported" and _older_than_the_zoo():
        try:  # an older release's forward may differ: accepted by the self-check, it is held to every comparison
            lce_patch.apply_fused_lce(model, backend="torch", allow_unregistered=True)
        except (ValueError, NotImplementedError, TypeError):
            assert not is_patched(model)
            return False
        return True
    if kind == "unsupported":
        with pytest.raises((ValueError, NotImplementedError, TypeError)):
            lce_patch.apply_fused_lce(model, backend="torch", allow_unregistered=True)
        assert not is_patched(model)
        return False
    try:
        lce_patch.apply_fused_lce(model, backend="torch", allow_unregistered=True)
    except ValueError:
        assert not is_patched(model)
        return False
    return True


def _compare_training(model, reference, batch) -> None:
    scaling = _ScaledHeadInput()
    hooks = [m.get_output_embeddings().register_forward_pre_hook(scaling) for m in (reference, model)]
    try:
        assert_trains_equal(model, reference, batch, grad_rel=1e-4)
    finally:
        for hook in hooks:
            hook.remove()


def _compare_inference(model, reference, batch, generate: bool) -> None:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    model.eval()
    reference.eval()
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, reference(**inputs).logits)
        if generate:
            prompt = dict(input_ids=batch["input_ids"][:1, :6], attention_mask=torch.ones(1, 6, dtype=torch.long))
            kwargs = dict(max_new_tokens=2, do_sample=False)
            assert torch.equal(model.generate(**prompt, **kwargs), reference.generate(**prompt, **kwargs))


def _check_revert(model, reference, batch) -> None:
    lce_patch.revert_fused_lce(model)
    assert not is_patched(model) and "forward" not in vars(model) and "_loss_function" not in vars(model)
    head = model.get_output_embeddings()
    assert not any(name.startswith("_lce_patch") for name in vars(head)) and "forward" not in vars(head)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, reference(**inputs).logits)


def _older_than_the_zoo() -> bool:
    """Whether the installed transformers is older than the release the zoo and the refusals are written for."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) < Version(ZOO_TRANSFORMERS)


def _built(build, model_type: str) -> torch.nn.Module:
    """The zoo's tiny model; skipped (with the error) where the installed transformers has no such type, or is older
    than the release the zoo's per-type overrides are written for (``ZOO_TRANSFORMERS``) and cannot build it."""
    import transformers

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no model type {model_type!r}")
    try:
        return build(model_type)
    except Exception as err:  # noqa: BLE001 - an older release's config or class differs from what the zoo builds
        if not _older_than_the_zoo():
            raise
        pytest.skip(f"the zoo cannot build {model_type} on transformers {transformers.__version__}: {err!r}"[:300])


def _compared(compare, reference_alone) -> None:
    """``compare()``; where it raises, skipped if the unpatched model alone (``reference_alone()``) raises too: that
    failure is the installed transformers' own."""
    try:
        compare()
    except Exception:
        _skip_if_the_unpatched_model_fails(reference_alone)
        raise


def _reference_trains(reference, batch):
    def step():
        reference.train()
        reference(**batch).loss.backward()

    return step


def _reference_infers(reference, batch, generate: bool):
    def step():
        reference.eval()
        with torch.no_grad():
            reference(**{k: v for k, v in batch.items() if k != "labels"})
            if generate:
                prompt = dict(input_ids=batch["input_ids"][:1, :6], attention_mask=torch.ones(1, 6, dtype=torch.long))
                reference.generate(**prompt, max_new_tokens=2, do_sample=False)

    return step


@pytest.mark.parametrize("model_type", [t for t in ZOO_TYPES if t not in EXCLUDED and t not in IMAGES_REQUIRED])
def test_text(model_type):
    model = _built(build_tiny, model_type)
    reference = copy.deepcopy(model)
    if not _patch(model, model_type):
        return
    batch = text_batch(model, torch.Generator().manual_seed(0))
    generate = model_type not in NO_GENERATE
    _compared(lambda: _compare_training(model, reference, batch), _reference_trains(reference, batch))
    _compared(
        lambda: _compare_inference(model, reference, batch, generate=generate),
        _reference_infers(reference, batch, generate),
    )
    _check_revert(model, reference, batch)


@pytest.mark.parametrize("model_type", VISION_TYPES)
def test_with_images(model_type):
    model = _built(build_tiny_vision, model_type)
    reference = copy.deepcopy(model)
    if not _patch(model, model_type):
        return
    batch = vision_batch(model, torch.Generator().manual_seed(0))
    _skip_if_the_unpatched_model_fails(torch.no_grad()(lambda: reference(**batch)))
    _compared(lambda: _compare_training(model, reference, batch), _reference_trains(reference, batch))
    _check_revert(model, reference, batch)


def _skip_if_the_unpatched_model_fails(step) -> None:
    """Nothing to compare where transformers' own model fails ``step()`` (5.24's Llama4ForConditionalGeneration
    reads ``image_outputs`` from a text output that has none; 5.6's MoE models fail ``generate()`` with router
    logits on): skipped with the error, so a fixed release tests it."""
    import transformers

    try:
        step()
    except Exception as err:  # noqa: BLE001 - any failure of the unpatched model is upstream's
        pytest.skip(f"the unpatched model fails under transformers {transformers.__version__}: {err!r}"[:300])


def test_every_type_is_classified():
    """Each type of the installed mappings is registered, refused with a reason, or excluded from the zoo."""
    registered = set(lce_patch.supported_architectures())
    assert not registered & set(UNSUPPORTED)
    assert set(EXCLUDED) <= set(UNSUPPORTED), "a type the zoo cannot build is listed in UNSUPPORTED with the reason"
    assert all(reason for reason in UNSUPPORTED.values())
    assert IMAGES_REQUIRED <= set(VISION_TYPES)


def test_docs_list_the_registry():
    """The models page's architecture list is `python -m lce_patch.models`'s output (regenerate it if this fails)."""
    from pathlib import Path

    from lce_patch.models.registry import architectures_markdown

    page = (Path(__file__).parents[2] / "docs" / "models.md").read_text()
    start, end = "<!-- architectures:start -->\n", "<!-- architectures:end -->"
    block = page[page.index(start) + len(start) : page.index(end)]
    assert block == architectures_markdown()


def test_inline_losses_are_read_from_the_installed_forwards():
    """The types refused for an inline loss are those whose forward computes one: each UNSUPPORTED type said to
    compute its loss inline is read so from its installed forward (where it still does), and each registered type
    the installed transformers computes inline is refused and left out of the supported list, naming the class
    and the version."""
    import transformers

    from lce_patch.models import inline_loss_types
    from lce_patch.models.lookups import inline_loss_of, mapped_classes

    for model_type, reason in UNSUPPORTED.items():
        if reason.startswith("computes its loss inline"):
            classes = [cls for cls in mapped_classes(model_type) if cls.__name__.endswith("ForCausalLM")]
            assert all(inline_loss_of(cls) for cls in classes), model_type
    inline = inline_loss_types()
    assert not set(inline) & set(lce_patch.supported_architectures())
    for model_type, reason in inline.items():
        assert f"in the installed transformers {transformers.__version__} " in reason
        assert unsupported_architectures()[model_type] == reason
        with pytest.raises(ValueError, match="not a supported architecture"):
            lce_patch.apply_fused_lce(model_type)
