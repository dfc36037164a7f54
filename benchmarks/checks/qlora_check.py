"""QLoRA on the GPU: a 4-bit (nf4) base with LoRA adapters, patched vs unpatched.

Builds a model from a real config (random weights, no download), saves it, loads it twice in nf4 with
bitsandbytes (compute dtype bf16), applies ``prepare_model_for_kbit_training`` and LoRA (r 16 on the
attention projections), patches one copy with ``apply_fused_lce`` and runs training steps on both with
the same batches under bf16 autocast (as ``Trainer(bf16=True)`` does). Reports the loss of each, the
LoRA gradients' relative error (patched vs unpatched, first step), the dtype the head arrives in, peak
memory of a step and the median step time.

``--lora-on-head`` puts LoRA on ``lm_head`` too (the fused low-rank term: the head's LoRA gradients are
then among those compared); ``--no-quant`` loads the base in bf16 instead of nf4 (plain LoRA).

    python3 benchmarks/checks/qlora_check.py [--model llama-3.2-1b] [--seq-len 4096] [--batch 2] [--steps 6]
    python3 benchmarks/checks/qlora_check.py --lora-on-head [--no-quant]
    python3 benchmarks/checks/qlora_check.py --tiny      # a tiny model on the CPU (smoke test of the script)

Needs peft, and bitsandbytes unless ``--no-quant``. JSON to --out (default $OUT/qlora_check.json or runs/qlora_check.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # lce_patch from this checkout, not an installed copy

# The real shapes come from e2e_train.py's models; "tiny" is a CPU smoke test of the script.
MODELS = ("llama-3.2-1b", "gemma-2-2b", "tiny")
sys.path.insert(0, str(REPO / "benchmarks"))  # model_configs, e2e_train

from model_configs import tiny  # noqa: E402

TINY = tiny(vocab_size=256, max_position_embeddings=512)


def _build(name: str, path: Path) -> int:
    """Save a random-weight model of ``name`` to ``path``; returns its vocabulary size."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if name == "tiny":
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**TINY)).to(torch.bfloat16)
    else:
        from e2e_train import build_model

        model = build_model(name)
    model.save_pretrained(path)
    return model.config.vocab_size


def _load(path: Path, device: str, lora_rank: int, lora_on_head: bool = False, quantize: bool = True):
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    if quantize:
        from transformers import BitsAndBytesConfig

        quantization = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
        )
        model = AutoModelForCausalLM.from_pretrained(
            path, quantization_config=quantization, dtype=torch.bfloat16, device_map=device
        )
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    else:  # plain LoRA on a bf16 model
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map=device)
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    torch.manual_seed(1)
    lora = peft.LoraConfig(
        r=lora_rank,
        lora_alpha=2 * lora_rank,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"] + (["lm_head"] if lora_on_head else []),
        init_lora_weights=False,
    )
    return peft.get_peft_model(model, lora)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.2-1b", choices=MODELS)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--lora-on-head", action="store_true", help="LoRA on lm_head too (fused by lce_patch)")
    parser.add_argument("--no-quant", action="store_true", help="a bf16 base instead of nf4 (plain LoRA)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import torch

    import lce_patch

    device = "cpu" if args.tiny else "cuda"
    name = "tiny" if args.tiny else args.model
    seq_len = 64 if args.tiny else args.seq_len
    steps = 3 if args.tiny else args.steps
    results: dict = {
        "model": name,
        "seq_len": seq_len,
        "batch": args.batch,
        "lora_rank": args.lora_rank,
        "lora_on_head": args.lora_on_head,
        "quantized": not args.no_quant,
        "runs": {},
    }
    grads = {}
    with tempfile.TemporaryDirectory() as tmp:
        vocab = _build(name, Path(tmp))
        if device == "cuda":
            torch.cuda.empty_cache()
        generator = torch.Generator().manual_seed(2)
        batches = [torch.randint(0, vocab, (args.batch, seq_len), generator=generator) for _ in range(steps)]
        for setup in ("unpatched", "patched"):
            model = _load(Path(tmp), device, args.lora_rank, args.lora_on_head, not args.no_quant)
            head = model.get_base_model().lm_head
            if setup == "patched":
                lce_patch.apply_fused_lce(model)
            model.train()
            params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            optimizer = torch.optim.SGD([p for _, p in params], lr=1e-3)
            losses, times, peaks = [], [], []
            for step, input_ids in enumerate(batches):
                input_ids = input_ids.to(device)
                if device == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                with torch.autocast(device, dtype=torch.bfloat16):
                    loss = model(input_ids=input_ids, labels=input_ids).loss
                loss.backward()
                if step == 0:
                    grads[setup] = {n: p.grad.detach().float().clone() for n, p in params}
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if device == "cuda":
                    torch.cuda.synchronize()
                    peaks.append(torch.cuda.max_memory_allocated() / 2**30)
                times.append(time.perf_counter() - start)
                losses.append(float(loss))
            results["runs"][setup] = {
                "head_dtype": str(head.weight.dtype),
                "losses": losses,
                "median_step_s": statistics.median(times[1:] or times),
                "peak_gib": max(peaks) if peaks else None,
            }
            del model, optimizer
            if device == "cuda":
                torch.cuda.empty_cache()
    errors = {
        name: float((grads["patched"][name] - ref).norm() / ref.norm().clamp_min(1e-30))
        for name, ref in grads["unpatched"].items()
    }
    results["lora_grad_rel_err_max"] = max(errors.values())
    results["lora_grad_rel_err_median"] = statistics.median(errors.values())
    results["env"] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "lce_patch": lce_patch.__version__,
    }
    for module in ("transformers", "peft") + (() if args.no_quant else ("bitsandbytes",)):
        results["env"][module] = __import__(module).__version__
    text = json.dumps(results, indent=1)
    print(text)
    out = args.out or Path(os.environ.get("OUT", "runs")) / "qlora_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)


if __name__ == "__main__":
    main()
