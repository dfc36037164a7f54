"""TRL's experimental ServerDistillationTrainer and AsyncDistillationTrainer served by fused_linear_sparse_divergence
through FusedLCECallback (CPU, float32).

Neither trainer's vLLM teacher runs here. The server trainer trains for real with a stand-in for its teacher client
that answers ``get_sequence_logprobs`` from a tiny local teacher model (top-K log-probabilities at the sampling
temperature, and the sampled token's), as the vLLM server does. The async trainer is built with stub rollout and
weight-transfer objects (its constructor's injection points); its ``compute_loss`` runs on batches made by its own
collator from rollout samples shaped like its worker's (teacher top-K padded to K + 1 with id -1). That student is
float64: TRL's function computes the head's logits in float32 (``.float()``) and the op in float64, so the two
agree to float32's precision (1e-6 relative seen), whereas a float32 student's backbone alone moves these small
distillation gradients by 0.5% (float32 against float64, either loss), which would hide a wrong gradient.
"""

from __future__ import annotations

import importlib
import types
import warnings

import numpy as np
import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
server_module = pytest.importorskip("trl.experimental.server_distillation.server_distillation_trainer")
async_module = pytest.importorskip("trl.experimental.async_distillation.async_distillation_trainer")

from lce_patch import FusedLCECallback  # noqa: E402
from lce_patch.integrations.serving import SERVED, find_row  # noqa: E402
from lce_patch.integrations.trl import TRLProtocolError  # noqa: E402
from lce_patch.integrations.trl import async_distillation as async_serving  # noqa: E402
from lce_patch.integrations.trl import server_distillation as server_serving  # noqa: E402
from tests.integrations.trl_helpers import VOCAB, cpu_run, distillation_model, lora_config, make_tokenizer, record_calls  # noqa: E402

warnings.filterwarnings("ignore", message=".*trl.experimental.*")


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(autouse=True)
def _no_gpu_peak_flops(monkeypatch):
    # the async trainer asks for the device's peak FLOPs at construction, through torch.cuda
    monkeypatch.setattr(async_module, "get_peak_flops_per_device", lambda *args, **kwargs: None)


@pytest.fixture
def op_calls(monkeypatch):
    return record_calls(monkeypatch, "fused_linear_sparse_divergence", async_serving, server_serving)


# --------------------------------------------------------------------------------------------------------------------
# ServerDistillationTrainer


class _TeacherClient:
    """Stands in for TRL's VLLMClient: the teacher server's answers, from a local model."""

    teacher: torch.nn.Module | None = None

    def __init__(self, *args, **kwargs):
        pass

    def get_sequence_logprobs(self, sequences, prompt_lengths, top_logprobs, temperature):
        out = {"logprobs": [], "logprob_token_ids": [], "actual_logprobs": []}
        for sequence, prompt_length in zip(sequences, prompt_lengths, strict=True):
            ids = torch.tensor([sequence])
            with torch.no_grad():
                logits = self.teacher(input_ids=ids).logits[0].float()
            # entry i scores token i given the tokens before it, for the completion tokens only
            logps = torch.log_softmax(logits / temperature, dim=-1)[prompt_length - 1 : -1]
            top = logps.topk(top_logprobs, dim=-1)
            out["logprobs"].append(top.values.tolist())
            out["logprob_token_ids"].append(top.indices.tolist())
            out["actual_logprobs"].append(logps.gather(-1, ids[0, prompt_length:, None]).tolist())
        return out


def _train_server(tokenizer, monkeypatch, tmp_path, callbacks, kind="llama", peft=False, **config):
    _TeacherClient.teacher = distillation_model(kind, 48, 1).eval()  # a wider teacher
    monkeypatch.setattr("trl.generation.vllm_client.VLLMClient", _TeacherClient)
    prompts = datasets.Dataset.from_list(
        [{"prompt": " ".join(f"w{4 + (i * 7 + j) % 50}" for j in range(6))} for i in range(8)]
    )
    args = server_module.ServerDistillationConfig(
        **cpu_run(
            tmp_path,
            teacher_model_server_url="http://teacher.invalid",
            bf16=False,  # float32: TRL's default bf16 rounds its logits to bfloat16, which the op does not
            per_device_train_batch_size=4,
            max_steps=2,
            max_completion_length=12,
            learning_rate=1e-2,
            **config,
        )
    )
    peft_config = lora_config() if peft else None
    trainer = server_module.ServerDistillationTrainer(
        model=distillation_model(kind, 32, 0),
        args=args,
        train_dataset=prompts,
        processing_class=tokenizer,
        callbacks=callbacks,
        peft_config=peft_config,
    )
    wide = []
    head = trainer.model.get_output_embeddings()

    def hook(module, inputs, output):
        if torch.is_grad_enabled() and output.dim() == 3 and output.shape[1] > 1:
            wide.append(tuple(output.shape))  # a [B, T, V] head output in a training step

    handle = head.register_forward_hook(hook)
    try:
        trainer.train()
    finally:
        handle.remove()
    return trainer, [entry for entry in trainer.state.log_history if "loss" in entry], wide


@pytest.mark.parametrize(
    ("kind", "config", "peft"),
    [
        ("llama", dict(beta=0.0, loss_top_k=3, loss_add_tail=True), False),
        ("llama", dict(beta=0.0, loss_top_k=3, loss_add_tail=False, temperature=0.7), False),
        ("llama", dict(beta=0.5, loss_top_k=1, loss_add_tail=True), False),
        ("llama", dict(beta=1.0, loss_top_k=1, loss_add_tail=True), False),
        ("gemma2", dict(beta=0.5, loss_top_k=1, loss_add_tail=False), False),
        ("llama", dict(beta=0.0, loss_top_k=3, loss_add_tail=True), True),
    ],
    ids=["fkl-top3-tail", "fkl-top3-renorm-t0.7", "jsd-top1-tail", "rkl-top1-tail", "gemma2-jsd-top1-renorm", "lora"],
)
def test_server_distillation_logs_equal_trl(tokenizer, monkeypatch, op_calls, tmp_path, kind, config, peft):
    _, reference, wide_reference = _train_server(tokenizer, monkeypatch, tmp_path / "trl", [], kind, peft, **config)
    assert not op_calls and wide_reference  # TRL's own loss reads the [B, T, V] logits
    trainer, logs, wide = _train_server(
        tokenizer, monkeypatch, tmp_path / "fused", [FusedLCECallback()], kind, peft, **config
    )
    assert getattr(vars(trainer)["compute_loss"], SERVED)
    assert len(op_calls) == 2 and not wide  # one op call per step, no [B, T, V] head output
    assert not any(call.get("fp32_logits") for call in op_calls)  # TRL's loss reads the model's own logits
    assert len(logs) == len(reference) == 2
    # float32. Step 1 (same weights, same completions): within 1.2e-5 relative seen, the float32 rounding of these small
    # divergences (sums of terms of both signs; the op sums the log-sum-exp over vocabulary chunks, TRL in one pass).
    # Step 2 follows an AdamW step of lr 1e-2, which moves each weight by about lr whatever its gradient's size, so
    # gradient components that are float noise in both runs move weights apart: up to 1e-3 relative seen.
    for step, tolerance in ((0, 1e-4), (1, 5e-3)):
        for name in ("loss", "grad_norm"):
            assert logs[step][name] == pytest.approx(reference[step][name], rel=tolerance), (step, name)
    assert logs[0]["completions/mean_length"] == reference[0]["completions/mean_length"]  # the same completions
    assert reference[0]["loss"] > 0


# --------------------------------------------------------------------------------------------------------------------
# AsyncDistillationTrainer


def _async_trainer(tokenizer, tmp_path, callbacks, kind="llama", teachers=("t",), peft=False, **config):
    path = tmp_path / "student"
    distillation_model(kind, 32, 0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    args = async_module.AsyncDistillationConfig(
        **cpu_run(
            tmp_path / "out",
            model_init_kwargs={"attn_implementation": "eager", "dtype": "float64"},
            teacher_server_urls={name: f"http://{name}.invalid" for name in teachers},
            bf16=False,
            **config,
        )
    )
    peft_config = lora_config() if peft else None
    return async_module.AsyncDistillationTrainer(
        model=str(path),
        args=args,
        train_dataset=datasets.Dataset.from_list([{"prompt": "w4 w5"}]),
        processing_class=tokenizer,
        callbacks=callbacks,
        peft_config=peft_config,
        rollout_worker=types.SimpleNamespace(rollout_buffer=None),  # no rollouts: compute_loss is fed directly
        weight_transfer=types.SimpleNamespace(),
    )


def _rollout_batch(trainer, top_k, seed=0):
    """A packed micro-batch from the trainer's collator: three samples, candidates padded to K + 1 with -1, one
    completion position without teacher signal, one teacher per sample (several with MOPD)."""
    generator = torch.Generator().manual_seed(seed)
    teachers = list(trainer._teacher_ids)
    examples = []
    for index, (prompt, completion) in enumerate([(4, 7), (3, 5), (5, 9)]):
        length = prompt + completion
        ids = torch.randint(4, VOCAB, (length,), generator=generator)
        topk_ids = torch.full((length, top_k + 1), -1)
        topk_logps = torch.full((length, top_k + 1), float("-inf"))
        for position in range(prompt, length):  # entry i scores token i: the completion tokens
            if index == 1 and position == prompt + 2:
                continue  # no teacher signal here
            candidates = torch.randperm(VOCAB, generator=generator)[:top_k]
            candidates[int(torch.randint(0, top_k, (1,), generator=generator))] = ids[position]  # the sampled token
            topk_ids[position, :top_k] = candidates
            topk_logps[position, :top_k] = torch.log_softmax(torch.randn(VOCAB, generator=generator), -1)[candidates]
        examples.append(
            {
                "input_ids": ids.numpy(),
                "completion_mask": np.array([0] * prompt + [1] * completion),
                "teacher_topk_ids": topk_ids.numpy(),
                "teacher_topk_logprobs": topk_logps.numpy(),
                "prompt_id": index,
                "teacher_id": teachers[index % len(teachers)],
                "metrics": {},
            }
        )
    mapping = trainer._teacher_id_to_idx if len(teachers) > 1 else None
    collator = async_module.DataCollatorForRollout(pad_token_id=0, teacher_id_to_idx=mapping)
    return collator.torch_call([[examples]])


def _loss_and_grads(trainer, batch):
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {key: list(values) for key, values in trainer._metrics["train"].items()}
    return loss.detach(), grads, metrics


@pytest.mark.parametrize(
    ("config", "kind", "teachers", "peft"),
    [
        (dict(beta=0.0, add_tail_bucket=True, teacher_temperature=1.0), "llama", ("t",), False),
        (dict(beta=0.0, add_tail_bucket=False, teacher_temperature=0.8), "llama", ("t",), False),
        (dict(beta=0.5, add_tail_bucket=True, teacher_temperature=1.0), "gemma2", ("t",), False),
        (dict(beta=1.0, add_tail_bucket=True, teacher_temperature=1.2), "llama", ("a", "b"), False),
        (dict(beta=0.0, add_tail_bucket=True, teacher_temperature=1.0), "llama", ("t",), True),
    ],
    ids=["fkl-tail", "fkl-renorm-t0.8", "gemma2-jsd", "rkl-two-teachers", "lora"],
)
def test_async_distillation_loss_grads_and_metrics_equal_trl(
    tokenizer, tmp_path, op_calls, config, kind, teachers, peft
):
    trainer = _async_trainer(tokenizer, tmp_path, [FusedLCECallback()], kind, teachers, peft, teacher_top_k=4, **config)
    trainer.current_gradient_accumulation_steps = 2
    assert getattr(vars(trainer)["_compute_loss"], SERVED)
    batch = _rollout_batch(trainer, top_k=4)
    loss, grads, metrics = _loss_and_grads(trainer, batch)
    assert len(op_calls) == 1 and op_calls[0]["reduction"] == ("none" if len(teachers) > 1 else "sum")
    # TRL's chunked loss takes fp32 logits and dW: the served op is asked for the same precision
    assert op_calls[0]["fp32_logits"] and op_calls[0]["fp32_weight_grad"]
    assert async_serving.unserve(trainer, find_row(trainer))
    assert "_compute_loss" not in vars(trainer)
    reference, reference_grads, reference_metrics = _loss_and_grads(trainer, batch)
    assert len(op_calls) == 1  # TRL's own function this time
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    assert sorted(grads) == sorted(reference_grads) and grads
    for name, grad in grads.items():
        assert (grad - reference_grads[name]).norm() <= 1e-5 * reference_grads[name].norm(), name
    assert sorted(metrics) == sorted(reference_metrics)
    for key, values in metrics.items():
        np.testing.assert_allclose(
            np.array(values, float), np.array(reference_metrics[key], float), 1e-5, 1e-7, err_msg=key
        )
    assert "jsd" in metrics and ("teacher_jsd/a" in metrics) == (len(teachers) > 1)


def test_async_dispatcher_is_per_trainer_and_reversible(tokenizer, tmp_path, op_calls):
    module = importlib.import_module(async_module.__name__)
    served = _async_trainer(tokenizer, tmp_path / "a", [FusedLCECallback()])
    plain = _async_trainer(tokenizer, tmp_path / "b", [])
    for trainer in (served, plain):
        trainer.current_gradient_accumulation_steps = 1
        trainer.compute_loss(trainer.model, _rollout_batch(trainer, top_k=4))
    assert len(op_calls) == 1  # the plain trainer ran TRL's function through the dispatcher
    assert hasattr(module._chunked_jsd_loss, SERVED)
    assert async_serving.unserve(served, find_row(served))
    assert not hasattr(module._chunked_jsd_loss, SERVED)  # the last served trainer is gone
    assert not async_serving.unserve(plain, find_row(plain))


def test_unknown_trl_code_raises(tokenizer, tmp_path, monkeypatch):
    trainer = _async_trainer(tokenizer, tmp_path, [])

    def changed(hidden_valid, lm_head_weight, candidates):  # a TRL whose function takes other parameters
        raise AssertionError("not called")

    monkeypatch.setattr(async_module, "_chunked_jsd_loss", changed)
    with pytest.raises(TRLProtocolError, match="_chunked_jsd_loss has the parameters"):
        async_serving.serve(trainer, find_row(trainer), {})
