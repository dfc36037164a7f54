"""On a TRL without the fused-LM-head protocol (TRL < 1.15), TRL's SFT, DPO, KTO, GRPO and RLOO trainers run on TRL's
own unfused path, named in a warning, while the transformers Trainer stays fused (test_trainer_callback.py runs it
on the installed TRL). The table and the serving are checked on any TRL (the protocol's absence stood in for on a
newer one); a real SFT run on a TRL that old.

CPU, a tiny Llama built from a config, a word-level tokenizer built offline: no downloads.
"""

from __future__ import annotations

import warnings

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from lce_patch import FusedLCECallback, is_patched  # noqa: E402
from lce_patch.integrations import serving  # noqa: E402
from lce_patch.integrations.trl import protocol, unserved  # noqa: E402
from tests.models.tiny import COMMON_CONFIG  # noqa: E402

VOCAB = 64


@pytest.fixture
def without_fused_head(monkeypatch):
    """TRL as it is below 1.15 (no ``add_fused_lm_head``): the installed one where it is that old."""
    if protocol.has_fused_lm_head():
        monkeypatch.setattr(protocol, "has_fused_lm_head", lambda: False)
    unserved._warned.clear()
    yield
    unserved._warned.clear()


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, **{f"w{i}": i + 4 for i in range(VOCAB - 4)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = dict(COMMON_CONFIG, vocab_size=VOCAB, max_position_embeddings=128, pad_token_id=0, eos_token_id=1)
    return LlamaForCausalLM(LlamaConfig(**{**config, "bos_token_id": 2}))


def test_head_rows_are_trls_own_path(without_fused_head):
    from trl import SFTTrainer

    row = serving.find_row(SFTTrainer)
    assert (
        row.serving == unserved.__name__ and row.when == "init" and row.key == ("trl.trainer.sft_trainer", "SFTTrainer")
    )
    assert serving.find_row(SFTTrainer) is row  # one row per class
    assert "TRL < 1.15" in row.how


def test_serving_warns_and_reverts_the_patch_before_the_loss(without_fused_head):
    from trl import SFTTrainer

    from lce_patch import apply_fused_lce

    class Stub(SFTTrainer):  # a bare trainer: serving reads its class and its model
        def compute_loss(self, model, inputs, **kwargs):
            return model(**inputs)

    trainer = object.__new__(Stub)
    trainer.model = apply_fused_lce(_model(), backend="torch")
    with pytest.warns(UserWarning, match=r"has no fused LM head .* its SFTTrainer reads the model's full logits"):
        assert serving.serve_trainer(trainer, {}) is False
    assert is_patched(trainer.model)
    ids = torch.randint(4, VOCAB, (2, 8))
    trainer.model.train()
    outputs = trainer.compute_loss(trainer.model, {"input_ids": ids, "labels": ids})
    assert not is_patched(trainer.model) and outputs.logits.shape == (2, 8, VOCAB)  # TRL reads the logits
    assert serving.unserve_trainer(trainer) is True and "compute_loss" not in vars(trainer)


@pytest.mark.skipif(
    protocol.has_fused_lm_head(), reason="a real SFT run needs a TRL without the fused LM head (< 1.15)"
)
def test_sft_trains_unfused_with_a_warning(without_fused_head, tmp_path):
    from trl import SFTConfig, SFTTrainer

    rows = [" ".join(f"w{(i * 7 + j) % (VOCAB - 4)}" for j in range(10)) for i in range(8)]
    args = SFTConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=4,
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        seed=0,
    )
    callback = FusedLCECallback()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = SFTTrainer(
            model=_model(),
            args=args,
            train_dataset=datasets.Dataset.from_dict({"text": rows}),
            processing_class=_tokenizer(),
            callbacks=[callback],
        )
        trainer.train()
    messages = [str(w.message) for w in caught if "lce_patch" in str(w.message)]
    assert any("has no fused LM head" in m and "SFTTrainer" in m and "TRL's own unfused path" in m for m in messages)
    assert not is_patched(trainer.model)  # TRL's own path: the model's own forward and logits
    assert callback.outcomes and not callback.outcomes[0]["fused"]
    assert all(torch.isfinite(torch.tensor(log["loss"])) for log in trainer.state.log_history if "loss" in log)
    assert serving.unserve_trainer(trainer) is True and "compute_loss" not in vars(trainer)
