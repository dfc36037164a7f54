"""DPO and GRPO training steps at a real size: TRL's own fused LM head vs lce_patch's op serving it.

Since TRL 1.15 its trainers score every sequence through ``add_fused_lm_head`` (a chunked head on the
policy and on the reference model). This script builds a Llama-3.2-1B- or Gemma-2-2B-shaped model
from its config (random weights, bf16, no download), installs TRL's head on the policy and on a
reference copy exactly as DPOTrainer / GRPOTrainer do, and times the step those trainers run:

* ``dpo``: ``pairs`` chosen/rejected pairs of ``--seq-len`` tokens (the first quarter a masked prompt);
  the policy's log-probs, entropy, mean logits and argmax hits (DPOTrainer's outputs) with gradients,
  the reference's log-probs without, the sigmoid DPO loss on the summed log-probs, backward.
* ``grpo``: ``--batch`` completions of ``--seq-len`` tokens (a quarter prompt); the policy's log-probs
  and entropy, the reference's log-probs (``--beta`` > 0), GRPO's clipped per-token objective with
  per-sequence advantages and the k3 KL term, normalised over all completion tokens (TRL's default
  ``dapo``), backward.

Then lce_patch's callback code (``maybe_install_trl_head``) swaps both heads for lce_patch's op and the
same steps run again, in the same process. Each head: ``--warmup`` untimed steps, then one step whose
peak memory (``torch.cuda.max_memory_allocated``, weights included), loss and gradients are recorded
(the two heads' are compared); then ``--steps`` timed steps per head, the heads alternating step by
step (CUDA events around forward + backward; no optimizer step, which is the same for both).

    python benchmarks/bench_trl.py --model llama-3.2-1b --trainer dpo --seq-len 2048 --pairs 2
    python benchmarks/bench_trl.py --model gemma-2-2b --trainer grpo --seq-len 2048 --batch 4 --out results/
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

HEADS = ("trl", "lce_patch")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("llama-3.2-1b", "gemma-2-2b"), default="llama-3.2-1b")
    parser.add_argument("--trainer", choices=("dpo", "grpo"), default="dpo")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default: %(default)s)")
    parser.add_argument(
        "--pairs", type=int, default=2, help="DPO: chosen/rejected pairs per step (default: %(default)s)"
    )
    parser.add_argument("--batch", type=int, default=4, help="GRPO: completions per step (default: %(default)s)")
    parser.add_argument("--beta", type=float, default=0.04, help="GRPO KL coefficient; 0: no reference model")
    parser.add_argument("--lora", action="store_true", help="freeze the base weights, LoRA on q/v (peft)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (smoke test of the script)")
    parser.add_argument("--out", type=Path, help="write the results as JSON in this directory")
    return parser.parse_args(argv)


def build_model(name: str, tiny: bool, device):
    import torch

    if tiny:
        from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig

        common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
        common.update(num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)
        config = (
            LlamaConfig(**common)
            if name == "llama-3.2-1b"
            else Gemma2Config(**common, head_dim=8, final_logit_softcapping=30.0)
        )
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from e2e_train import build_model as build_real

    return build_real(name)


def make_batch(args, vocab: int, device):
    import torch

    gen = torch.Generator().manual_seed(0)
    rows = 2 * args.pairs if args.trainer == "dpo" else args.batch
    ids = torch.randint(0, vocab, (rows, args.seq_len), generator=gen)
    prompt = args.seq_len // 4
    lengths = args.seq_len - torch.randint(0, args.seq_len // 8 + 1, (rows,), generator=gen)  # some padding
    positions = torch.arange(args.seq_len)
    attention = (positions[None, :] < lengths[:, None]).long()
    completion = attention.clone()
    completion[:, :prompt] = 0
    labels = ids.masked_fill(completion == 0, -100)
    advantages = torch.randn(rows, generator=gen)
    return {k: v.to(device) for k, v in dict(ids=ids, attention=attention, labels=labels, adv=advantages).items()}


def dpo_step(policy, reference, batch, beta=0.1):
    """DPOTrainer._compute_loss (sigmoid loss), with the metrics' outputs computed as it asks for them."""
    import torch
    import torch.nn.functional as F

    kwargs = dict(input_ids=batch["ids"], attention_mask=batch["attention"], labels=batch["labels"], use_cache=False)
    out = policy(**kwargs, fused_lm_head=True)
    logps = out.log_probs.sum(1)
    with torch.no_grad():
        ref_logps = reference(**kwargs, fused_lm_head=True).log_probs.sum(1)
    chosen, rejected = (logps - ref_logps).chunk(2)
    loss = -F.logsigmoid(beta * (chosen - rejected)).mean()
    loss.backward()
    metrics = (out.entropy.sum(), out.mean_logits.sum(), out.is_top1.sum())  # what the logs read
    return loss.detach(), metrics


def grpo_step(policy, reference, batch, beta=0.04, epsilon=0.2):
    """GRPOTrainer's loss (``dapo`` normalisation, on-policy: old log-probs are the current ones)."""
    import torch

    kwargs = dict(input_ids=batch["ids"], attention_mask=batch["attention"], labels=batch["labels"], use_cache=False)
    out = policy(**kwargs, fused_lm_head=True)
    logps, mask = out.log_probs, out.label_mask.float()
    ratio = torch.exp(logps - logps.detach())
    advantages = batch["adv"][:, None]
    per_token = -torch.min(ratio * advantages, torch.clamp(ratio, 1 - epsilon, 1 + epsilon) * advantages)
    if reference is not None and beta > 0:
        with torch.no_grad():
            ref_logps = reference(**kwargs, fused_lm_head=True).log_probs
        per_token = per_token + beta * (torch.exp(ref_logps - logps) - (ref_logps - logps) - 1)
    loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
    loss.backward()
    return loss.detach(), (out.entropy.sum(),)


def run(args) -> dict:
    import torch
    from trl.trainer.utils import add_fused_lm_head

    from lce_patch.integrations.trl import maybe_install_trl_head, remove_trl_head

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    policy = build_model(args.model, args.tiny, device)
    policy.gradient_checkpointing_enable()
    policy.config.use_cache = False
    reference = None
    if args.trainer == "dpo" or args.beta > 0:
        reference = copy.deepcopy(policy).eval().requires_grad_(False)
    if args.trainer == "dpo":
        add_fused_lm_head(policy, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
        step = dpo_step
    else:
        add_fused_lm_head(policy, outputs=("log_probs", "entropy"))
        step = grpo_step
    if reference is not None:
        add_fused_lm_head(reference)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        policy = get_peft_model(policy, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]))
    batch = make_batch(args, policy.get_output_embeddings().weight.shape[0], device)
    tokens = int((batch["labels"] != -100).sum())

    def use(head: str) -> None:
        for model in (policy, reference):
            if model is not None:
                if head == "lce_patch":
                    assert maybe_install_trl_head(model, {})
                else:
                    remove_trl_head(model)

    def timed_step() -> tuple[float | None, float]:
        policy.zero_grad(set_to_none=True)
        if device.type != "cuda":
            return None, float(step(policy, reference, batch)[0])
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss, _ = step(policy, reference, batch)
        stop.record()
        torch.cuda.synchronize()
        return start.elapsed_time(stop), float(loss)

    # Phase 1, one head at a time: warm-up, then one step for peak memory, loss and gradients.
    results, first = {}, {}
    for head in HEADS:
        use(head)
        for _ in range(args.warmup):
            timed_step()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        _, loss = timed_step()
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        # on the host: a device copy would count in the next head's peak memory
        grads = {n: p.grad.float().cpu() for n, p in policy.named_parameters() if p.grad is not None}
        first[head] = {"loss": loss, "grads": grads}
        results[head] = {"peak_gib": peak, "loss": loss, "step_ms_all": []}
    # Phase 2, timing: the heads alternate step by step (in alternating order), so clock and power
    # changes of a long run reach both alike.
    for index in range(args.steps):
        for head in HEADS if index % 2 == 0 else HEADS[::-1]:
            use(head)
            milliseconds, _ = timed_step()
            if milliseconds is not None:
                results[head]["step_ms_all"].append(milliseconds)
    for head in HEADS:
        times = results[head]["step_ms_all"]
        mean_ms = sum(times) / len(times) if times else None
        results[head].update(step_ms=mean_ms, tokens_per_s=tokens / (mean_ms / 1000) if mean_ms else None)
    remove_trl_head(policy)
    grads_a, grads_b = first["trl"]["grads"], first["lce_patch"]["grads"]
    worst = 0.0
    for name in grads_a:
        denominator = grads_a[name].norm().clamp(min=1e-30)
        worst = max(worst, float((grads_a[name] - grads_b[name]).norm() / denominator))
    results["check"] = {
        "loss_abs_diff": abs(first["trl"]["loss"] - first["lce_patch"]["loss"]),
        "worst_grad_rel_l2": worst,
    }
    return {"tokens_scored": tokens, "results": results}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from benchmarks.bench_common import env_info

    torch.backends.cuda.matmul.allow_tf32 = True
    summary = run(args)
    record = {"args": {k: str(v) for k, v in vars(args).items()}, "env": env_info(), **summary}
    setup = f"{args.model} {args.trainer}{' LoRA' if args.lora else ''} seq {args.seq_len}"
    print(f"{setup}: {summary['tokens_scored']} scored tokens per step")
    for head in HEADS:
        r = summary["results"][head]
        ms = "n/a" if r["step_ms"] is None else f"{r['step_ms']:.1f} ms"
        mem = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.2f} GiB"
        print(f"  {head:>10}: step {ms}, peak {mem}, loss {r['loss']:.6f}")
    print(f"  check: {summary['results']['check']}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"bench_trl_{args.model}_{args.trainer}{'_lora' if args.lora else ''}_{args.seq_len}.json"
        (args.out / name).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
