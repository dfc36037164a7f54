"""The models and data of ``multi_gpu_train.py``: the released configs (tiny under ``--cpu``), built on the meta
device and laid out by transformers (``DistributedConfig`` under ``--tp``), then initialised on the GPU; the guard
that undoes a peer's patch of a modeling module; fine-tuning-like rows with a masked prompt."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
from typing import Any

from model_configs import RELEASED_CONFIGS, tiny

IGNORE = -100
MODELS: dict[str, dict[str, Any]] = {name: dict(spec) for name, spec in RELEASED_CONFIGS.items()}
MODELS["llama-3.1-8b-lora"] = dict(MODELS["llama-3.1-8b"])
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# --cpu: the same architectures, tiny.
TINY = tiny(head_dim=16, vocab_size=512, max_position_embeddings=4096)


def model_config(args: argparse.Namespace):
    """The transformers config of ``--model`` (tiny under --cpu), depth cut to ``--layers``."""
    from transformers import AutoConfig

    spec = dict(MODELS[args.model])
    model_type = spec.pop("model_type")
    if args.cpu:
        spec.update(TINY)
        if model_type == "gemma2":
            spec.update(query_pre_attn_scalar=16, sliding_window=32)
        if "rope_parameters" in spec and spec["rope_parameters"].get("rope_type") == "llama3":
            spec["rope_parameters"] = {**spec["rope_parameters"], "original_max_position_embeddings": 1024}
    else:
        spec.setdefault("head_dim", spec["hidden_size"] // spec["num_attention_heads"])
    if args.layers is not None:
        spec["num_hidden_layers"] = args.layers
    spec["max_position_embeddings"] = max(spec["max_position_embeddings"], args.seq_len)
    config = AutoConfig.for_model(model_type, use_cache=False, **spec)
    # transformers 5.24 refuses SDPA for Gemma-2 (its softcapped attention scores): eager there.
    config._attn_implementation = "eager" if args.cpu or model_type == "gemma2" else "sdpa"
    return config


class Distribution:
    """transformers' DistributedConfig mesh for --tp (None otherwise), made once per launch."""

    def __init__(self, args: argparse.Namespace, world: int) -> None:
        self.config = self.mesh = None
        if args.tp == 1:
            return
        if world % args.tp:
            raise SystemExit(f"--tp {args.tp} must divide the number of processes {world}")
        try:
            from transformers import DistributedConfig
        except ImportError as error:
            raise SystemExit(
                "--tp needs transformers' DistributedConfig (transformers >= 5.24; this is "
                f"{importlib.metadata.version('transformers')}): {error}"
            ) from error
        from transformers import PreTrainedModel

        self.config = DistributedConfig(tp_size=args.tp, fsdp_size=world // args.tp)
        self.config, _, self.mesh = PreTrainedModel.prepare_distribute_model(self.config)
        if args.cpu:
            _allow_parallelism_config_on_cpu()


def _allow_parallelism_config_on_cpu() -> None:
    """CPU smoke mode only: accelerate refuses a ParallelismConfig (which the Trainer makes for a tensor-parallel
    model) on CPU processes, though its tensor-parallel path needs nothing of the GPU; let it through there."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    original = ParallelismConfig._validate_accelerator

    def validate(self, accelerator):
        if accelerator.distributed_type == DistributedType.MULTI_CPU:
            return None
        return original(self, accelerator)

    ParallelismConfig._validate_accelerator = validate


def build_model(args: argparse.Namespace, device, distribution: Distribution):
    """Random bf16 weights from the config: built on the meta device, laid out (TP / FSDP2 by transformers under
    --tp), then materialised on ``device`` and initialised there (seconds, where a CPU init of 8B takes minutes)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model_config(args)
    dtype = torch.float32 if args.cpu else torch.bfloat16
    try:  # an earlier method's Trainer left DeepSpeed's config registered: no ZeRO-3 init at construction
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    except ImportError:
        pass
    untied = contextlib.nullcontext()
    if distribution.config is not None:
        # As from_pretrained does: tied weights stay apart until the plan has laid each out, then are tied.
        from transformers.initialization import no_tie_weights

        untied = no_tie_weights()
    with torch.device("meta"), untied:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if distribution.config is not None:
        model = type(model).maybe_distribute_model(model, distribution.config, distribution.mesh)
    model.to_empty(device=device)
    for item in (*model.modules(), *model.parameters(), *model.buffers()):
        if "_is_hf_initialized" in vars(item):
            del item._is_hf_initialized
    torch.manual_seed(args.seed)  # every rank the same weights
    with torch.no_grad():
        if hasattr(model, "initialize_weights"):
            model.initialize_weights()
        else:  # older transformers
            model.apply(model._init_weights)
    model.tie_weights()
    if args.model.endswith("-lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS))
    model.train()
    return model


def parameter_counts(model) -> dict[str, int]:
    """Whole-model parameter counts (DTensors and FSDP shards counted at their full size)."""
    total = trainable = 0
    for param in model.parameters():
        total += param.numel()
        trainable += param.numel() if param.requires_grad else 0
    return {"params": total, "trainable": trainable}


class ModuleGuard:
    """Undo what a peer's patch writes into a modeling module (Liger replaces ``LlamaRMSNorm``,
    ``apply_rotary_pos_emb``, ... there), so the next method builds and runs the original model."""

    def __init__(self, config) -> None:
        import importlib

        kind = config.model_type
        self.modules = [importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")]
        self.saved = [dict(vars(m)) for m in self.modules]

    def restore(self) -> list[str]:
        restored = []
        for module, saved in zip(self.modules, self.saved):
            current = vars(module)
            for key in [k for k in current if k not in saved]:
                delattr(module, key)
                restored.append(f"{module.__name__}.{key}")
            for key, value in saved.items():
                if current.get(key) is not value:
                    setattr(module, key, value)
                    restored.append(f"{module.__name__}.{key}")
        return restored


def make_rows(args: argparse.Namespace, count: int, vocab: int) -> list[dict[str, list[int]]]:
    """``count`` sequences of random ids, each with a masked prompt of 45-55% of its length (times
    --prompt-fraction / 0.5), the same on every rank (the Trainer's sampler gives each rank its share)."""
    import torch

    generator = torch.Generator().manual_seed(args.seed + 1)
    rows = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (args.seq_len,), generator=generator)
        jitter = 0.9 + 0.2 * torch.rand((), generator=generator).item()
        prompt = min(int(args.seq_len * args.prompt_fraction * jitter), args.seq_len - 2)
        labels = ids.clone()
        labels[:prompt] = IGNORE
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return rows


def collate(batch: list[dict[str, list[int]]]) -> dict[str, Any]:
    import torch

    ids = torch.tensor([row["input_ids"] for row in batch])
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": torch.tensor([row["labels"] for row in batch]),
    }
