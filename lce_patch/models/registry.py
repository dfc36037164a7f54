"""Which architectures are patched, and how each one's head transforms its logits.

Every entry is *derived*: the patched forward runs the model's own ``forward`` and only replaces
what its LM head and its ``loss_function`` compute (``forward.py``), so an entry needs nothing but
the head's logit transform (final-logit softcap, logit scale or divisor). That transform is read
from the model: which of the known fields its ``forward`` applies to the logits, and how
(``_transforms_in``), and their values on the model, its config or its text config. A type is
*registered* when it is named in ``_REGISTERED`` below, i.e. when the test over every causal-LM
type of the installed transformers (``tests/models/test_every_architecture.py``) proved it equal
to the unpatched model. Explicit
entries (``_OVERRIDES``) exist only where derivation is wrong; ``UNSUPPORTED`` says why each
remaining type is refused. A registered type is refused too on a transformers whose forward for it computes its
loss other than through ``self.loss_function`` on the call's labels (``inline_loss_reason``, read from the code;
``inline_loss_types``). A model of any other type is patched with ``allow_unregistered=True``
after a self-check of its loss and every gradient against its own forward (``patch.py``).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import textwrap
import types
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeadConfig:
    """How the LM head turns ``hidden @ W.T`` into the logits the loss sees.

    ``logits = softcap * tanh(logit_scale * (hidden @ W.T + b) / softcap)`` (no tanh when ``softcap`` is None).
    """

    softcap: float | None = None
    logit_scale: float = 1.0


@dataclass(frozen=True)
class ArchSpec:
    """One architecture: the names of the fields holding its head's logit transform.

    A field is looked up on the model instance, then its config, then its text config (the first one
    that is set wins), the places Hugging Face's forwards read it from.
    """

    model_type: str
    softcap_attr: str | None = None  # final-logit softcap: softcap * tanh(logits / softcap)
    logit_scale_attr: str | None = None  # multiplies the logits
    logit_divisor_attr: str | None = None  # divides the logits
    registered: bool = True

    def head_config(self, model: torch.nn.Module) -> HeadConfig:
        softcap = _field(model, self.softcap_attr)
        scale = 1.0
        multiplier = _field(model, self.logit_scale_attr)
        if multiplier is not None:
            scale *= float(multiplier)
        divisor = _field(model, self.logit_divisor_attr)
        if divisor is not None:
            scale /= float(divisor)
        return HeadConfig(softcap=None if softcap is None else float(softcap), logit_scale=scale)


# The fields that drive Hugging Face heads' logit transforms. A softcap field always means a softcap;
# a scale field multiplies or divides, as the operator in front of it in the forward's source says.
_SOFTCAP_FIELDS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")
_SCALE_FIELDS = ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")
_FIELD_REFERENCE = re.compile(
    r"(?P<op>[*/])?\s*(?:[A-Za-z_][A-Za-z0-9_]*\.)*(?P<name>" + "|".join(_SOFTCAP_FIELDS + _SCALE_FIELDS) + r")\b"
)


def _field(model: torch.nn.Module, name: str | None) -> float | None:
    """A field's value on the model, its config, or its (decoder) text config, the first that is set."""
    if name is None:
        return None
    config = model.config
    places = [vars(model), config]
    if hasattr(config, "get_text_config"):
        places.append(config.get_text_config(decoder=True))
    for place in places:
        value = place.get(name) if isinstance(place, dict) else getattr(place, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return value.item()
    return None


@functools.cache
def _transforms_in(forward) -> tuple[tuple[str, str], ...]:
    """(kind, field) of each logit transform a forward's source applies after its head.

    A softcap field named anywhere is a softcap (no other use of those names exists). A scale field
    counts where a statement assigning ``logits`` multiplies or divides by it: a field scaling the
    hidden states *before* the head (MiniCPM3) is already in what the head receives. Empty when the
    source cannot be read.
    """
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return ()
    found: list[tuple[str, str]] = []
    for match in _FIELD_REFERENCE.finditer(source):
        if match["name"] in _SOFTCAP_FIELDS and not any(kind == "softcap" for kind, _ in found):
            found.append(("softcap", match["name"]))
    for line in source.splitlines():
        target, equals, expression = line.partition("=")
        if not equals or target.strip() != "logits" or expression.startswith("="):
            continue
        for match in _FIELD_REFERENCE.finditer(expression):
            if match["name"] in _SCALE_FIELDS and match["op"] is not None:
                found.append(("divisor" if match["op"] == "/" else "scale", match["name"]))
    return tuple(found)


# Names whose use in a forward computes a cross-entropy loss there, on the logits.
_INLINE_LOSS_NAMES = ("CrossEntropyLoss", "cross_entropy", "nll_loss", "NLLLoss")


def _code_names(function) -> frozenset[str]:
    """The global and attribute names a function's code (and the code of its nested functions) uses."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    names: set[str] = set()
    pending = [code] if code is not None else []
    while pending:
        code = pending.pop()
        names.update(code.co_names)
        pending += [const for const in code.co_consts if isinstance(const, types.CodeType)]
    return frozenset(names)


def _loss_names(forward, owner: type | None) -> frozenset[str]:
    """The names a forward uses, with those of the methods of ``owner`` it calls and, where it calls
    ``super().forward``, those of the base class's forward."""
    names = _code_names(forward)
    found = set(names)
    if owner is None or not names:
        return frozenset(found)
    for name in names - {"forward"}:
        method = inspect.getattr_static(owner, name, None)
        if inspect.isfunction(method):
            found |= _code_names(method)
    if {"super", "forward"} <= names:
        target = inspect.unwrap(forward)
        classes = [cls for cls in owner.__mro__ if "forward" in vars(cls)]
        here = next((i for i, cls in enumerate(classes) if inspect.unwrap(vars(cls)["forward"]) is target), None)
        if here is not None and here + 1 < len(classes):
            base = classes[here + 1]
            found |= _loss_names(vars(base)["forward"], base)
    return frozenset(found)


def _labels_given_to_loss_function(forward) -> str | None:
    """The labels expression a forward passes ``self.loss_function`` where it is not its ``labels`` argument (a
    shifted copy, say), read from its source; None where it passes ``labels`` or the source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(forward))))
    except (OSError, TypeError, SyntaxError):
        return None
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr != "loss_function":
            continue
        given = next((k.value for k in node.keywords if k.arg == "labels"), None)
        if given is None and len(node.args) > 1 and not isinstance(node.args[1], ast.Starred):
            given = node.args[1]
        if given is not None and not _is_the_calls_labels(given):
            return ast.unparse(given)
    return None


def _is_the_calls_labels(node: ast.expr) -> bool:
    """``labels``, or ``labels.to(...)`` (moved to the logits' device: the same labels)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to":
        node = node.func.value
    return isinstance(node, ast.Name) and node.id == "labels"


@functools.cache
def inline_loss_reason(forward, owner: type | None = None) -> str | None:
    """How an (unpatched) ``forward`` computes its loss other than through ``self.loss_function`` on the labels it
    is called with; None where it does not.

    Read from the forward's code, so it holds on any transformers version: a forward that names ``loss_function``
    (itself, in a method of ``owner`` it calls, or in the base class's forward it calls through ``super()``)
    computes its loss there, where the fused loss stands in for it. One that names none but builds a cross-entropy
    on the logits (``CrossEntropyLoss``, ``cross_entropy``, ...) computes its loss inline, and one that passes
    ``loss_function`` labels of its own (a copy it shifted itself) asks for a loss on other targets than the call's:
    the fused loss, computed in the LM head's call from the call's labels, cannot stand in for either (patched, its
    first call with labels would raise). None also where the code cannot be read.
    """
    names = _loss_names(forward, owner)
    if "loss_function" in names:
        own = _labels_given_to_loss_function(forward)
        if own is not None:
            return f"passes its loss_function labels of its own ({own}), not the labels it is called with"
        return None
    inline = next((name for name in _INLINE_LOSS_NAMES if name in names), None)
    if inline is None:
        return None
    what = "a CrossEntropyLoss" if inline == "CrossEntropyLoss" else inline
    return f"computes its loss inline ({what} on the logits), not through self.loss_function"


def derived_spec(forward, model_type: str, registered: bool = False) -> ArchSpec:
    """The entry of a class whose (unpatched) ``forward`` is given, read from its source (see the module docstring)."""
    fields: dict[str, str] = {}
    for kind, name in _transforms_in(forward):
        fields.setdefault(kind, name)
    spec = ArchSpec(
        model_type=model_type,
        softcap_attr=fields.get("softcap"),
        logit_scale_attr=fields.get("scale"),
        logit_divisor_attr=fields.get("divisor"),
        registered=registered,
    )
    return dataclasses.replace(spec, **_OVERRIDES.get(model_type, {}))


# Where derivation is wrong, the fields to use instead: Inkling 2 Loop (transformers 5.24) applies its
# final softcap through a module built from ``final_logit_softcapping``, whose name its forward never says.
_OVERRIDES: dict[str, dict] = {
    "inkling2_loop": {"softcap_attr": "final_logit_softcapping"},
    "inkling2_loop_text": {"softcap_attr": "final_logit_softcapping"},
}

# Proven equal to the unpatched model (loss, every gradient, inference logits, generate, revert) by
# tests/models/test_every_architecture.py on transformers 5.23 and 5.24 (types of 5.24 only: apertus1p5,
# apertus1p5_text, exaone, hy_v4_vl, inkling2_loop, inkling2_loop_text, lara_mini, sarvam_mla,
# sarvam_moe). Adding a type is adding its name.
_REGISTERED = """
afmoe apertus apertus1p5 apertus1p5_text arcee aria aria_text axk1 axk2 aya_vision bailing_hybrid bamba beam bert bert-generation
big_bird biogpt bitnet blip-2 bloom blt camembert codegen cohere cohere2 cohere2_moe cohere2_vision
cohere_compass cohere_compass_text cosmos3_edge cosmos3_omni ctrl cwm data2vec-text dbrx deepseek_ocr2
deepseek_v2 deepseek_v3 deepseek_v32 deepseek_v4 deepseek_vl deepseek_vl_hybrid diffllama doge dots1
dots3_note dots3_note_text electra emu3 ernie ernie4_5 ernie4_5_moe ernie4_5_vl_moe evolla exaone exaone4 exaone4_5
exaone_moe falcon falcon_h1 falcon_mamba flex_olmo flint fuyu gemma gemma2 gemma3 gemma3_text gemma3n_text
gemma4 gemma4_text gemma4_unified gemma4_unified_text glm glm4 glm46v glm4_moe glm4_moe_lite glm4v glm4v_moe
glm5_next glm_moe_dsa glm_ocr glmga got_ocr2 gpt-sw3 gpt2 gpt_bigcode gpt_neo gpt_neox gpt_neox_japanese
gpt_oss gptj granite granite4_vision granite_docling granite_swa granitemoe granitemoe_swa granitemoehybrid
granitemoeshared helium hrm_text hunyuan_v1_dense hunyuan_v1_moe hunyuan_vl hy_v3 hy_v4 hy_v4_vl hyperclovax
hyperclovax_vision_v2 idefics2 idefics3 inkling2_loop inkling2_loop_text inkling_mm_model inkling_text instructblip internlm3 internvl
iquestcoder jais2 jamba janus jetmoe kimi_k25 kimi_linear kolibri1 laguna lara_mini lfm2 lfm2_moe lfm2_vl lfm3 lfm3_vl
lighton_ocr llama llama4 llama4_text llava llava_next llava_next_video llava_onevision longcat_flash mamba
mamba2 megatron-bert mellum mimo_v2_flash minicpm3 minicpm_ocr minicpmv4_6 minicpmv4_7 minimax minimax_m2
minimax_m3_vl minimax_m3_vl_text ministral ministral3 mistral mistral3 mistral4 mistral_large4 mixtral mllama
modernbert-decoder molmo2 moshi moss_transcribe_diarize mpt muse_glimmer muse_spark nanochat nemotron
nemotron_h olmo olmo2 olmo3 olmo_hybrid olmoe openai-gpt opt ovis2 paddleocr_vl paligemma persimmon phi phi3
phi4_multimodal phimoe pp_chart2table qianfan_ocr qwen2 qwen2_5_omni_thinker qwen2_5_vl qwen2_moe qwen2_vl
qwen3 qwen3_5 qwen3_5_moe qwen3_5_moe_text qwen3_5_text qwen3_moe qwen3_next qwen3_omni_moe_thinker qwen3_vl
qwen3_vl_moe qwen4_exp qwen4_exp_text recurrent_gemma rembert roberta roberta-prelayernorm roc_bert roformer
rwkv sarvam_mla sarvam_moe seed_oss shieldgemma2 smollm3 smolvlm solar_open stablelm starcoder2 step3p7 unlimited_ocr vaultgemma
video_llama_3 video_llava vipllava xglm xlm-roberta xlm-roberta-xl xlstm xmod youtu zamba zamba2 zaya
""".split()

# Types of the installed transformers' causal-LM and image-text-to-text mappings that are refused, and why.
UNSUPPORTED: dict[str, str] = {
    "bart": "computes its loss inline (a CrossEntropyLoss on the logits), not through loss_function",
    "bigbird_pegasus": "computes its loss inline (a CrossEntropyLoss on the logits), not through loss_function",
    "blenderbot": "computes its loss inline (a CrossEntropyLoss on the logits), not through loss_function",
    "blenderbot-small": "computes its loss inline (a CrossEntropyLoss on the logits), not through loss_function",
    "blip": "its text decoder's head is not exposed by get_output_embeddings()",
    "chameleon": "masks the image-token logits before the loss (in place, on the full logits)",
    "cpmant": "computes its loss inline (a CrossEntropyLoss on the logits), not through loss_function",
    "diffusion_gemma": "block diffusion: no causal language-model loss on labels",
    "fast_vlm": "not verified: the vision tower is a timm model (timm is not installed in CI)",
    "florence2": "encoder-decoder: the loss is on the decoder's unshifted targets; not verified",
    "gemma3n": "not verified: the vision tower is a timm model (timm is not installed in CI); its text model, gemma3n_text, is registered",
    "gemma4_assistant": "speculative-decoding drafter: reads the target model's KV states, no labels",
    "gemma4_unified_assistant": "speculative-decoding drafter: reads the target model's KV states, no labels",
    "git": "not verified: its forward needs image inputs the test suite does not build yet",
    "idefics": "not verified: its forward needs image inputs the test suite does not build yet",
    "dory": "its head multiplies the logits by a learned per-token scale (lm_head.logit_scale)",
    "inkling2": "applies a learned logit softcap module and cuts the logits to an unpadded vocabulary",
    "inkling2_text": "applies a learned logit softcap module and cuts the logits to an unpadded vocabulary",
    "instructblipvideo": "not verified: its forward needs image inputs the test suite does not build yet",
    "kosmos-2": "not verified: its forward needs image inputs the test suite does not build yet",
    "kosmos-2.5": "computes its loss inline (a CrossEntropyLoss on the logits), not through loss_function",
    "marian": "computes its loss inline (a CrossEntropyLoss on the logits), not through loss_function",
    "mbart": "computes its loss inline (a CrossEntropyLoss on the logits), not through loss_function",
    "musicgen": "audio-codebook decoder: labels per codebook, several heads",
    "musicgen_melody": "audio-codebook decoder: labels per codebook, several heads",
    "mvp": "computes its loss inline (a CrossEntropyLoss on the logits), not through loss_function",
    "nemotron_h_omni": "its head is not exposed by get_output_embeddings()",
    "pegasus": "computes its loss inline (a CrossEntropyLoss on the logits), not through loss_function",
    "perception_lm": "not verified: the vision tower is a timm model (timm is not installed in CI)",
    "pi0": "a vision-language-action policy: flow-matching loss on actions, no language-model loss",
    "pix2struct": "encoder-decoder: the loss is on the decoder's unshifted targets; not verified",
    "plbart": "computes its loss inline (a CrossEntropyLoss on the logits), not through loss_function",
    "pp_formulanet": "encoder-decoder: the loss is on the decoder's unshifted targets; not verified",
    "prophetnet": "n-gram prediction streams: its head sees 4-D hidden states",
    "reformer": "its reversible layers backpropagate only in training mode; not verified",
    "t5gemma2": "encoder-decoder: the loss is on the decoder's unshifted targets; not verified",
    "trocr": "computes its loss inline (a CrossEntropyLoss on the logits), not through loss_function",
    "udop": "encoder-decoder: the loss is on the decoder's unshifted targets; not verified",
    "vision-encoder-decoder": "encoder-decoder: the loss is on the decoder's unshifted targets; not verified",
    "whisper": "computes its loss inline (a CrossEntropyLoss on the logits), not through loss_function",
    "xlm": "computes its loss inline (a CrossEntropyLoss on the logits), not through loss_function",
    "xlnet": "computes its loss inline (a CrossEntropyLoss on the logits), not through loss_function",
}

REGISTRY: frozenset[str] = frozenset(_REGISTERED)


def inline_loss_types() -> dict[str, str]:
    """Registered types that the installed transformers refuses: those whose class there computes its loss inline.

    model_type -> the reason, naming the class and the transformers version. A type registered on a newer
    transformers may compute its loss inline on an older one (Gemma 3, Mamba and six more on 5.6); it is then
    refused, not patched and failing at its first training call. Read from each registered class's forward (its
    module is imported the first time this is asked; cached after).
    """
    return dict(_inline_loss_types())


@functools.cache
def _inline_loss_types() -> tuple[tuple[str, str], ...]:
    from .lookups import inline_loss_of, mapped_classes  # lookups reads this module

    found = []
    for model_type in sorted(REGISTRY):
        for cls in mapped_classes(model_type):
            reason = inline_loss_of(cls)
            if reason is not None:
                found.append((model_type, reason))
                break
    return tuple(found)


def supported_architectures() -> list[str]:
    """The ``config.model_type`` values :func:`lce_patch.apply_fused_lce` patches without a self-check on the
    installed transformers: the registered types, less those whose forward computes its loss inline on that
    version (:func:`inline_loss_types`). The first call imports each registered type's model classes."""
    return sorted(REGISTRY - {model_type for model_type, _ in _inline_loss_types()})


def unsupported_architectures() -> dict[str, str]:
    """The refused types of the installed transformers, with the reason: :data:`UNSUPPORTED` and
    :func:`inline_loss_types`."""
    return {**UNSUPPORTED, **inline_loss_types()}


def architectures_markdown() -> str:
    """The models page's (docs/models.md) list of supported and refused architectures, generated from this module."""
    lines = [
        f"**Registered ({len(REGISTRY)} model types)**, patched by `apply_fused_lce(model)` with no options "
        "(each proven equal to the unpatched model by `tests/models/test_every_architecture.py`):",
        "",
        ", ".join(f"`{name}`" for name in sorted(REGISTRY)),
        "",
        f"**Refused ({len(UNSUPPORTED)} model types)**, with the reason:",
        "",
        "| model type | reason |",
        "|---|---|",
    ]
    lines += [f"| `{name}` | {reason} |" for name, reason in sorted(UNSUPPORTED.items())]
    return "\n".join(lines) + "\n"
