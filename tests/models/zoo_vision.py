"""Tiny image-text-to-text models built from configs (no downloads), and training batches with images.

Every model type here has a config maker and an image maker. The image maker reads only the model's config, the
way the model's processor would: it returns, for each row of the batch, the placeholder tokens the processor would
put into the text for that row's image(s), and the pixel tensors (plus grids, sizes, masks) for all of them.
``vision_batch`` wraps the placeholders in random text, pads row 1 on the right and writes the labels.

Special token ids are remapped into the tiny vocabulary (``VOCAB`` = 128): text tokens are drawn from
``[3, TEXT_HIGH)`` and every special id lives in ``[TEXT_HIGH, VOCAB)``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers
from transformers import AutoConfig, PretrainedConfig
from transformers.image_processing_utils import select_best_resolution
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

VOCAB = 128
TEXT_HIGH = 96  # random text tokens are drawn from [3, TEXT_HIGH)
PAD = 0
# Special ids, all in [TEXT_HIGH, VOCAB).
IMAGE = 100  # the image placeholder token
IMAGE_START = 101  # begin-of-image / vision-start
IMAGE_END = 102  # end-of-image / vision-end
VIDEO = 103
AUDIO = 104
IMAGE_NEWLINE = 105  # row separators (fuyu, idefics3 tiling, ...)
IMAGE_GLOBAL = 106
AUDIO_START = 107
AUDIO_END = 108
EXTRA = 109  # further specials per model: EXTRA, EXTRA + 1, ...

PREFIX = 4  # random text tokens before the image(s)
SUFFIX = 6  # at least this many random text tokens after the image(s)
ROW1_PAD = 2

_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
    pad_token_id=PAD,
    bos_token_id=1,
    eos_token_id=2,
    attention_dropout=0.0,
)
_MOE = dict(output_router_logits=True, router_aux_loss_coef=0.1, num_experts_per_tok=2)
_VISION = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=16,
    patch_size=4,
    attention_dropout=0.0,
)


@dataclass
class Images:
    """What the processor would produce for the images of a batch.

    ``runs[r]`` is the placeholder token run for row ``r`` (all its images), ``inputs`` the model kwargs for the pixels
    of all rows. ``extras`` makes further kwargs from the final ``input_ids``/``attention_mask`` (token type ids,
    cross-attention masks, ...).
    """

    runs: list[list[int]]
    inputs: dict[str, torch.Tensor]
    extras: Callable[[torch.Tensor, torch.Tensor], dict] | None = None
    prefix: int = PREFIX  # random text tokens before the run (0: the images open the sequence)


def _type_ids(name: str, image_token: int) -> Callable[[torch.Tensor, torch.Tensor], dict]:
    """``extras`` giving ``{name: 1 on the image tokens, 0 elsewhere}`` (token_type_ids, mm_token_type_ids)."""

    def make(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
        return {name: (input_ids == image_token).long()}

    return make


def _rand_pixels(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator)


# ----------------------------------------------------------------------------------------------------------------
# gemma3 / shieldgemma2: SigLIP tower, average-pooled to mm_tokens_per_image, boi + image * n + eoi, token_type_ids.


def _gemma3_config(model_type: str = "gemma3") -> PretrainedConfig:
    text = dict(_TEXT, sliding_window=8, final_logit_softcapping=2.0, query_pre_attn_scalar=8)
    return AutoConfig.for_model(
        model_type,
        text_config=text,
        vision_config=dict(_VISION, vision_use_head=False),
        mm_tokens_per_image=4,
        image_token_index=IMAGE,
        boi_token_index=IMAGE_START,
        eoi_token_index=IMAGE_END,
    )


def _gemma3_images(cfg: PretrainedConfig, g: torch.Generator, rows: int) -> Images:
    vision = cfg.vision_config
    run = [cfg.boi_token_index] + [cfg.image_token_index] * cfg.mm_tokens_per_image + [cfg.eoi_token_index]
    pixels = _rand_pixels(g, rows, vision.num_channels, vision.image_size, vision.image_size)
    return Images(
        [run] * rows,
        {"pixel_values": pixels},
        _type_ids("token_type_ids", cfg.image_token_index),
    )


# ----------------------------------------------------------------------------------------------------------------
# gemma4: patchified pixels [images, max_patches, 3 * p * p] in [0, 1] plus (x, y) patch positions, (-1, -1) = padding;
# the tower average-pools k x k patches into one soft token. Row 1's image is half as tall (padded patches).


def _gemma4_config() -> PretrainedConfig:
    text = dict(
        _TEXT,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB,
        global_head_dim=16,
        use_bidirectional_attention="vision",
        final_logit_softcapping=2.0,
    )
    vision = dict(_VISION, num_key_value_heads=2, head_dim=8, pooling_kernel_size=2, position_embedding_size=64)
    vision.pop("image_size")
    return AutoConfig.for_model(
        "gemma4",
        text_config=text,
        vision_config=vision,
        audio_config=None,
        image_token_id=IMAGE,
        boi_token_id=IMAGE_START,
        eoi_token_id=IMAGE_END,
        video_token_id=VIDEO,
        audio_token_id=AUDIO,
        boa_token_id=AUDIO_START,
        eoa_token_index=AUDIO_END,
    )


def _gemma4_images(cfg: PretrainedConfig, g: torch.Generator, rows: int) -> Images:
    vision = cfg.vision_config
    if cfg.model_type == "gemma4_unified":  # encoder-free: one soft token per merged (model) patch
        p, k = vision.model_patch_size, 1
        sizes = [(2, 2), (1, 2)]
    else:
        p, k = vision.patch_size, vision.pooling_kernel_size
        sizes = [(4, 4), (2, 4)]  # (patch rows, patch cols) per image
    max_patches = max(h * w for h, w in sizes)
    pixels = torch.zeros(rows, max_patches, 3 * p * p)
    positions = torch.full((rows, max_patches, 2), -1, dtype=torch.long)
    runs = []
    for r in range(rows):
        h, w = sizes[r % len(sizes)]
        pixels[r, : h * w] = torch.rand(h * w, 3 * p * p, generator=g)
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        positions[r, : h * w] = torch.stack([xs.flatten(), ys.flatten()], dim=-1)
        runs.append([cfg.boi_token_id] + [cfg.image_token_id] * (h * w // (k * k)) + [cfg.eoi_token_id])
    return Images(
        runs,
        {"pixel_values": pixels, "image_position_ids": positions},
        _type_ids("mm_token_type_ids", cfg.image_token_id),
    )


def _gemma4_unified_config() -> PretrainedConfig:
    text = dict(
        _TEXT,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        global_head_dim=16,
        final_logit_softcapping=2.0,
    )
    vision = dict(patch_size=4, pooling_kernel_size=2, mm_embed_dim=16, mm_posemb_size=8, output_proj_dims=16)
    return AutoConfig.for_model(
        "gemma4_unified",
        text_config=text,
        vision_config=vision,
        audio_config=None,
        image_token_id=IMAGE,
        boi_token_id=IMAGE_START,
        eoi_token_id=IMAGE_END,
        video_token_id=VIDEO,
        audio_token_id=AUDIO,
        boa_token_id=AUDIO_START,
        eoa_token_index=AUDIO_END,
    )


# ----------------------------------------------------------------------------------------------------------------
# llama4: one tile per image [images, C, H, W]; pixel shuffle by ratio r keeps (H/p * W/p) * r^2 tokens per tile.
# Run: <|image_start|> <|image|> <|patch|> * n <|image_end|>; the model's image token is <|patch|>.


def _llama4_config() -> PretrainedConfig:
    text = dict(
        _TEXT,
        intermediate_size=32,
        intermediate_size_mlp=64,
        num_local_experts=4,
        interleave_moe_layer_step=2,
        no_rope_layer_interval=2,
        attention_chunk_size=8,
        **_MOE,
    )
    vision = dict(
        _VISION,
        intermediate_size=64,  # hidden / pixel_shuffle_ratio**2
        vision_output_dim=32,
        projector_input_dim=32,
        projector_output_dim=32,
        pixel_shuffle_ratio=0.5,
    )
    return AutoConfig.for_model(
        "llama4",
        text_config=text,
        vision_config=vision,
        image_token_index=IMAGE,
        boi_token_index=IMAGE_START,
        eoi_token_index=IMAGE_END,
    )


def _llama4_images(cfg: PretrainedConfig, g: torch.Generator, rows: int) -> Images:
    vision = cfg.vision_config
    side = vision.image_size // vision.patch_size
    n = round(side * side * vision.pixel_shuffle_ratio**2)
    run = [cfg.boi_token_index, EXTRA] + [cfg.image_token_index] * n + [cfg.eoi_token_index]
    pixels = _rand_pixels(g, rows, vision.num_channels, vision.image_size, vision.image_size)
    return Images([run] * rows, {"pixel_values": pixels})


# ----------------------------------------------------------------------------------------------------------------
# mllama: cross-attention to tiles. pixel_values [batch, images, max_tiles, C, H, W], aspect_ratio_ids (1-based index
# into supported_aspect_ratios), aspect_ratio_mask [batch, images, max_tiles], and cross_attention_mask
# [batch, seq, images, max_tiles]: every token from the <|image|> token on attends to the image's real tiles.
# Row 0 has a 1x2-tile image, row 1 a single tile.


def _mllama_config() -> PretrainedConfig:
    text = dict(_TEXT, num_hidden_layers=3, cross_attention_layers=[1], rope_parameters=None)
    text.pop("head_dim")
    vision = dict(
        _VISION,
        attention_heads=2,
        num_global_layers=1,
        vision_output_dim=32,  # hidden * (1 + len(intermediate_layers_indices))
        intermediate_layers_indices=[0],
        max_num_tiles=2,
        supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]],
    )
    vision.pop("num_attention_heads")
    vision.pop("attention_dropout")
    return AutoConfig.for_model("mllama", text_config=text, vision_config=vision, image_token_index=IMAGE)


def _mllama_images(cfg: PretrainedConfig, g: torch.Generator, rows: int) -> Images:
    vision = cfg.vision_config
    tiles = vision.max_num_tiles
    ratios = [[1, 2], [1, 1]]
    pixels = torch.zeros(rows, 1, tiles, vision.num_channels, vision.image_size, vision.image_size)
    ratio_ids = torch.zeros(rows, 1, dtype=torch.long)
    ratio_mask = torch.zeros(rows, 1, tiles, dtype=torch.long)
    num_tiles = []
    for r in range(rows):
        ratio = ratios[r % len(ratios)]
        n = ratio[0] * ratio[1]
        num_tiles.append(n)
        pixels[r, 0, :n] = _rand_pixels(g, n, vision.num_channels, vision.image_size, vision.image_size)
        ratio_ids[r, 0] = vision.supported_aspect_ratios.index(ratio) + 1
        ratio_mask[r, 0, :n] = 1

    def extras(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
        cross = torch.zeros(*input_ids.shape, 1, tiles, dtype=torch.long)
        for r in range(input_ids.shape[0]):
            start = int((input_ids[r] == cfg.image_token_index).nonzero()[0])
            cross[r, start:, 0, : num_tiles[r]] = 1
        return {"cross_attention_mask": cross}

    return Images(
        [[cfg.image_token_index]] * rows,
        {"pixel_values": pixels, "aspect_ratio_ids": ratio_ids, "aspect_ratio_mask": ratio_mask},
        extras,
    )


# ----------------------------------------------------------------------------------------------------------------
# mistral3: Pixtral tower on images padded to one size, image_sizes [images, 2] the real (H, W); each row of merged
# patches is [IMG] * width + [IMG_BREAK], the last [IMG_BREAK] becomes [IMG_END]. Row 1's image is half as wide.


def _mistral3_config() -> PretrainedConfig:
    vision = dict(_VISION, head_dim=8)
    return AutoConfig.for_model(
        "mistral3",
        text_config=dict(_TEXT, sliding_window=None),
        vision_config=vision,
        image_token_index=IMAGE,
        spatial_merge_size=2,
    )


def _lighton_ocr_config() -> PretrainedConfig:
    vision = dict(_VISION, head_dim=8)
    return AutoConfig.for_model(
        "lighton_ocr",
        text_config=dict(_TEXT, model_type="qwen3"),
        vision_config=vision,
        image_token_id=IMAGE,
        spatial_merge_size=2,
    )


def _mistral_large4_config() -> PretrainedConfig:
    # MLA attention with a sparse top-k indexer, MoE after a first dense layer
    text = dict(
        _TEXT,
        moe_intermediate_size=16,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        num_key_value_heads=4,
        head_dim=4,  # the rotary part of the query/key heads
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        index_topk=8,
        index_head_dim=8,
        index_n_heads=2,
        first_k_dense_replace=1,
        final_logit_softcapping=2.0,
    )
    return AutoConfig.for_model(
        "mistral_large4",
        text_config=text,
        vision_config=dict(_VISION, head_dim=8),
        image_token_index=IMAGE,
        spatial_merge_size=2,
    )


def _pixtral_run(image: int, brk: int, end: int, h: int, w: int) -> list[int]:
    run = ([image] * w + [brk]) * h
    run[-1] = end
    return run


def _mistral3_images(cfg: PretrainedConfig, g: torch.Generator, rows: int) -> Images:
    vision = cfg.vision_config
    size = vision.image_size
    step = vision.patch_size * cfg.spatial_merge_size
    sizes = [(size, size), (size, size // 2)]
    pixels = torch.zeros(rows, vision.num_channels, size, size)
    runs = []
    for r in range(rows):
        h, w = sizes[r % len(sizes)]
        pixels[r, :, :h, :w] = _rand_pixels(g, vision.num_channels, h, w)
        runs.append(_pixtral_run(cfg.image_token_id, IMAGE_NEWLINE, IMAGE_END, h // step, w // step))
    image_sizes = torch.tensor([sizes[r % len(sizes)] for r in range(rows)])
    return Images(runs, {"pixel_values": pixels, "image_sizes": image_sizes})


# ----------------------------------------------------------------------------------------------------------------
# Qwen-VL family: flattened patches [sum(t * h * w), C * temporal_patch * p * p] with image_grid_thw [images, 3];
# the merger folds merge x merge patches into one token: t * h * w / merge**2 tokens per image, wrapped in
# <|vision_start|> ... <|vision_end|>; mm_token_type_ids (1 = image) drive the 3-D M-RoPE positions.
# Row 0 has a 16x16 image, row 1 an 8x16 one.

_QWEN_IDS = dict(
    image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=IMAGE_START, vision_end_token_id=IMAGE_END
)
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}  # sums to head_dim / 2 = 4
_QWEN_VISION = dict(depth=1, num_heads=2, patch_size=4, spatial_merge_size=2, temporal_patch_size=2)


def _qwen2_vl_config() -> PretrainedConfig:
    text = dict(_TEXT, rope_parameters=dict(_MROPE))
    text.pop("head_dim")
    vision = dict(_QWEN_VISION, embed_dim=16, hidden_size=32, mlp_ratio=2)
    return AutoConfig.for_model("qwen2_vl", text_config=text, vision_config=vision, **_QWEN_IDS)


def _qwen2_5_vl_config() -> PretrainedConfig:
    text = dict(_TEXT, rope_parameters=dict(_MROPE))
    text.pop("head_dim")
    vision = dict(
        _QWEN_VISION, hidden_size=16, intermediate_size=32, out_hidden_size=32, window_size=8, fullatt_block_indexes=[]
    )
    return AutoConfig.for_model("qwen2_5_vl", text_config=text, vision_config=vision, **_QWEN_IDS)


def _qwen3_vl_vision() -> dict:
    # num_position_embeddings: a 4x4 grid of learned positions, interpolated to each image's patch grid
    return dict(
        _QWEN_VISION,
        hidden_size=16,
        intermediate_size=32,
        out_hidden_size=32,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0],
    )


def _qwen3_vl_config() -> PretrainedConfig:
    text = dict(_TEXT, rope_parameters=dict(_MROPE, mrope_interleaved=True))
    return AutoConfig.for_model("qwen3_vl", text_config=text, vision_config=_qwen3_vl_vision(), **_QWEN_IDS)


def _qwen3_vl_moe_config() -> PretrainedConfig:
    text = dict(
        _TEXT,
        rope_parameters=dict(_MROPE, mrope_interleaved=True),
        num_experts=4,
        moe_intermediate_size=16,
        decoder_sparse_step=1,
        **_MOE,
    )
    return AutoConfig.for_model("qwen3_vl_moe", text_config=text, vision_config=_qwen3_vl_vision(), **_QWEN_IDS)


def _qwen3_5_text() -> dict:
    # one Gated DeltaNet layer, one full-attention layer; rotary over half of head_dim 16 = 8 dims -> sections sum 4
    return dict(
        _TEXT,
        head_dim=16,
        partial_rotary_factor=0.5,
        rope_parameters=dict(_MROPE, mrope_interleaved=True, partial_rotary_factor=0.5),
        layer_types=["linear_attention", "full_attention"],
        linear_conv_kernel_dim=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    )


def _qwen3_5_vision() -> dict:
    vision = _qwen3_vl_vision()
    vision.pop("deepstack_visual_indexes")
    return vision


def _qwen3_5_config() -> PretrainedConfig:
    return AutoConfig.for_model("qwen3_5", text_config=_qwen3_5_text(), vision_config=_qwen3_5_vision(), **_QWEN_IDS)


def _qwen3_5_moe_config() -> PretrainedConfig:
    text = dict(_qwen3_5_text(), num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=32, **_MOE)
    return AutoConfig.for_model("qwen3_5_moe", text_config=text, vision_config=_qwen3_5_vision(), **_QWEN_IDS)


# How the Qwen-VL-like towers take their patches, where it differs from their config (temporal_patch_size or not).
_PATCH_LAYOUT = {"kimi_k25": "image", "hunyuan_vl": "flat", "cosmos3_edge": "flat"}


def _merge_size(vision: PretrainedConfig) -> int:
    for name in ("spatial_merge_size", "merge_size"):
        if isinstance(getattr(vision, name, None), int):
            return getattr(vision, name)
    return vision.merge_kernel_size[0]


def _takes(model_type: str, name: str) -> bool:
    """Whether the forward of ``model_type``'s image-text-to-text class has a parameter ``name``."""
    return name in inspect.signature(_model_class(model_type).forward).parameters


def _qwen_like_config(model_type: str, text: dict, vision: dict | None = None, **kwargs) -> PretrainedConfig:
    """A Qwen-VL-style model: the shared vision sizes (unknown keys are ignored by the configs) and token ids."""
    vision = dict(
        _QWEN_VISION,
        hidden_size=16,
        intermediate_size=32,
        out_hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0],
        image_size=16,
        window_size=8,
        fullatt_block_indexes=[0],
    ) | (vision or {})
    vision = {k: v for k, v in vision.items() if v is not None}  # None: leave the key out
    ids = dict(_QWEN_IDS) | kwargs
    return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, **ids)


def _cosmos3_omni_config() -> PretrainedConfig:
    return _qwen_like_config("cosmos3_omni", dict(_TEXT, rope_parameters=dict(_MROPE, mrope_interleaved=True)))


def _cohere_compass_config() -> PretrainedConfig:
    text = _cohere_text()  # RoPE parameters per layer type
    text["rope_parameters"] = {kind: dict(_MROPE, mrope_interleaved=True) for kind in text["layer_types"]}
    return _qwen_like_config("cohere_compass", text)


def _paddleocr_vl_config() -> PretrainedConfig:
    # no temporal patches: the patches stay images [patches, C, p, p]
    vision = {"temporal_patch_size": None}
    return _qwen_like_config("paddleocr_vl", dict(_TEXT, rope_parameters=dict(_MROPE)), vision)


def _exaone4_5_config() -> PretrainedConfig:
    text = dict(_TEXT, model_type="exaone4", sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    text["rope_parameters"] = dict(_MROPE)
    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO)
    return AutoConfig.for_model(
        "exaone4_5",
        text_config=text,
        vision_config=dict(
            _QWEN_VISION,
            hidden_size=16,
            intermediate_size=32,
            out_hidden_size=32,
            num_key_value_heads=2,
            window_size=8,
            fullatt_block_indexes=[0],
        ),
        **ids,
    )


def _hyperclovax_vision_v2_config() -> PretrainedConfig:
    text = dict(_TEXT, rope_parameters=dict(_MROPE))
    vision = dict(
        _QWEN_VISION, hidden_size=16, intermediate_size=32, out_hidden_size=32, window_size=8, fullatt_block_indexes=[0]
    )
    return AutoConfig.for_model(
        "hyperclovax_vision_v2", text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO
    )


def _qwen4_exp_config() -> PretrainedConfig:
    text = dict(
        _qwen3_5_text(),
        num_experts=4,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        hc_count=2,  # hyper-connections
        hc_lowrank=8,
        indexer_n_heads=2,  # QSA token indexer on the full-attention layer
        indexer_kv_heads=1,
        indexer_head_dim=8,
        indexer_budget=8,
        indexer_compress_ratio=2,
        ple_layer_ids=[1],  # n-gram per-layer embeddings on the linear-attention layer
        ple_embed_dim=8,
        ngram_vocab_size_base=256,
        make_ngram_vocab_size_divisible_by=8,
        heads_per_ngram=2,
        split_ngram_parts=2,
        **_MOE,
    )
    return _qwen_like_config("qwen4_exp", text, _qwen3_5_vision())


def _cosmos3_edge_config() -> PretrainedConfig:
    text = dict(_TEXT, rope_parameters=dict(_MROPE), hidden_act="relu2")
    vision = dict(_VISION, num_patches=16, spatial_merge_size=2)
    vision.pop("image_size")
    return AutoConfig.for_model(
        "cosmos3_edge", text_config=text, vision_config=vision, projector_hidden_size=32, **_QWEN_IDS
    )


def _video_llama_3_config() -> PretrainedConfig:
    text = dict(_TEXT, model_type="qwen2")
    text.pop("head_dim")
    vision = dict(_VISION)
    vision.pop("image_size")
    return AutoConfig.for_model(
        "video_llama_3", text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO
    )


def _video_llama_3_images(cfg: PretrainedConfig, g: torch.Generator, rows: int) -> Images:
    vision = cfg.vision_config
    merge = 2  # the processor's merge size for images
    grids = [(1, 4, 4), (1, 2, 4)]
    grid = torch.tensor([grids[r % len(grids)] for r in range(rows)])
    pixels = _rand_pixels(g, int(grid.prod(-1).sum()), vision.num_channels * vision.patch_size**2)
    runs = [[cfg.image_token_id] * (int(t.prod()) // merge**2) for t in grid]
    merges = torch.full((rows,), merge, dtype=torch.long)
    return Images(runs, {"pixel_values": pixels, "image_grid_thw": grid, "image_merge_sizes": merges})


def _kimi_k25_config() -> PretrainedConfig:
    text = dict(
        _TEXT,
        model_type="deepseek_v3",
        num_key_value_heads=4,
        head_dim=4,
        moe_intermediate_size=16,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
    )
    vision = dict(
        _VISION, pos_emb_height=4, pos_emb_width=4, pos_emb_time=1, merge_kernel_size=[2, 2], num_hidden_layers=1
    )
    vision.pop("image_size")
    return AutoConfig.for_model(
        "kimi_k25",
        text_config=text,
        vision_config=vision,
        projection_hidden_size=16,  # the vision hidden size
        **_QWEN_IDS,
    )


def _muse_glimmer_config() -> PretrainedConfig:
    text = _cohere_text()
    text.pop("logit_scale")
    vision = dict(
        _VISION, pos_emb_height=4, pos_emb_width=4, patch_temporal=2, merge_size=2, layer_types=["full_attention"]
    )
    vision.pop("image_size")
    return AutoConfig.for_model(
        "muse_glimmer",
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        out_hidden_size=64,  # vision hidden * merge**2
        projector_hidden_size=32,
    )


def _hunyuan_vl_config() -> PretrainedConfig:
    text = dict(_TEXT, rope_parameters=dict(_MROPE))
    vision = dict(
        _VISION,
        num_key_value_heads=2,
        out_hidden_size=32,
        text_hidden_size=32,
        spatial_merge_size=2,
        temporal_patch_size=1,
        max_image_size=16,
        min_image_size=8,
    )
    return AutoConfig.for_model(
        "hunyuan_vl",
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        im_start_id=IMAGE_START,
        im_end_id=IMAGE_END,
        im_newline_id=IMAGE_NEWLINE,
    )


def _hunyuan_vl_images(cfg: PretrainedConfig, g: torch.Generator, rows: int) -> Images:
    # the features include a row separator per merged row and the image boundaries: h * (w + 1) + 2 image tokens
    images = _qwen_images(cfg, g, rows)
    merge = cfg.vision_config.spatial_merge_size
    runs = []
    for _, h, w in images.inputs["image_grid_thw"].tolist():
        runs.append([cfg.image_token_id] * ((h // merge) * (w // merge + 1) + 2))
    return Images(runs, images.inputs, images.extras)


def _qwen_images(cfg: PretrainedConfig, g: torch.Generator, rows: int) -> Images:
    vision = cfg.vision_config
    p, merge = vision.patch_size, _merge_size(vision)
    tp = getattr(vision, "temporal_patch_size", None) or getattr(vision, "patch_temporal", None)
    channels = getattr(vision, "in_channels", getattr(vision, "num_channels", 3))
    grids = [(1, 4, 4), (1, 2, 4)]
    grid = torch.tensor([grids[r % len(grids)] for r in range(rows)])
    n_patches = int(grid.prod(-1).sum())
    layout = _PATCH_LAYOUT.get(cfg.model_type, "image" if tp is None else "flat")
    if layout == "image":  # patches as images [patches, C, p, p]
        pixels = _rand_pixels(g, n_patches, channels, p, p)
    else:  # flattened [patches, C * (temporal) * p * p]
        pixels = _rand_pixels(g, n_patches, channels * (tp or 1) * p * p)
    image = getattr(cfg, "image_token_id", None) or cfg.image_token_index
    start = getattr(cfg, "vision_start_token_id", None) or getattr(cfg, "image_start_token_id", None) or IMAGE_START
    end = getattr(cfg, "vision_end_token_id", None) or getattr(cfg, "image_end_token_id", None) or IMAGE_END
    runs = [[start] + [image] * (int(t.prod()) // merge**2) + [end] for t in grid]
    extras = _type_ids("mm_token_type_ids", image) if _takes(cfg.model_type, "mm_token_type_ids") else None
    return Images(runs, {"pixel_values": pixels, "image_grid_thw": grid}, extras)


# ----------------------------------------------------------------------------------------------------------------
# paligemma: SigLIP, (image_size / patch)**2 tokens first, then <bos> prompt "\n" suffix; token_type_ids 0 on the
# prefix (image + prompt: bidirectional attention) and 1 on the suffix.


def _paligemma_config() -> PretrainedConfig:
    text = dict(_TEXT, model_type="gemma2", sliding_window=8, final_logit_softcapping=2.0, query_pre_attn_scalar=8)
    return AutoConfig.for_model(
        "paligemma",
        text_config=text,
        vision_config=dict(_VISION, vision_use_head=False),
        image_token_index=IMAGE,
        vocab_size=VOCAB,
        projection_dim=32,
        hidden_size=32,
    )


def _paligemma_images(cfg: PretrainedConfig, g: torch.Generator, rows: int) -> Images:
    vision = cfg.vision_config
    n = (vision.image_size // vision.patch_size) ** 2
    run = [cfg.image_token_index] * n + [cfg.text_config.bos_token_id]
    pixels = _rand_pixels(g, rows, vision.num_channels, vision.image_size, vision.image_size)

    def extras(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
        token_type_ids = torch.ones_like(input_ids)
        token_type_ids[:, : len(run) + 3] = 0  # image, <bos> and a 3-token prompt
        return {"token_type_ids": token_type_ids}

    return Images([run] * rows, {"pixel_values": pixels}, extras, prefix=0)


# ----------------------------------------------------------------------------------------------------------------
# llava: CLIP tower, (image_size / patch)**2 tokens per image with the "default" strategy (CLS dropped).


def _llava_config(model_type: str = "llava", patch_size: int = 4, **kwargs) -> PretrainedConfig:
    text = dict(_TEXT)
    text.pop("head_dim")
    vision = dict(_VISION, model_type="clip_vision_model", projection_dim=32, patch_size=patch_size)
    kwargs = dict(vision_feature_layer=-1, vision_feature_select_strategy="default") | kwargs  # -1: -2 would skip
    return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, image_token_index=IMAGE, **kwargs)


def _llava_images(cfg: PretrainedConfig, g: torch.Generator, rows: int) -> Images:
    vision = cfg.vision_config
    # vipllava always drops the CLS token
    n = (vision.image_size // vision.patch_size) ** 2 + (getattr(cfg, "vision_feature_select_strategy", "") == "full")
    pixels = _rand_pixels(g, rows, vision.num_channels, vision.image_size, vision.image_size)
    return Images([[cfg.image_token_index] * n] * rows, {"pixel_values": pixels})


# ----------------------------------------------------------------------------------------------------------------
# llava_next / llava_onevision ("anyres"): the image is resized to the best of image_grid_pinpoints and cut into tiles
# of image_size, plus one base tile of the whole image: pixel_values [images, 1 + tiles (padded), C, size, size] and
# image_sizes [images, 2] (the original (H, W)). Tokens: the base tile's patches + the unpadded tile grid + one
# image_newline per grid row. Row 0: a 16x16 image (1 tile), row 1: 16x32 (2 tiles).

_PINPOINTS = [[16, 16], [16, 32], [32, 16], [32, 32]]


def _anyres_grid(cfg: PretrainedConfig, orig: tuple[int, int]) -> tuple[int, int]:
    size = cfg.vision_config.image_size
    best_h, best_w = select_best_resolution(orig, cfg.image_grid_pinpoints)
    return best_h // size, best_w // size


def _anyres_tokens(cfg: PretrainedConfig, orig: tuple[int, int], max_patches: int | None = None) -> int:
    """The LLaVA-NeXT processor's ``_get_number_of_features`` (without the CLS token)."""
    vision = cfg.vision_config
    side = vision.image_size // vision.patch_size
    grid_h, grid_w = _anyres_grid(cfg, orig)
    height, width = orig
    cur_h, cur_w = side * grid_h, side * grid_w
    if width / height > cur_w / cur_h:
        new_h = int(round(height * (cur_w / width), 7))
        cur_h -= (cur_h - new_h) // 2 * 2
    else:
        new_w = int(round(width * (cur_h / height), 7))
        cur_w -= (cur_w - new_w) // 2 * 2
    unpadded, newlines = cur_h * cur_w, cur_h
    if max_patches is not None:
        ratio = math.sqrt(cur_h * cur_w / (max_patches * side**2))
        if ratio > 1.1:
            unpadded, newlines = int(cur_h // ratio) * int(cur_w // ratio), int(cur_h // ratio)
    return side * side + unpadded + newlines


def _llava_next_config(model_type: str = "llava_next", **kwargs) -> PretrainedConfig:
    return _llava_config(model_type, patch_size=8, image_grid_pinpoints=_PINPOINTS, **kwargs)


def _llava_onevision_config() -> PretrainedConfig:
    text = dict(_TEXT)
    text.pop("head_dim")
    return AutoConfig.for_model(
        "llava_onevision",
        text_config=dict(text, model_type="qwen2"),
        vision_config=dict(_VISION, model_type="siglip_vision_model", patch_size=8, vision_use_head=False),
        image_token_index=IMAGE,
        video_token_index=VIDEO,
        vision_feature_layer=-1,
        image_grid_pinpoints=_PINPOINTS,
        vision_aspect_ratio="anyres_max_1",  # row 1's two tiles are pooled down to one tile's worth
    )


def _anyres_images(cfg: PretrainedConfig, g: torch.Generator, rows: int) -> Images:
    vision = cfg.vision_config
    size = vision.image_size
    max_patches = None
    if cfg.model_type == "llava_onevision":
        max_patches = int(cfg.vision_aspect_ratio.removeprefix("anyres_max_"))
    origs = [(size, size), (size, 2 * size)]
    tiles = [1 + math.prod(_anyres_grid(cfg, origs[r % 2])) for r in range(rows)]
    pixels = torch.zeros(rows, max(tiles), vision.num_channels, size, size)
    runs = []
    for r in range(rows):
        pixels[r, : tiles[r]] = _rand_pixels(g, tiles[r], vision.num_channels, size, size)
        runs.append([cfg.image_token_index] * _anyres_tokens(cfg, origs[r % 2], max_patches))
    image_sizes = torch.tensor([origs[r % 2] for r in range(rows)])
    return Images(runs, {"pixel_values": pixels, "image_sizes": image_sizes})


# ----------------------------------------------------------------------------------------------------------------
# idefics3 / smolvlm: pixel_values [batch, images, C, H, W] with all-zero padding images, pixel_attention_mask
# [batch, images, H, W]; (H/p * W/p) / scale_factor**2 tokens per image. Row 0 is split into a 1x2 grid of tiles plus
# the global image (3 images); row 1 is a single global image.


def _idefics3_config(model_type: str = "idefics3") -> PretrainedConfig:
    text = dict(_TEXT)
    text.pop("head_dim")
    return AutoConfig.for_model(
        model_type, text_config=text, vision_config=dict(_VISION), image_token_id=IMAGE, scale_factor=2
    )


def _idefics3_images(cfg: PretrainedConfig, g: torch.Generator, rows: int) -> Images:
    vision = cfg.vision_config
    size = vision.image_size
    seq = (size // vision.patch_size) ** 2 // cfg.scale_factor**2
    image, fake, glob = cfg.image_token_id, EXTRA, IMAGE_GLOBAL
    grids = [(1, 2), (0, 0)]  # (rows, cols) of tiles; (0, 0): not split
    counts = [h * w + 1 for h, w in (grids[r % 2] for r in range(rows))]
    pixels = torch.zeros(rows, max(counts), vision.num_channels, size, size)
    mask = torch.zeros(rows, max(counts), size, size, dtype=torch.bool)
    runs = []
    for r in range(rows):
        n_h, n_w = grids[r % 2]
        pixels[r, : counts[r]] = _rand_pixels(g, counts[r], vision.num_channels, size, size)
        mask[r, : counts[r]] = True
        run = []
        for i in range(n_h):
            for j in range(n_w):
                run += [fake, EXTRA + 1 + 6 * i + j] + [image] * seq  # <row_i_col_j>
            run.append(IMAGE_NEWLINE)
        run += ([IMAGE_NEWLINE] if n_h else []) + [fake, glob] + [image] * seq + [fake]
        runs.append(run)
    return Images(runs, {"pixel_values": pixels, "pixel_attention_mask": mask})


# ----------------------------------------------------------------------------------------------------------------
# internvl: crops flattened to [sum(crops), C, H, W]; each crop gives (H/p * W/p) * downsample_ratio**2 tokens,
# wrapped in <img> ... </img>. Row 0: 2 crops (a tile and the thumbnail), row 1: 1 crop.


def _internvl_config(model_type: str = "internvl") -> PretrainedConfig:
    text = dict(_TEXT, model_type="qwen2" if model_type == "internvl" else "qwen3")
    if model_type == "internvl":
        text.pop("head_dim")
    vision = dict(_VISION, image_size=[16, 16], patch_size=[4, 4], drop_path_rate=0.0)
    return AutoConfig.for_model(
        model_type,
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        image_seq_length=4,
        downsample_ratio=0.5,
    )


def _internvl_images(cfg: PretrainedConfig, g: torch.Generator, rows: int) -> Images:
    vision = cfg.vision_config
    (height, width), (ph, pw) = vision.image_size, vision.patch_size
    per_crop = round((height // ph) * (width // pw) * cfg.downsample_ratio**2)
    crops = [2 - r % 2 for r in range(rows)]
    pixels = _rand_pixels(g, sum(crops), vision.num_channels, height, width)
    runs = [[IMAGE_START] + [cfg.image_token_id] * (per_crop * n) + [IMAGE_END] for n in crops]
    return Images(runs, {"pixel_values": pixels})


# ----------------------------------------------------------------------------------------------------------------
# aya_vision / cohere2_vision: SigLIP tiles [sum(tiles), C, H, W], pixel-shuffled by downsample_factor:
# (H / p / downsample)**2 tokens per tile. Row 0: 2 tiles (a tile and the global thumbnail), row 1: 1.


def _cohere_text() -> dict:
    return dict(_TEXT, sliding_window=8, layer_types=["sliding_attention", "full_attention"], logit_scale=0.25)


def _aya_vision_config() -> PretrainedConfig:
    vision = dict(_VISION, model_type="siglip_vision_model", vision_use_head=False)
    return AutoConfig.for_model(
        "aya_vision",
        text_config=dict(_cohere_text(), model_type="cohere2"),
        vision_config=vision,
        image_token_index=IMAGE,
        downsample_factor=2,
        alignment_intermediate_size=64,
    )


def _cohere2_vision_config() -> PretrainedConfig:
    vision = dict(_VISION, model_type="siglip_vision_model", vision_use_head=False)
    return AutoConfig.for_model(
        "cohere2_vision",
        text_config=dict(_cohere_text(), model_type="cohere2"),
        vision_config=vision,
        image_token_id=IMAGE,
        downsample_factor=2,
        alignment_intermediate_size=64,
    )


def _tiles_images(cfg: PretrainedConfig, g: torch.Generator, rows: int) -> Images:
    vision = cfg.vision_config
    per_tile = (vision.image_size // vision.patch_size // cfg.downsample_factor) ** 2
    tiles = [2 - r % 2 for r in range(rows)]
    pixels = _rand_pixels(g, sum(tiles), vision.num_channels, vision.image_size, vision.image_size)
    runs = []
    for n in tiles:
        if cfg.model_type == "aya_vision":  # <|START_OF_IMG|> (<TILE_i> patch*k)* <TILE_GLOBAL> patch*k <|END_OF_IMG|>
            run = [IMAGE_START]
            for i in range(1, n):
                run += [EXTRA + i] + [cfg.image_token_index] * per_tile
            run += [IMAGE_GLOBAL] + [cfg.image_token_index] * per_tile + [IMAGE_END]
        else:  # <boi> (image*k <line_break>)* <eoi>
            run = [IMAGE_START] + ([cfg.image_token_id] * per_tile + [IMAGE_NEWLINE]) * n + [IMAGE_END]
        runs.append(run)
    return Images(runs, {"pixel_values": pixels})


# ----------------------------------------------------------------------------------------------------------------
# glm4v: like Qwen2-VL (flattened patches, image_grid_thw, M-RoPE from mm_token_type_ids), <|begin_of_image|> and
# <|end_of_image|> around the image tokens.


def _glm4v_config(model_type: str = "glm4v", **text_kwargs) -> PretrainedConfig:
    text = dict(_TEXT, rope_parameters=dict(_MROPE, partial_rotary_factor=1.0), **text_kwargs)
    text.pop("head_dim")
    vision = dict(_QWEN_VISION, hidden_size=16, intermediate_size=32, out_hidden_size=32, image_size=16)
    return AutoConfig.for_model(
        model_type,
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        image_start_token_id=IMAGE_START,
        image_end_token_id=IMAGE_END,
        video_start_token_id=EXTRA,
        video_end_token_id=EXTRA + 1,
    )


# ----------------------------------------------------------------------------------------------------------------
# lfm2_vl: SigLIP2 NaFlex, patchified pixels [images, max_patches, C * p * p] with pixel_attention_mask
# [images, max_patches] and spatial_shapes [images, 2] (patch rows, cols); ceil(h / d) * ceil(w / d) tokens after the
# pixel-unshuffle by downsample_factor d, wrapped in <|image_start|> ... <|image_end|>. Row 1's image is half as tall.


def _lfm2_vl_config() -> PretrainedConfig:
    text = dict(_TEXT, model_type="lfm2", layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False)
    text.pop("head_dim")
    vision = dict(_VISION, model_type="siglip2_vision_model", num_patches=16, vision_use_head=False)
    vision.pop("image_size")
    return AutoConfig.for_model(
        "lfm2_vl",
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        projector_hidden_size=32,
        downsample_factor=2,
    )


def _lfm2_vl_images(cfg: PretrainedConfig, g: torch.Generator, rows: int) -> Images:
    vision = cfg.vision_config
    p, d = vision.patch_size, cfg.downsample_factor
    shapes = [(4, 4), (2, 4)]
    max_patches = 16
    pixels = torch.zeros(rows, max_patches, vision.num_channels * p * p)
    mask = torch.zeros(rows, max_patches, dtype=torch.long)
    runs = []
    for r in range(rows):
        h, w = shapes[r % 2]
        pixels[r, : h * w] = _rand_pixels(g, h * w, vision.num_channels * p * p)
        mask[r, : h * w] = 1
        runs.append([IMAGE_START] + [cfg.image_token_id] * (math.ceil(h / d) * math.ceil(w / d)) + [IMAGE_END])
    spatial = torch.tensor([shapes[r % 2] for r in range(rows)])
    return Images(runs, {"pixel_values": pixels, "pixel_attention_mask": mask, "spatial_shapes": spatial})


# ----------------------------------------------------------------------------------------------------------------
# idefics2: like idefics3, but a perceiver resampler gives resampler_n_latents tokens per image, each image wrapped in
# <fake_token_around_image>. Row 0 has 2 images, row 1 one (padded with an all-zero image).


def _idefics2_config() -> PretrainedConfig:
    text = dict(_TEXT, model_type="mistral", sliding_window=None)
    perceiver = dict(
        hidden_size=32,
        resampler_n_latents=4,
        resampler_depth=1,
        resampler_n_heads=2,
        resampler_head_dim=8,
        num_key_value_heads=1,
    )
    return AutoConfig.for_model(
        "idefics2", text_config=text, vision_config=dict(_VISION), perceiver_config=perceiver, image_token_id=IMAGE
    )


def _idefics2_images(cfg: PretrainedConfig, g: torch.Generator, rows: int) -> Images:
    vision = cfg.vision_config
    size = vision.image_size
    counts = [2 - r % 2 for r in range(rows)]
    pixels = torch.zeros(rows, max(counts), vision.num_channels, size, size)
    mask = torch.zeros(rows, max(counts), size, size, dtype=torch.bool)
    one = [EXTRA] + [cfg.image_token_id] * cfg.perceiver_config.resampler_n_latents
    runs = []
    for r in range(rows):
        pixels[r, : counts[r]] = _rand_pixels(g, counts[r], vision.num_channels, size, size)
        mask[r, : counts[r]] = True
        runs.append(one * counts[r] + [EXTRA])
    return Images(runs, {"pixel_values": pixels, "pixel_attention_mask": mask})


# ----------------------------------------------------------------------------------------------------------------
# got_ocr2 / pp_chart2table: SAM-style ViT with a conv neck, then two stride-2 convs: (size / p / 4)**2 tokens per
# page, <img> <imgpad> * n </img>.


def _got_ocr2_config(model_type: str = "got_ocr2") -> PretrainedConfig:
    text = dict(_TEXT, model_type="qwen2")
    text.pop("head_dim")
    vision = dict(
        _VISION,
        image_size=32,
        output_channels=16,
        mlp_dim=32,
        window_size=4,
        global_attn_indexes=[0],
        initializer_range=0.02,  # default 1e-10: the image features would all but vanish
    )
    return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, image_token_index=IMAGE)


def _got_ocr2_images(cfg: PretrainedConfig, g: torch.Generator, rows: int) -> Images:
    vision = cfg.vision_config
    n = (vision.image_size // vision.patch_size // 4) ** 2
    pixels = _rand_pixels(g, rows, vision.num_channels, vision.image_size, vision.image_size)
    return Images([[IMAGE_START] + [cfg.image_token_index] * n + [IMAGE_END]] * rows, {"pixel_values": pixels})


# ----------------------------------------------------------------------------------------------------------------
# aria: Idefics3 vision tower on crops [crops, C, H, W] with pixel_mask [crops, H, W]; a cross-attention projector
# maps the (H/p * W/p) patches to projector_patch_to_query_dict[patches] tokens per crop. MoE text model.


def _aria_config() -> PretrainedConfig:
    text = dict(
        _TEXT, moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1, moe_intermediate_size=16, pad_token_id=PAD
    )
    return AutoConfig.for_model(
        "aria",
        text_config=text,
        vision_config=dict(_VISION),
        image_token_index=IMAGE,
        projector_patch_to_query_dict={16: 4},
    )


def _aria_images(cfg: PretrainedConfig, g: torch.Generator, rows: int) -> Images:
    vision = cfg.vision_config
    size = vision.image_size
    n = cfg.projector_patch_to_query_dict[(size // vision.patch_size) ** 2]
    pixels = _rand_pixels(g, rows, vision.num_channels, size, size)
    mask = torch.ones(rows, size, size, dtype=torch.bool)
    return Images([[cfg.image_token_index] * n] * rows, {"pixel_values": pixels, "pixel_mask": mask})


# ----------------------------------------------------------------------------------------------------------------
# ovis2: a visual "vocabulary": the tower's softmax over visual words is embedded by a table; (H/p / hidden_stride)**2
# <IMG_ATOM> tokens per crop; the 5 indicator tokens (<IMG_START>, <IMG_GRID>, <IMG_COL>, <IMG_ROW>, <IMG_END>) get
# the table's last 5 rows. One crop per image.

_OVIS_INDICATORS = [EXTRA, EXTRA + 1, EXTRA + 2, EXTRA + 3, EXTRA + 4]


def _ovis2_config() -> PretrainedConfig:
    text = dict(_TEXT, model_type="qwen2")
    text.pop("head_dim")
    vision = dict(_VISION, vocab_size=64, hidden_stride=1, num_visual_indicator_tokens=5)
    return AutoConfig.for_model(
        "ovis2",
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        visual_indicator_token_ids=_OVIS_INDICATORS,
        vocab_size=VOCAB,
        hidden_size=32,
    )


def _ovis2_images(cfg: PretrainedConfig, g: torch.Generator, rows: int) -> Images:
    vision = cfg.vision_config
    n = (vision.image_size // vision.patch_size // vision.hidden_stride) ** 2
    start, grid, _, _, end = cfg.visual_indicator_token_ids
    pixels = _rand_pixels(g, rows, vision.num_channels, vision.image_size, vision.image_size)
    return Images([[start] + [cfg.image_token_id] * n + [grid, end]] * rows, {"pixel_values": pixels})


# ----------------------------------------------------------------------------------------------------------------
# deepseek_vl / janus: SigLIP-style tower, (image_size / patch)**2 tokens per image (janus: between <begin_of_image>
# and <end_of_image>; its VQ-VAE for image generation is built too, tiny).


def _deepseek_vl_config() -> PretrainedConfig:
    text = dict(_TEXT)
    text.pop("head_dim")
    vision = dict(_VISION, vision_use_head=False)
    return AutoConfig.for_model("deepseek_vl", text_config=text, vision_config=vision, image_token_id=IMAGE)


def _janus_config() -> PretrainedConfig:
    text = dict(_TEXT)
    text.pop("head_dim")
    vision = dict(_VISION, mlp_ratio=2, projection_dim=32, depth=1, num_image_tokens=16)
    vq = dict(
        embed_dim=8,
        num_embeddings=32,
        latent_channels=32,  # GroupNorm(32) over the VQ-VAE channels
        base_channels=32,
        channel_multiplier=[1, 1],
        num_res_blocks=1,
        num_patches=4,
        projection_dim=32,
        image_token_embed_dim=32,
        num_hidden_layers=1,
    )
    return AutoConfig.for_model("janus", text_config=text, vision_config=vision, vq_config=vq, image_token_id=IMAGE)


def _deepseek_vl_images(cfg: PretrainedConfig, g: torch.Generator, rows: int) -> Images:
    vision = cfg.vision_config
    n = (vision.image_size // vision.patch_size) ** 2
    pixels = _rand_pixels(g, rows, vision.num_channels, vision.image_size, vision.image_size)
    return Images([[IMAGE_START] + [cfg.image_token_id] * n + [IMAGE_END]] * rows, {"pixel_values": pixels})


# ----------------------------------------------------------------------------------------------------------------
# fuyu: no vision tower; flattened patches [patches, p * p * C] go through one linear layer. Each row of patches is
# |SPEAKER| * width + |NEWLINE| (the image token, then the newline).


def _fuyu_config() -> PretrainedConfig:
    text = dict(_TEXT, model_type="persimmon", hidden_dropout=0.0)
    text.pop("head_dim")
    return AutoConfig.for_model("fuyu", text_config=text, image_size=16, patch_size=4, image_token_id=IMAGE)


def _fuyu_images(cfg: PretrainedConfig, g: torch.Generator, rows: int) -> Images:
    side = cfg.image_size // cfg.patch_size
    pixels = _rand_pixels(g, rows * side * side, cfg.patch_size**2 * cfg.num_channels)
    run = ([cfg.image_token_id] * side + [IMAGE_NEWLINE]) * side
    return Images([run] * rows, {"pixel_values": pixels})


# ----------------------------------------------------------------------------------------------------------------
# qwen2_5_omni_thinker / qwen3_omni_moe_thinker: Qwen2.5-VL / Qwen3-VL vision plus an (unused here, tiny) audio tower.

_OMNI_AUDIO = dict(
    num_mel_bins=8,
    encoder_layers=1,
    encoder_attention_heads=2,
    encoder_ffn_dim=32,
    d_model=16,
    output_dim=32,
    max_source_positions=16,
    n_window=4,
    downsample_hidden_size=8,
    conv_chunksize=4,
)


def _qwen2_5_omni_thinker_config() -> PretrainedConfig:
    text = dict(_TEXT, rope_parameters=dict(_MROPE))
    text.pop("head_dim")
    vision = dict(
        _QWEN_VISION, hidden_size=16, intermediate_size=32, out_hidden_size=32, window_size=8, fullatt_block_indexes=[0]
    )
    return AutoConfig.for_model(
        "qwen2_5_omni_thinker",
        text_config=text,
        vision_config=vision,
        audio_config=dict(_OMNI_AUDIO),
        image_token_index=IMAGE,
        video_token_index=VIDEO,
        audio_token_index=AUDIO,
        audio_start_token_id=AUDIO_START,
        audio_end_token_id=AUDIO_END,
        vision_start_token_id=IMAGE_START,
        vision_end_token_id=IMAGE_END,
        user_token_id=EXTRA,
    )


def _qwen3_omni_moe_thinker_config() -> PretrainedConfig:
    text = dict(
        _TEXT,
        rope_parameters=dict(_MROPE, mrope_interleaved=True),
        num_experts=4,
        moe_intermediate_size=16,
        decoder_sparse_step=1,
        **_MOE,
    )
    return AutoConfig.for_model(
        "qwen3_omni_moe_thinker",
        text_config=text,
        vision_config=_qwen3_vl_vision(),
        audio_config=dict(_OMNI_AUDIO),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        audio_token_id=AUDIO,
        audio_start_token_id=AUDIO_START,
        audio_end_token_id=AUDIO_END,
        vision_start_token_id=IMAGE_START,
        vision_end_token_id=IMAGE_END,
        user_token_id=EXTRA,
    )


# ----------------------------------------------------------------------------------------------------------------
# blip-2 / instructblip: ViT, then a Q-Former whose num_query_tokens queries become the image tokens, which open the
# sequence. InstructBLIP's Q-Former also reads the instruction: qformer_input_ids / qformer_attention_mask.


def _blip2_config(model_type: str = "blip-2") -> PretrainedConfig:
    text = dict(
        model_type="opt",
        vocab_size=VOCAB,
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        word_embed_proj_dim=32,
        max_position_embeddings=128,
        dropout=0.0,
        attention_dropout=0.0,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
    )
    vision = dict(_VISION, initializer_range=0.02)  # default 1e-10: the image features would all but vanish
    qformer = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        cross_attention_frequency=1,
        encoder_hidden_size=16,
        max_position_embeddings=64,
    )
    return AutoConfig.for_model(
        model_type,
        text_config=text,
        vision_config=vision,
        qformer_config=qformer,
        num_query_tokens=4,
        image_token_index=IMAGE,
    )


def _blip2_images(cfg: PretrainedConfig, g: torch.Generator, rows: int) -> Images:
    vision = cfg.vision_config
    pixels = _rand_pixels(g, rows, 3, vision.image_size, vision.image_size)
    inputs = {"pixel_values": pixels}
    if cfg.model_type == "instructblip":
        inputs["qformer_input_ids"] = torch.randint(3, TEXT_HIGH, (rows, 5), generator=g)
        inputs["qformer_attention_mask"] = torch.ones(rows, 5, dtype=torch.long)
    return Images([[cfg.image_token_index] * cfg.num_query_tokens] * rows, inputs, prefix=0)


# ----------------------------------------------------------------------------------------------------------------

_Maker = tuple[Callable[[], PretrainedConfig], Callable[[PretrainedConfig, torch.Generator, int], Images]]


def _glm4v_moe_config() -> PretrainedConfig:
    return _glm4v_config(
        "glm4v_moe",
        n_routed_experts=4,
        n_shared_experts=1,
        moe_intermediate_size=16,
        first_k_dense_replace=1,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.1,
    )


_MAKERS: dict[str, _Maker] = {
    # the priority list first
    "gemma3": (_gemma3_config, _gemma3_images),
    "gemma4": (_gemma4_config, _gemma4_images),
    "llama4": (_llama4_config, _llama4_images),
    "mllama": (_mllama_config, _mllama_images),
    "mistral3": (_mistral3_config, _mistral3_images),
    "qwen2_vl": (_qwen2_vl_config, _qwen_images),
    "qwen2_5_vl": (_qwen2_5_vl_config, _qwen_images),
    "qwen3_vl": (_qwen3_vl_config, _qwen_images),
    "qwen3_vl_moe": (_qwen3_vl_moe_config, _qwen_images),
    "qwen3_5": (_qwen3_5_config, _qwen_images),
    "qwen3_5_moe": (_qwen3_5_moe_config, _qwen_images),
    "paligemma": (_paligemma_config, _paligemma_images),
    "llava": (_llava_config, _llava_images),
    "llava_next": (_llava_next_config, _anyres_images),
    "llava_onevision": (_llava_onevision_config, _anyres_images),
    "idefics3": (_idefics3_config, _idefics3_images),
    "smolvlm": (lambda: _idefics3_config("smolvlm"), _idefics3_images),
    "internvl": (_internvl_config, _internvl_images),
    "aya_vision": (_aya_vision_config, _tiles_images),
    "cohere2_vision": (_cohere2_vision_config, _tiles_images),
    "glm4v": (_glm4v_config, _qwen_images),
    "lfm2_vl": (_lfm2_vl_config, _lfm2_vl_images),
    # then the rest
    "gemma4_unified": (_gemma4_unified_config, _gemma4_images),
    "shieldgemma2": (lambda: _gemma3_config("shieldgemma2"), _gemma3_images),
    "lighton_ocr": (_lighton_ocr_config, _mistral3_images),
    "mistral_large4": (_mistral_large4_config, _mistral3_images),
    "llava_next_video": (lambda: _llava_next_config("llava_next_video", video_token_index=VIDEO), _anyres_images),
    "vipllava": (lambda: _llava_config("vipllava", vision_feature_layer=[-1, 0]), _llava_images),
    "video_llava": (lambda: _llava_config("video_llava", video_token_index=VIDEO), _llava_images),
    "idefics2": (_idefics2_config, _idefics2_images),
    "qianfan_ocr": (lambda: _internvl_config("qianfan_ocr"), _internvl_images),
    "glm46v": (lambda: _glm4v_config("glm46v"), _qwen_images),
    "glmga": (lambda: _glm4v_config("glmga"), _qwen_images),
    "glm_ocr": (lambda: _glm4v_config("glm_ocr"), _qwen_images),
    "glm4v_moe": (_glm4v_moe_config, _qwen_images),
    "cosmos3_omni": (_cosmos3_omni_config, _qwen_images),
    "cosmos3_edge": (_cosmos3_edge_config, _qwen_images),
    "cohere_compass": (_cohere_compass_config, _qwen_images),
    "paddleocr_vl": (_paddleocr_vl_config, _qwen_images),
    "exaone4_5": (_exaone4_5_config, _qwen_images),
    "hyperclovax_vision_v2": (_hyperclovax_vision_v2_config, _qwen_images),
    "qwen4_exp": (_qwen4_exp_config, _qwen_images),
    "qwen2_5_omni_thinker": (_qwen2_5_omni_thinker_config, _qwen_images),
    "qwen3_omni_moe_thinker": (_qwen3_omni_moe_thinker_config, _qwen_images),
    "kimi_k25": (_kimi_k25_config, _qwen_images),
    "muse_glimmer": (_muse_glimmer_config, _qwen_images),
    "hunyuan_vl": (_hunyuan_vl_config, _hunyuan_vl_images),
    "video_llama_3": (_video_llama_3_config, _video_llama_3_images),
    "got_ocr2": (_got_ocr2_config, _got_ocr2_images),
    "pp_chart2table": (lambda: _got_ocr2_config("pp_chart2table"), _got_ocr2_images),
    "aria": (_aria_config, _aria_images),
    "ovis2": (_ovis2_config, _ovis2_images),
    "deepseek_vl": (_deepseek_vl_config, _deepseek_vl_images),
    "janus": (_janus_config, _deepseek_vl_images),
    "fuyu": (_fuyu_config, _fuyu_images),
    "blip-2": (_blip2_config, _blip2_images),
    "instructblip": (lambda: _blip2_config("instructblip"), _blip2_images),
}

VISION_TYPES: list[str] = list(_MAKERS)

_TIMM = "the vision tower is a timm model (TimmWrapper) and timm is not installed"
_ENC_DEC = "encoder-decoder (the text is decoded from decoder_input_ids)"
_TIME = "not attempted (time)"
VISION_SKIPPED: dict[str, str] = {
    "gemma3n": _TIMM + " (MobileNetV5)",
    "fast_vlm": _TIMM + " (FastViT)",
    "perception_lm": _TIMM + " (Perception Encoder)",
    "florence2": _ENC_DEC,
    "pix2struct": _ENC_DEC,
    "pp_formulanet": _ENC_DEC,
    "t5gemma2": _ENC_DEC,
    "udop": _ENC_DEC + ", with layout boxes",
    "vision-encoder-decoder": _ENC_DEC,
    "blip": "image-conditioned text decoder through cross-attention (no image tokens); " + _TIME,
    "evolla": "protein-text model, no images",
    "pi0": "robot action model (flow-matching loss on actions, not a language-model loss)",
    "diffusion_gemma": "block-diffusion text model (no causal language-model loss on labels)",
    "mistral4": "Mistral4ForCausalLM: text-only class in the image-text-to-text mapping",
    "chameleon": "images enter as discrete VQ-VAE codes (no gradient reaches the image tokenizer); " + _TIME,
    "emu3": "images enter as discrete VQ-VAE codes (no gradient reaches the image tokenizer); " + _TIME,
    "instructblipvideo": "video-only InstructBLIP (pixel_values are frames); " + _TIME,
    "granite_docling": "fine/coarse tile routing with a density router; " + _TIME,
    "granite4_vision": "Q-Former per anyres tile with a custom text model; " + _TIME,
    "deepseek_vl_hybrid": "SigLIP plus a high-resolution SAM tower; " + _TIME,
    "deepseek_ocr2": "global view plus local crops (pixel_values_local, num_local_patches); " + _TIME,
    "unlimited_ocr": "global view plus local crops with a patch grid; " + _TIME,
    "step3p7": "global view plus local crops (pixel_values_local, num_local_patches); " + _TIME,
    "ernie4_5_vl_moe": "separate text/vision MoE experts routed by moe_mm_token_type_ids; " + _TIME,
    "glm5_next": "MLA + linear + top-k indexed attention text model; " + _TIME,
    "inkling2": "hybrid sliding/relative-position text model; " + _TIME,
    "inkling_mm_model": "audio token stream alongside images; " + _TIME,
    "minimax_m3_vl": "sparse-indexed attention MoE text model; " + _TIME,
    "muse_spark": "audio tower alongside the vision tower; " + _TIME,
    "dots3_note": "audio tower and chunked audio inputs alongside the vision tower; " + _TIME,
    "nemotron_h_omni": "RADIO vision tower, Mamba-hybrid text model; " + _TIME,
    "lfm3_vl": "conv/attention hybrid vision tower and text model; " + _TIME,
    "molmo2": "pooled image tokens (image_token_pooling, image_grids, crops); " + _TIME,
    "minicpm_ocr": "resampler with target_sizes; " + _TIME,
    "minicpmv4_6": "resampler with target_sizes; " + _TIME,
    "minicpmv4_7": "resampler with target_sizes; " + _TIME,
    "idefics": "perceiver + gated cross-attention with image_attention_mask; " + _TIME,
    "kosmos-2": "image embeddings at image_embeds_position_mask; " + _TIME,
    "kosmos-2.5": "flattened patches with width/height, image_embeds_position_mask; " + _TIME,
    "git": "image features prepended to the text (no image tokens); " + _TIME,
}


def tiny_vision_config(model_type: str) -> PretrainedConfig:
    """The tiny config of ``model_type`` (dropouts 0, vocabulary ``VOCAB``, one-layer vision tower)."""
    return _MAKERS[model_type][0]()


def _model_class(model_type: str) -> type:
    return getattr(transformers, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type])


def build_tiny_vision(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A tiny randomly initialised model of the image-text-to-text class of ``model_type``, in float32."""
    cfg = tiny_vision_config(model_type)
    cls = _model_class(model_type)
    torch.manual_seed(seed)
    try:
        model = cls._from_config(cfg, attn_implementation="eager")
    except (ValueError, ImportError, TypeError):
        torch.manual_seed(seed)
        model = cls._from_config(cfg)
    _wake_zero_inits(model)
    return model.float()


def _wake_zero_inits(model: torch.nn.Module) -> None:
    """Give random values to weights initialised to zero (projections, tanh gates), which would hide the images.

    Biases stay as they are; zero-initialised norm weights of the ``1 + w`` kind get small noise, which is harmless.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.is_floating_point() and not name.endswith("bias") and not param.any():
                if param.numel() == 1 or "gate" in name:
                    param.fill_(0.5)
                else:
                    param.normal_(std=0.02)


def _text(generator: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, TEXT_HIGH, (n,), generator=generator).tolist()


def _pad_id(cfg: PretrainedConfig) -> int:
    pad = getattr(cfg.get_text_config(), "pad_token_id", None)
    return pad if isinstance(pad, int) and 0 <= pad < TEXT_HIGH else PAD


def make_batch(config: PretrainedConfig, generator: torch.Generator, rows: int = 2, labels: bool = True) -> dict:
    """A batch of ``rows`` rows with images for a model of ``config``, all random values from ``generator``.

    Each row is ``prefix`` random text tokens, the row's image run, then random text; row 1 has ``ROW1_PAD`` fewer real
    tokens and is right-padded (pad id, attention_mask 0). Labels are ``input_ids`` with -100 on the image runs (the
    image tokens and the markers the processor puts around them), on the padding and on the first 3 tokens of row 0.
    """
    # transformers 4.57 names some types with a hyphen where 5 has an underscore ("lfm2-vl" / "lfm2_vl")
    maker = _MAKERS.get(config.model_type) or _MAKERS[config.model_type.replace("-", "_")]
    images = maker[1](config, generator, rows)
    pad = _pad_id(config)
    prefix = images.prefix
    length = max(prefix + len(run) + SUFFIX + (ROW1_PAD if r == 1 else 0) for r, run in enumerate(images.runs))
    input_ids = torch.full((rows, length), pad, dtype=torch.long)
    attention_mask = torch.zeros(rows, length, dtype=torch.long)
    in_run = torch.zeros(rows, length, dtype=torch.bool)
    for r, run in enumerate(images.runs):
        n = length - (ROW1_PAD if r == 1 else 0)
        row = _text(generator, prefix) + run + _text(generator, n - prefix - len(run))
        input_ids[r, :n] = torch.tensor(row)
        attention_mask[r, :n] = 1
        in_run[r, prefix : prefix + len(run)] = True
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, **images.inputs}
    if images.extras is not None:
        batch.update(images.extras(input_ids, attention_mask))
    if labels:
        lab = input_ids.masked_fill(in_run | (attention_mask == 0), -100)
        lab[0, :3] = -100
        batch["labels"] = lab
    return batch


def vision_batch(model: torch.nn.Module, generator: torch.Generator) -> dict:
    """A training batch of 2 rows, each with its image(s) (reads only ``model.config``); labels included.

    Most types have one image per row; where a type has tiles, crops or several images, row 0 usually has more of
    them than row 1 (see the image makers), so that the per-image bookkeeping is exercised.
    """
    return make_batch(model.config, generator)


def generate_inputs(model: torch.nn.Module, generator: torch.Generator) -> dict:
    """One unpadded row with its image, without labels: inputs for ``model.generate``."""
    return make_batch(model.config, generator, rows=1, labels=False)


__all__ = [
    "VISION_SKIPPED",
    "VISION_TYPES",
    "build_tiny_vision",
    "generate_inputs",
    "make_batch",
    "tiny_vision_config",
    "vision_batch",
]
