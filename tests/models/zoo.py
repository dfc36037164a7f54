"""Tiny random models of every causal-LM and image-text-to-text model type of transformers, built from configs.

`tiny_config` walks a model type's default config and its sub-configs and overrides the usual size fields with
tiny values (a generic shrinker: widths 32, 4 heads, a few layers that keep every kind of layer, 4 experts / top-2,
vocab 128, dropouts 0, softcaps / logit scales far from 1, MoE aux losses on), then applies the per-type kwargs in
`_OVERRIDES` where the generic values do not give a working or coherent config. No downloads: everything is built
from the config classes. `EXCLUDED`, `NO_GENERATE` and `NEEDS_PIXELS` say which types a text-only test must skip.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import math
from typing import Any

import torch
import transformers
from transformers import PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, model_type_to_module_name
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

VOCAB = 128
# The transformers release the per-type overrides below are written for (CI's). On an older one, a type the zoo
# cannot build, or one the unpatched model fails on, is skipped with the error (test_every_architecture.py).
ZOO_TRANSFORMERS = "5.24"
_CLASS_NAMES: dict[str, str] = {**MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, **MODEL_FOR_CAUSAL_LM_MAPPING_NAMES}
ZOO_TYPES: list[str] = sorted(_CLASS_NAMES)

# --------------------------------------------------------------------------------------------------------------------
# Generic shrinker
# --------------------------------------------------------------------------------------------------------------------

_WIDTH, _FFN, _HEADS, _KV_HEADS, _HEAD_DIM = 32, 64, 4, 2, 8


def _same(value: int, *names: str) -> dict[str, int]:
    return dict.fromkeys(names, value)


# field -> tiny value, applied to every (sub-)config that has the field with an integer value (zero stays zero)
_SIZES: dict[str, int] = {
    # widths; every tower has the same width, so the fields that give one tower's width to another agree too
    **_same(_WIDTH, "hidden_size", "n_embd", "d_model", "embed_dim", "emb_dim", "embedding_dim", "lru_width"),
    **_same(_WIDTH, "word_embed_proj_dim", "projection_dim", "projector_hidden_size", "projection_hidden_size"),
    **_same(_WIDTH, "hidden_size_global", "out_hidden_size", "text_hidden_size", "vision_hidden_size", "output_dim"),
    **_same(_WIDTH, "adapter_in_dim", "adapter_out_dim", "adapter_input_size", "projector_input_dim"),
    **_same(_WIDTH, "projector_output_dim", "projection_hidden_dim"),
    **_same(_FFN, "intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "d_inner", "n_inner"),
    **_same(_FFN, "mlp_dim", "ffn_hidden_size", "feed_forward_size", "intermediate_size_mlp", "dff", "dim_ff"),
    **_same(_FFN, "dense_intermediate_size", "alignment_intermediate_size", "projection_intermediate_size"),
    # attention
    **_same(_HEADS, "num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads", "resampler_heads"),
    **_same(_HEADS, "encoder_attention_heads", "decoder_attention_heads", "num_encoder_attention_heads"),
    **_same(_HEADS, "num_decoder_attention_heads", "swa_num_attention_heads", "num_sliding_attention_heads"),
    **_same(_HEADS, "resampler_n_heads"),
    **_same(_KV_HEADS, "num_key_value_heads", "swa_num_key_value_heads"),
    **_same(_HEAD_DIM, "head_dim", "attention_head_size", "d_head", "kv_channels", "d_kv", "swa_head_dim", "dim_head"),
    **_same(_HEAD_DIM, "resampler_head_dim", "resampler_dim_head"),
    **_same(8, "sliding_window", "sliding_window_size", "attention_window_size", "attention_chunk_size"),
    "rotary_dim": 4,
    # multi-head latent attention (MLA) and sparse-attention indexers
    **_same(16, "kv_lora_rank", "q_lora_rank", "o_lora_rank", "qk_head_dim"),
    **_same(8, "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "index_head_dim"),
    "index_n_heads": 2,
    "index_topk": 4,
    # vocabularies and positions
    **_same(VOCAB, "vocab_size", "vocab_size_per_layer_input", "unpadded_vocab_size"),
    **_same(64, "max_position_embeddings", "n_positions", "max_seq_len", "max_target_positions"),
    # mixture of experts
    **_same(4, "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
    **_same(2, "num_experts_per_tok", "moe_topk", "moe_k", "moe_top_k", "top_k_experts"),
    **_same(16, "moe_intermediate_size", "expert_ffn_hidden_size", "moe_hidden_size", "router_hidden_size"),
    **_same(32, "shared_expert_intermediate_size", "shared_intermediate_size", "shared_experts_intermediate_size"),
    **_same(32, "moe_shared_expert_intermediate_size", "share_expert_dim"),
    # state-space / linear-attention mixers
    **_same(8, "state_size", "mamba_d_state", "ssm_state_size", "time_step_rank", "mamba_dt_rank"),
    **_same(4, "mamba_n_heads", "mamba_num_heads"),
    **_same(2 * _WIDTH // 4, "mamba_head_dim"),  # mamba_expand * hidden_size / heads
    "mamba_d_ssm": 2 * _WIDTH,
    "mamba_n_groups": 1,
    **_same(8, "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim"),
    "linear_num_key_heads": 2,
    **_same(4, "linear_num_value_heads", "linear_num_heads"),
    # odds and ends
    **_same(8, "hidden_size_per_layer_input", "laurel_rank"),
    **_same(16, "adapter_rank"),
    **_same(4, "resampler_n_latents", "resampler_num_latents", "latent_query_num", "num_query_tokens"),
    **_same(1, "resampler_depth", "aligner_num_add_layers"),
    # SAM-style vision necks (got_ocr2, deepseek-ocr, ...)
    "output_channels": 16,
    "num_pos_feats": 8,
}
# vision patching, applied to configs that have both fields
_VISION_SIZES = {"image_size": 32, "patch_size": 8}
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
# at most one shared expert (zero keeps them off)
_CAP_ONE = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
_LAYER_COUNTS = (
    "num_hidden_layers",
    "n_layer",
    "n_layers",
    "num_layers",
    "encoder_layers",
    "decoder_layers",
    "depth",
    "layers",
    "num_decoder_layers",
    "num_encoder_layers",
)
# lists of layer indices (not one entry per layer)
_INDEX_LISTS = (
    "mlp_only_layers",
    "moe_layers",
    "full_attn_idxs",
    "cross_attention_layers",
    "rope_scaling_layers",
    "global_attn_indexes",
    "fullatt_block_indexes",
    "deepstack_visual_indexes",
    "intermediate_layers_indices",
    "local_layer_ids",
    "attn_layer_indices",
)
# one layer index per layer (the layer whose key/values a layer reads, ...)
_PER_LAYER_INDICES = ("kv_source_layers",)
# number of leading layers of a kind (dense layers before the MoE ones, ...)
_PREFIX_COUNTS = ("first_k_dense_replace", "num_dense_layers")
# number of trailing layers of a kind (layers reusing another layer's key/values, ...)
_SUFFIX_COUNTS = ("num_kv_shared_layers",)
_FIXED: dict[str, Any] = {
    "final_logit_softcapping": 2.0,
    "logits_soft_cap": 2.0,
    "output_logit_soft_cap": 2.0,
    "logit_scale": 0.25,
    "logits_scaling": 4.0,
    "output_multiplier": 4.0,
    "lm_head_multiplier": 0.25,
    "logits_mup_width_multiplier": 4.0,
    "output_router_logits": True,
    "router_aux_loss_coef": 0.1,
    "aux_loss_coef": 0.1,
    "moe_loss_weight": 0.1,
}


def _field_names(config: PretrainedConfig) -> list[str]:
    """A config class's fields: its dataclass fields (transformers >= 5.4), else the keyword parameters of its
    ``__init__`` and its bases' up to PretrainedConfig (the fields of the older, non-dataclass configs)."""
    if dataclasses.is_dataclass(config):
        return [field.name for field in dataclasses.fields(config)]
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names: list[str] = []
    for cls in type(config).__mro__:
        if cls is PretrainedConfig or not issubclass(cls, PretrainedConfig):
            break
        if "__init__" in vars(cls):
            parameters = inspect.signature(vars(cls)["__init__"]).parameters.values()
            names += [p.name for p in parameters if p.kind in kinds and p.name != "self"]
    return list(dict.fromkeys(names))


def _fields(config: PretrainedConfig) -> dict[str, Any]:
    """The fields of a config with their values, read without the per-layer (heterogeneous) attribute checks."""
    values, aliases = vars(config), type(config).attribute_map
    out = {}
    for name in _field_names(config):
        key = aliases.get(name, name)  # a field stored under its alias
        if key in values or name in values:
            out[name] = values.get(key, values.get(name))
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _select_layers(values: dict[str, Any], count_key: str) -> dict[str, Any]:
    """Keep a few layers that show every kind present (each value of each per-layer list, index-list membership,
    dense prefix / shared suffix), in their original order; reduce the per-layer fields consistently."""
    n = values[count_key]
    per_layer = {
        k: v
        for k, v in values.items()
        if k not in _INDEX_LISTS
        and k not in _PER_LAYER_INDICES
        and isinstance(v, (list, tuple))
        and len(v) == n
        and all(isinstance(x, (str, int, float, bool)) or x is None for x in v)
    }
    index_lists = {k: v for k, v in values.items() if k in _INDEX_LISTS and isinstance(v, (list, tuple))}
    prefixes = {k: v for k, v in values.items() if k in _PREFIX_COUNTS and _is_int(v)}
    suffixes = {k: v for k, v in values.items() if k in _SUFFIX_COUNTS and _is_int(v)}

    def features(i: int) -> set[tuple]:
        return (
            {(k, v[i]) for k, v in per_layer.items()}
            | {(k, i in v) for k, v in index_lists.items()}
            | {(k, i < v) for k, v in prefixes.items()}
            | {(k, i >= n - v) for k, v in suffixes.items()}
        )

    # greedy set cover: repeatedly take the (first) layer that shows the most kinds not shown yet
    todo = set().union(*(features(i) for i in range(n)))
    keep: list[int] = []
    while todo:
        best = max(range(n), key=lambda i: (len(features(i) & todo), -i))
        keep.append(best)
        todo -= features(best)
    while len(keep) < 2:
        keep.append(next(i for i in range(n) if i not in keep))
    keep.sort()
    out: dict[str, Any] = {count_key: len(keep)}
    for k, v in per_layer.items():
        out[k] = type(v)(_SIZES.get(k, v[i]) if _is_int(v[i]) else v[i] for i in keep)
    for k, v in index_lists.items():
        out[k] = type(v)(keep.index(i) for i in v if i in keep)
    for k, v in values.items():
        if k in _PER_LAYER_INDICES and isinstance(v, (list, tuple)) and len(v) == n:
            out[k] = type(v)(keep.index(v[i]) if v[i] in keep else j for j, i in enumerate(keep))
    for k, v in prefixes.items():
        out[k] = sum(i < v for i in keep)
    for k, v in suffixes.items():
        out[k] = sum(i >= n - v for i in keep)
    return out


def _generic(config: PretrainedConfig) -> dict[str, Any]:
    """Tiny values for the size fields of one config level (no recursion)."""
    values = _fields(config)
    kw: dict[str, Any] = {}
    for name, value in values.items():
        if name in _SIZES and _is_int(value):
            kw[name] = _SIZES[name] if value else 0  # zero switches a feature off (no rope dims, no experts, ...)
        elif name in _CAP_ONE and _is_int(value) and value > 0:
            kw[name] = 1
        elif name in ("head_dim", "num_key_value_heads") and value is None:
            kw[name] = _SIZES[name]
        elif name in ("n_group", "topk_group") and _is_int(value):
            kw[name] = 2 if name == "n_group" else 1
        elif name in _FIXED and (value is None or not isinstance(value, (dict, list))):
            kw[name] = _FIXED[name]
        elif isinstance(value, float) and ("dropout" in name or "pdrop" in name or "drop_path" in name):
            kw[name] = 0.0
        elif name in ("layerdrop", "encoder_layerdrop", "decoder_layerdrop") or "jitter_noise" in name:
            kw[name] = 0.0 if isinstance(value, float) else value
    if _is_int(values.get("image_size")) and _is_int(values.get("patch_size")):
        kw.update(_VISION_SIZES)
    if isinstance(values.get("downsample_channels"), (list, tuple)):
        kw["downsample_channels"] = [16, _WIDTH]
    for name in ("intermediate_size", "moe_intermediate_size"):  # one size per kind of expert / per layer
        value = values.get(name)
        if isinstance(value, (list, tuple)) and name not in kw and all(_is_int(v) for v in value):
            kw[name] = type(value)(_SIZES[name] for _ in value)
    for count_key in _LAYER_COUNTS:
        if _is_int(values.get(count_key)) and values[count_key] > 2:
            kw.update(_select_layers(values, count_key))
    if _is_int(values.get("kv_lora_rank")) and "num_key_value_heads" in values:  # MLA: one key/value per head
        kw["num_key_value_heads"] = kw.get("num_attention_heads", values.get("num_attention_heads"))
    if _is_int(values.get("mamba_d_head")):
        kw["mamba_d_head"] = values.get("mamba_expand", 2) * _WIDTH // _SIZES["mamba_n_heads"]
    moe = _is_int(values.get("moe_intermediate_size")) or any(_is_int(values.get(k)) for k in _EXPERT_COUNTS)
    if moe:  # an MoE config that leaves the expert counts to the checkpoint
        for name in (*_EXPERT_COUNTS, "num_experts_per_tok"):
            if name in values and values[name] is None:
                kw[name] = _SIZES[name]
    return kw


def _sub_configs(config: PretrainedConfig) -> dict[str, PretrainedConfig]:
    """The sub-configs held by a config (text_config, vision_config, audio_config, vq_config, ...)."""
    return {k: v for k, v in _fields(config).items() if isinstance(v, PretrainedConfig)}


def _shrink(
    cls: type[PretrainedConfig], default: PretrainedConfig, init_kwargs: dict[str, Any], overrides: dict[str, Any]
) -> PretrainedConfig:
    """A new `cls` built from the generic tiny kwargs of `default` (and of its sub-configs, recursively), the
    sub-config spec's `init_kwargs` and the `overrides`; multimodal rope sections resized to the new head_dim."""
    kw: dict[str, Any] = dict(init_kwargs)
    kw.update(_generic(default))
    specs = getattr(cls, "sub_configs_defaults", {}) or {}
    for key, sub in _sub_configs(default).items():
        spec = specs.get(key)
        sub_init = dict(spec.init_kwargs) if spec is not None else {}
        sub_overrides = overrides.get(key, {})
        if sub_overrides is None:
            kw[key] = None
            continue
        kw[key] = _shrink(type(sub), sub, sub_init, sub_overrides)
        if not dataclasses.is_dataclass(default):  # the older configs build their sub-configs from dicts
            kw[key] = kw[key].to_dict()
    shrunk = {key for key, value in kw.items() if isinstance(value, PretrainedConfig) or key in _sub_configs(default)}
    kw.update({k: v for k, v in overrides.items() if k not in kw or k not in shrunk or kw[k] is None})
    rope = kw.get("rope_parameters", _fields(default).get("rope_parameters"))
    if isinstance(rope, dict):
        head_dim = kw.get("head_dim")
        if not _is_int(head_dim):
            head_dim = kw.get("hidden_size", _WIDTH) // kw.get("num_attention_heads", _HEADS)
        fixed = _fixed_rope(copy.deepcopy(rope), head_dim)
        if fixed != rope:
            kw["rope_parameters"] = fixed
    return cls(**kw)


# --------------------------------------------------------------------------------------------------------------------
# Coherence fixes: rope sections, special token ids
# --------------------------------------------------------------------------------------------------------------------


def _walk(config: PretrainedConfig) -> list[PretrainedConfig]:
    """A config and all its sub-configs, depth first."""
    out = [config]
    for sub in _sub_configs(config).values():
        out.extend(_walk(sub))
    return out


def _split(total: int, weights: list[int]) -> list[int]:
    """Split `total` into len(weights) positive parts roughly proportional to weights."""
    raw = [w * total / sum(weights) for w in weights]
    parts = [max(1, math.floor(r)) for r in raw]
    while sum(parts) > total:
        parts[parts.index(max(parts))] -= 1
    i = 0
    while sum(parts) < total:
        parts[i % len(parts)] += 1
        i += 1
    return parts


def _fixed_rope(rope: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """Rope parameters with multimodal sections / longrope factors resized to a head_dim."""
    ropes = rope.values() if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
    for params in ropes:
        rotary = int(head_dim * params.get("partial_rotary_factor", 1.0))
        if params.get("mrope_section"):
            params["mrope_section"] = _split(rotary // 2, list(params["mrope_section"]))
        for key in ("short_factor", "long_factor"):
            if isinstance(params.get(key), list):
                params[key] = params[key][: rotary // 2]
    return rope


def _token_fields(config: PretrainedConfig) -> dict[str, Any]:
    """The special-token-id fields of one config level (bos/eos/pad, image/video/audio placeholders, ...)."""
    out = {}
    for name, value in _fields(config).items():
        if "vocab" in name:
            continue
        if name.endswith(("token_id", "token_index", "token_ids", "_start_id", "_end_id", "newline_id", "patch_id")):
            out[name] = value
    return out


def _fix_token_ids(config: PretrainedConfig, vocab: int) -> None:
    """Move special token ids that fall outside the tiny vocabulary to its top end (same old id -> same new id)."""
    mapping: dict[int, int] = {}

    def remap(value: Any) -> Any:
        if _is_int(value) and value >= vocab:
            if value not in mapping:
                mapping[value] = vocab - 1 - len(mapping)
            return mapping[value]
        if isinstance(value, (list, tuple)):
            return type(value)(remap(v) for v in value)
        return value

    for cfg in _walk(config):
        for name, value in _token_fields(cfg).items():
            new = remap(value)
            if new != value:
                setattr(cfg, name, new)


def _text_vocab(config: PretrainedConfig) -> int:
    """Vocabulary size of the (decoder) text model."""
    text = config.get_text_config(decoder=True)
    return getattr(text, "vocab_size", None) or VOCAB


# --------------------------------------------------------------------------------------------------------------------
# Per-type overrides and the types a text-only training test cannot run
# --------------------------------------------------------------------------------------------------------------------


def _image_vocabulary_map(num_codes: int, vocab: int = VOCAB) -> dict[str, int]:
    """A Chameleon/Emu3-style BPE <-> VQ-code map: `<image>` and one `IMGIMG<digits as letters>Z` token per code."""
    names = ["IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(code)) + "Z" for code in range(num_codes)]
    base = vocab - 1 - num_codes
    return {"<image>": base, **{name: base + 1 + code for code, name in enumerate(names)}}


_GEMMA4_TEXT = {"global_head_dim": 16}
# the text-only types get the MoE block (the 26B-A4B variant), the multimodal ones stay dense
_GEMMA4_MOE = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 16}
_VQ = {  # VQ-VAE image tokenizers (GroupNorm with 32 groups: channels multiples of 32)
    "embed_dim": 8,
    "latent_channels": 8,
    "base_channels": 32,
    "channel_multiplier": [1, 1],
    "num_res_blocks": 1,
}
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
_DOTS3_TEXT = {  # sizes of the sliding-window (MLA) layers, kwargs of the config
    "head_dim": 16,
    "swa_num_attention_heads": _HEADS,
    "swa_num_key_value_heads": _HEADS,
    "swa_q_lora_rank": 16,
    "swa_kv_lora_rank": 16,
    "swa_head_dim": 16,
    "swa_qk_nope_head_dim": 8,
    "swa_v_head_dim": 8,
}
_QWEN4_EXP_TEXT = {  # the sparse (QSA) indexer sizes have no defaults
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 8,
    "indexer_budget": 4,
    "indexer_compress_ratio": 2,
    "hc_lowrank": 8,
}
_COHERE_COMPASS_TEXT = {  # the default config has no rope parameters per layer type, which the model needs
    "layer_types": ["sliding_attention", "full_attention"],
    "rope_parameters": {"sliding_attention": _MROPE, "full_attention": None},
}

# model_type -> config kwargs (a sub-config key maps to that sub-config's kwargs), applied after the generic ones
_OVERRIDES: dict[str, dict[str, Any]] = {
    # transformers 5.24: the audio tokenizer has no projection around its quantizer (codebook_dim == hidden_size)
    # and its image then audio codebooks sit at the top of the text vocabulary, in that order
    "apertus1p5": {
        "audio_config": {"codebook_dim": 32, "codebook_size": 8},
        "vision_config": {"codebook_size": 8},
        "image_token_id": VOCAB - 20,
        "audio_token_id": VOCAB - 19,
        "image_token_offset": VOCAB - 16,
        "audio_token_offset": VOCAB - 8,
    },
    "bamba": {"attn_layer_indices": [1], "mamba_chunk_size": 8},
    "blip-2": {"image_token_index": VOCAB - 1},  # None by default: the query tokens have no placeholder id
    # use_cache: BltModel builds DynamicCache(config=BltConfig), which has no num_hidden_layers
    "blt": {"encoder_hash_byte_group_vocab": 64, "local_attention_window_len": 8, "use_cache": False},
    "chameleon": {"vocabulary_map": _image_vocabulary_map(16), "vq_config": {**_VQ, "num_embeddings": 16}},
    "cohere_compass": {"text_config": _COHERE_COMPASS_TEXT},
    "cohere_compass_text": _COHERE_COMPASS_TEXT,
    "cpmant": {"position_bias_num_buckets": 32, "position_bias_max_distance": 64},
    # the model reads attn_config.rope_theta, and clamps q/k/v with clip_qkv even when it is None
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "kv_n_heads": 2, "clip_qkv": 8.0}},
    "deepseek_ocr2": {"text_config": {"mlp_layer_types": ["dense", "sparse"]}},
    "doge": {"is_moe": True},  # product-key experts: num_experts must be a square
    "dots1": {"n_shared_experts": 1},
    "dots3_note": {"text_config": _DOTS3_TEXT, "audio_config": {"downsample_hidden_size": 16, "feature_size": 16}},
    "dots3_note_text": _DOTS3_TEXT,
    "emu3": {"vq_config": {**_VQ, "codebook_size": 16, "attn_resolutions": []}},
    "ernie4_5_vl_moe": {"text_config": {"rope_parameters": {**_MROPE, "mrope_section": [1, 1, 2]}}},
    "falcon_h1": {"mamba_chunk_size": 8},
    "florence2": {
        "vision_config": {  # one entry per stage
            "depths": [1, 1],
            "patch_size": [7, 3],
            "patch_stride": [4, 2],
            "patch_padding": [3, 1],
            "patch_prenorm": [False, True],
            "embed_dim": [16, _WIDTH],
            "num_heads": [2, _HEADS],
            "num_groups": [2, _HEADS],
            "window_size": 4,
        }
    },
    "gemma3": {"mm_tokens_per_image": 4},
    "gemma3n_text": {  # every layer type needs an unshared layer before the key/value-sharing suffix
        "num_hidden_layers": 4,
        "intermediate_size": _FFN,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
        "num_kv_shared_layers": 2,
    },
    "gemma4": {"text_config": _GEMMA4_TEXT},
    "gemma4_text": {**_GEMMA4_TEXT, **_GEMMA4_MOE},
    "gemma4_unified": {"text_config": _GEMMA4_TEXT},
    "gemma4_unified_text": {**_GEMMA4_TEXT, **_GEMMA4_MOE},
    "glm46v": {"text_config": {"rope_parameters": _MROPE}},
    "glm4v": {"text_config": {"rope_parameters": _MROPE}},
    "glm4v_moe": {"text_config": {"rope_parameters": {**_MROPE, "partial_rotary_factor": 0.5}}},
    "glm5_next": {"text_config": {"index_kpool": 2}},
    "glm_ocr": {"text_config": {"rope_parameters": _MROPE}},
    "glmga": {"text_config": {"rope_parameters": _MROPE}},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 8},
    "granite4_vision": {
        "vision_config": {"hidden_size": 64},  # the Q-Former gets hidden_size // 64 heads
        "downsample_rate": "1/2",
        "deepstack_layer_map": [[0, 0]],
        "spatial_target_layers": [1],
    },
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"], "mamba_chunk_size": 8},
    "hrm_text": {"num_hidden_layers": 1, "H_cycles": 2, "L_cycles": 1, "L_bp_cycles": [1]},  # layers x cycles
    "hunyuan_vl": {"text_config": {"rope_parameters": {**_MROPE, "mrope_section": [1, 1, 1, 1]}}},
    "inkling2": {"text_config": {"rel_extent": 16}},
    "instructblip": {"image_token_index": VOCAB - 1},
    "instructblipvideo": {"video_token_index": VOCAB - 1},
    "inkling2_text": {"rel_extent": 16},
    "inkling_mm_model": {
        # hierarchical-MLP patch encoder: widths grow with patch_size; >= 4 layers avoids a scipy assignment
        "vision_config": {"patch_size": 4, "n_layers": 4},
        "audio_config": {"mel_vocab_size": 8, "n_mel_bins": 8},
        "text_config": {"rel_extent": 16},
    },
    "inkling_text": {"rel_extent": 16},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "janus": {
        "vision_config": {"num_image_tokens": 16},  # (image_size / patch_size) ** 2
        "vq_config": {**_VQ, "num_embeddings": 16, "image_token_embed_dim": _WIDTH},
    },
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "longcat_flash": {"zero_expert_num": 2},
    "mamba2": {"num_heads": 4, "head_dim": 16, "n_groups": 1, "chunk_size": 8},
    "molmo2": {"adapter_config": {"vision_feature_layer": [-1, -2]}},
    "muse_spark": {  # one entry per stage
        "audio_config": {"hidden_sizes": [16, _WIDTH], "depths": [1, 1], "patch_sizes": [16, 6], "num_hidden_layers": 2}
    },
    "mvp": {"prompt_length": 4, "prompt_mid_dim": 16},
    "nemotron_h": {"n_groups": 1, "chunk_size": 8},
    "nemotron_h_omni": {"text_config": {"n_groups": 1, "chunk_size": 8}, "vision_config": {"max_img_size": 64}},
    "paddleocr_vl": {"text_config": {"rope_parameters": _MROPE}},
    "phi4_multimodal": {
        "audio_config": {
            "num_blocks": 2,
            "ext_pw_out_channel": _WIDTH,
            "depthwise_separable_out_channel": _WIDTH,
            "nemo_conv_channels": _WIDTH,
        }
    },
    "pp_formulanet": {
        "vision_config": {
            "post_conv_in_channels": 16,
            "post_conv_mid_channels": 16,
            "post_conv_out_channels": _WIDTH,
            "decoder_hidden_size": _WIDTH,
        }
    },
    # the thinkers' get_rope_index reads vision_start_token_id, which their configs do not define
    "qwen2_5_omni_thinker": {
        "vision_start_token_id": 151652,
        "text_config": {"rope_parameters": _MROPE},
        "audio_config": {"num_mel_bins": 16},
    },
    "qwen2_5_vl": {"text_config": {"rope_parameters": _MROPE}},
    "qwen2_vl": {"text_config": {"rope_parameters": _MROPE}},
    "qwen3_omni_moe_thinker": {
        "vision_start_token_id": 151652,
        "audio_config": {"num_mel_bins": 16, "downsample_hidden_size": 16},
    },
    "qwen4_exp": {"text_config": _QWEN4_EXP_TEXT},
    "qwen4_exp_text": _QWEN4_EXP_TEXT,
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "reformer": {
        "is_decoder": True,
        "attn_layers": ["local", "lsh"],
        "axial_pos_shape": [3, 4],  # training needs seq_len == prod(axial_pos_shape)
        "axial_pos_embds_dim": [16, 16],
        # chunks longer than the sequences: LSH generation with a chunked prefill fails (einsum rank error), and
        # shorter-than-chunk sequences take the deterministic full-attention path (no random hash rotations)
        "local_attn_chunk_length": 16,
        "lsh_attn_chunk_length": 16,
        "num_buckets": 2,
    },
    "rembert": {"input_embedding_size": 16, "output_embedding_size": _WIDTH},
    "roc_bert": {
        "shape_vocab_size": 32,
        "shape_embed_dim": 8,
        "pronunciation_vocab_size": 32,
        "pronunciation_embed_dim": 8,
    },
    "shieldgemma2": {"mm_tokens_per_image": 4},
    # step3p7 builds a sliding-window mask for every model, so it needs a window
    "step3p7": {"text_config": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}},
    "t5gemma2": {"encoder": {"mm_tokens_per_image": 4}},
    "udop": {"decoder_start_token_id": 0},
    "unlimited_ocr": {"text_config": {"num_key_value_heads": _HEADS}},  # its eager attention does not repeat kv heads
    # q/k/v widths are hidden_size * factor, the state sizes that rounded up to a multiple of 64
    "xlstm": {"qk_dim_factor": 2.0, "v_dim_factor": 2.0},
    "xmod": {"default_language": "en_XX"},
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},  # 2 tied blocks
    "zamba2": {"chunk_size": 8},
    "zaya": {"num_experts_per_tok": 1},  # the only supported value
}

_TIMM = "vision tower is a timm model (TimmWrapperModel): needs the timm package, not shrinkable by config"
_DRAFTER = "speculative-decoding drafter: forward takes the target model's shared KV states, no labels"
_CODEBOOKS = "audio-codebook decoder: input_ids (batch * num_codebooks, seq), labels (batch, seq, num_codebooks)"
EXCLUDED: dict[str, str] = {
    "diffusion_gemma": "block-diffusion model (DiffusionGemmaForBlockDiffusion): no labels, no loss",
    "fast_vlm": _TIMM,
    "gemma3n": _TIMM,
    "gemma4_assistant": _DRAFTER,
    "gemma4_unified_assistant": _DRAFTER,
    "musicgen": _CODEBOOKS,
    "musicgen_melody": _CODEBOOKS,
    "perception_lm": _TIMM,
    "pi0": "vision-language-action policy: forward needs the robot state and actions, flow-matching loss, no labels",
}
NO_GENERATE: dict[str, str] = {}
_PIXELS = "the forward raises without pixel_values (or image embeddings)"
NEEDS_PIXELS: dict[str, str] = {
    **dict.fromkeys(("blip", "blip-2", "idefics", "kosmos-2"), _PIXELS),
    **dict.fromkeys(("instructblip", "instructblipvideo"), "the forward needs pixel_values and qformer_input_ids"),
    **dict.fromkeys(("pix2struct", "pp_formulanet", "vision-encoder-decoder"), "encoder-decoder over the image"),
    "git": "the loss drops the first image_patch_tokens positions, so labels only line up with an image prefix",
    "udop": "document-layout encoder-decoder: the relative position bias needs token bounding boxes (bbox)",
}
# types whose training forward needs each token's modality (all text here) next to the ids
_MM_TOKEN_TYPES = {"molmo2"}

# --------------------------------------------------------------------------------------------------------------------
# Public helpers
# --------------------------------------------------------------------------------------------------------------------


def model_class(model_type: str) -> type:
    """The class that the causal-LM mapping (else the image-text-to-text one) names for `model_type`, resolved like
    the auto classes do: from the transformers namespace (e.g. internlm3 -> LlamaForCausalLM)."""
    name = _CLASS_NAMES[model_type]
    cls = getattr(transformers, name, None)
    if cls is None:
        cls = getattr(importlib.import_module(f"transformers.models.{model_type_to_module_name(model_type)}"), name)
    return cls


def tiny_config(model_type: str) -> PretrainedConfig:
    """A tiny config of `model_type`: its default config shrunk generically, then `_OVERRIDES[model_type]`. For the
    types whose causal-LM class takes the text sub-config (emu3, llama4, ...) this is still the composite config."""
    cls = CONFIG_MAPPING[model_type]
    config = _shrink(cls, cls(), {}, copy.deepcopy(_OVERRIDES.get(model_type, {})))
    _fix_token_ids(config, _text_vocab(config))
    return config


def build_tiny(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random model of `model_type` (eager attention where supported), in float32, deterministic per seed.
    Like AutoModelForCausalLM.from_config, a class that takes a sub-config (emu3, llama4, ...) gets that one."""
    torch.manual_seed(seed)
    config = tiny_config(model_type)
    cls = model_class(model_type)
    if not isinstance(config, cls.config_class):  # as AutoModelForCausalLM.from_config: the class takes a sub-config
        config = next((c for c in _walk(config) if isinstance(c, cls.config_class)), config)
    try:
        model = cls._from_config(config, attn_implementation="eager")
    except ValueError:  # no eager attention
        torch.manual_seed(seed)
        model = cls._from_config(config)
    return model.float()


def special_token_ids(config: PretrainedConfig) -> set[int]:
    """All special token ids (multimodal placeholders, bos/eos/pad, ...) named anywhere in the config tree."""
    ids: set[int] = set()

    def add(value: Any) -> None:
        if _is_int(value):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                add(v)

    for cfg in _walk(config):
        for value in _token_fields(cfg).values():
            add(value)
    return ids


def text_batch(model: torch.nn.Module, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A (2, 12) causal-LM batch of non-special token ids: row 1 right-padded by 3, labels -100 on the padding and on
    a 4-token prompt of row 0. Types in `_MM_TOKEN_TYPES` also get all-zero (text) `mm_token_type_ids`."""
    vocab = _text_vocab(model.config)
    special = special_token_ids(model.config)
    allowed = torch.tensor([i for i in range(vocab) if i not in special])
    input_ids = allowed[torch.randint(0, len(allowed), (2, 12), generator=generator)]
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -3:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[0, :4] = -100
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    if model.config.model_type in _MM_TOKEN_TYPES:  # these need the (all-text) modality of each token when training
        batch["mm_token_type_ids"] = torch.zeros_like(input_ids)
    return batch
