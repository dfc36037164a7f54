"""Smoke test of an installed lce_patch wheel (run outside the source tree): import, the op on the CPU,
patch a tiny model and train it two steps with the Trainer and the callback."""

import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import lce_patch
from lce_patch import FusedLCECallback, fused_linear_cross_entropy

assert "site-packages" in lce_patch.__file__, f"lce_patch imported from the source tree: {lce_patch.__file__}"
print("lce_patch", lce_patch.__version__, "from", lce_patch.__file__)

hidden = torch.randn(12, 16, requires_grad=True)
weight = torch.randn(40, 16, requires_grad=True)
labels = torch.randint(0, 40, (12,))
loss = fused_linear_cross_entropy(hidden, weight, labels)
expected = torch.nn.functional.cross_entropy(hidden @ weight.t(), labels)
assert torch.allclose(loss, expected, rtol=1e-5), (loss, expected)
loss.backward()

torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
model = LlamaForCausalLM(config)
rows = [{"input_ids": torch.randint(0, 64, (16,)), "labels": torch.randint(0, 64, (16,))} for _ in range(4)]
with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(out, max_steps=2, per_device_train_batch_size=2, use_cpu=True, report_to=[], save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[FusedLCECallback()])
    trainer.train()
assert lce_patch.models.is_patched(trainer.model)
losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry] or [trainer.state.log_history[-1]["train_loss"]]
assert all(value == value for value in losses), losses
print("smoke test passed: loss", losses)

# The console script and the launcher's site folder came with the wheel: a program that never names lce_patch,
# started under `lce-patch run`, trains fused (its report says the op ran).
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

launcher = shutil.which("lce-patch", path=os.path.dirname(sys.executable))
assert launcher is not None, "the lce-patch console script is not installed"
program = """
import tempfile, torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
rows = [{"input_ids": torch.randint(0, 64, (16,)), "labels": torch.randint(0, 64, (16,))} for _ in range(4)]
with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(out, max_steps=2, per_device_train_batch_size=2, use_cpu=True, report_to=[], save_strategy="no")
    Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=rows).train()
"""
with tempfile.TemporaryDirectory() as folder:
    report = os.path.join(folder, "report.jsonl")
    subprocess.run([launcher, "run", "--report", report, "--", sys.executable, "-c", program], check=True)
    [record] = [json.loads(line) for line in open(report)]
assert record["trainers"][0]["fused"] is True and record["op_calls"] == {"fused_linear_cross_entropy": 2}, record
print("launcher smoke test passed:", record["trainers"][0]["line"])
