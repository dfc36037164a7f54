"""``FusedLCECallback``: one line to train any ``transformers.Trainer`` with the fused loss.

    trainer = Trainer(model=model, args=args, ..., callbacks=[FusedLCECallback()])

The model (or the model under a PEFT wrapper) is patched with :func:`lce_patch.apply_fused_lce` at the
end of ``Trainer.__init__``, before accelerate prepares it, so the loss runs inside the model's
forward under DDP, FSDP and DeepSpeed.

Evaluation gives what the unpatched model gives: the Trainer's evaluation and prediction steps that
need the logits (``predict()``, ``compute_metrics``, ``prediction_loss_only=False``) get them beside the
fused loss, and the steps that need the loss only (``evaluate()`` without ``compute_metrics``) run
without building them (``lce_patch.models.loss_only``). ``return_logits_in_eval=True`` always builds
them; ``return_logits_in_eval=False`` never does, and a trainer that needs them is refused.

Trainers whose loss does not go through the model's forward are served through their row of the serving table
(``lce_patch.integrations.serving.serve_trainer``), at the end of ``Trainer.__init__`` and again when training
starts: TRL's fused LM head (SFT, DPO, KTO, GRPO, RLOO, including the reference-log-prob precompute DPO and KTO run
inside ``__init__``), its distillation trainers, its experimental ORPO, CPO, TPO, Online DPO and A2PO trainers (their
loss or log-probabilities through lce_patch's ops), and a warning for the experimental trainers left on TRL's path.

When the first optimizer step of a training run ends, the callback logs one line on the ``lce_patch`` logger, at
the level the Trainer shows its warnings (WARNING unless transformers' verbosity is raised), on the main process
only: the model, its architecture entry and softcap, the trainer and how its loss reaches the fused op, and the
options. The line is said only if lce_patch's fused ops ran in that step (their calls are counted,
``lce_patch.ops.op_calls``); where they did not (the trainer's loss never reached the patched forward) a warning
says that it trains unfused instead. ``outcomes`` keeps, per training run, what was found (the launcher's
report reads it).
"""

from __future__ import annotations

import functools
import inspect
import logging
import warnings
from typing import Any

import torch
from transformers import PreTrainedModel, Trainer, TrainerCallback

from ..models import (
    EXTRA_OUTPUTS,
    OPTIONS_ATTR,
    LCEOptions,
    apply_fused_lce,
    fsdp1_inner,
    is_patched,
    loss_only,
    options_text,
    patch_summary,
    unannounced,
    unwrap_causal_lm,
)
from ..ops import calls_since, op_calls
from .serving import SERVED, find_row, serve_trainer

logger = logging.getLogger(__name__)


def _liger_fuses_the_loss(args: Any) -> bool:
    if not getattr(args, "use_liger_kernel", False):
        return False
    config = getattr(args, "liger_kernel_config", None) or {}
    return bool(config.get("fused_linear_cross_entropy", True))


def _running_trainer(callback: TrainerCallback) -> Trainer | None:
    """The Trainer whose callback handler is running an event of ``callback``, found on the call stack.

    Callbacks are given the model, not the trainer; TRL trainers keep their reference model on the
    trainer (``trainer.ref_model``), and it needs its fused head served too.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, Trainer) and callback in getattr(owner.callback_handler, "callbacks", ()):
                return owner
            frame = frame.f_back
        return None
    finally:
        del frame


def _ignoring_extra_outputs(trainer: Trainer, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """``prediction_step``'s arguments with ``lse`` and ``token_accuracy`` added to its ``ignore_keys``: the Trainer
    hands every output but the loss to ``compute_metrics`` as the predictions, where they would join the logits."""
    if args:
        ignore_keys, args = args[0], args[1:]
    else:
        ignore_keys = kwargs.pop("ignore_keys", None)
    if ignore_keys is None:  # the Trainer's own default
        config = getattr(trainer.model, "config", None)
        ignore_keys = getattr(config, "keys_to_ignore_at_inference", ["cache"]) if config is not None else []
    kwargs["ignore_keys"] = [*ignore_keys, *(name for name in EXTRA_OUTPUTS if name not in ignore_keys)]
    return args, kwargs


class FusedLCECallback(TrainerCallback):
    """Patch the Trainer's model with :func:`lce_patch.apply_fused_lce` (options as there).

    Subclasses (e.g. for TRL trainers) extend :meth:`install_trainer_heads`, which runs at
    ``on_train_begin``, once the trainer has finished setting its model up.

    When training starts it logs one line saying that the fused loss is on and how (see the module's notes);
    ``announce = False`` on the instance leaves it out (the axolotl plugin logs its own).
    """

    announce: bool = True

    def __init__(self, **options: Any) -> None:
        LCEOptions.from_kwargs(options)  # fail at construction on a bad option
        self.options = dict(options)
        self._served_by: str | None = None  # how its row routed the trainer's own loss at init, in words
        self._announced: set[int] = set()  # ids of the models whose line was logged
        self._pending: tuple | None = None  # (model, trainer, line, op calls before) until the first step ends
        self.outcomes: list[dict[str, Any]] = []  # per training run: whether the fused ops ran in its first step

    def check_args(self, args: Any) -> None:
        """Refuse TrainingArguments that would bypass or break the fused loss."""
        if _liger_fuses_the_loss(args):
            raise ValueError(
                "lce_patch: FusedLCECallback and use_liger_kernel with Liger's fused linear cross-entropy both "
                "replace the model's forward; Liger's would silently win. Set "
                "liger_kernel_config={'fused_linear_cross_entropy': False} to keep Liger's other kernels, or drop "
                "the callback."
            )
        if getattr(args, "label_smoothing_factor", 0.0):
            raise ValueError(
                "lce_patch: TrainingArguments.label_smoothing_factor needs the logits, which the fused loss never "
                "builds. Use FusedLCECallback(label_smoothing=...) instead and set label_smoothing_factor=0."
            )

    def patch_model(self, model: torch.nn.Module | None) -> None:
        """Patch ``model`` (a Hugging Face model or a PEFT model around one) unless it already is."""
        if model is None or not isinstance(unwrap_causal_lm(model), PreTrainedModel):
            return  # e.g. an FSDP1 wrapper at on_train_begin: what it wraps was patched at on_init_end
        if OPTIONS_ATTR not in vars(unwrap_causal_lm(model)):  # an instance patch, not only a class one
            with unannounced():  # the callback's own line says it, when training starts
                apply_fused_lce(model, **self.options)

    def install_trainer_heads(
        self, model: torch.nn.Module | None, args: Any = None, trainer: Trainer | None = None
    ) -> bool:
        """Serve, through the trainer's row of the serving table, what a trainer installs after ``__init__``: TRL's
        fused LM head (TRL >= 1.15: SFT, DPO, KTO, GRPO, RLOO and the async GRPO trainer put one on the policy and on
        ``trainer.ref_model``).

        Returns whether the policy has such a head (now run through lce_patch's op); the reference model's head, if
        any, is served as well. With SFT's plain NLL loss (``loss_type="nll"``, TRL's default) the op precomputes the
        gradient of that loss in the forward (see ``fused_linear_log_probs(precompute_grad=True)``).
        """
        if model is None or trainer is None:
            return False
        return serve_trainer(trainer, self.options, when="train")

    def check_trainer(self, trainer: Trainer | None) -> None:
        """Warn where the trainer bypasses the fused loss; refuse one that needs evaluation logits when
        ``return_logits_in_eval=False`` was asked for."""
        if trainer is None:
            return
        if getattr(trainer, "compute_loss_func", None) is not None:
            warnings.warn(
                "lce_patch: the Trainer was given a compute_loss_func, so it calls the model without labels and "
                "computes the loss from the logits itself: training runs unfused, with the full [tokens x "
                "vocabulary] logits. Drop compute_loss_func to train with the fused loss.",
                stacklevel=2,
            )
        if self.options.get("return_logits_in_eval") is not False:
            return
        needs = [name for name in ("compute_metrics", "preprocess_logits_for_metrics") if getattr(trainer, name, None)]
        if needs:
            raise ValueError(
                f"lce_patch: the Trainer has {' and '.join(needs)}, which need the evaluation logits, but "
                "FusedLCECallback was given return_logits_in_eval=False. Drop that option (the callback then returns "
                "the logits exactly where the Trainer needs them) or set it to True."
            )

    def serve_trainer(self, trainer: Trainer | None) -> None:
        """Wrap, on this trainer instance, the evaluation step (logits only where the Trainer needs them); then serve
        the trainer through its row of the serving table at the end of ``Trainer.__init__``."""
        if trainer is None:
            return
        callback = self
        step = trainer.prediction_step
        if getattr(step, SERVED, None) is None:

            @functools.wraps(step)
            def prediction_step(model, inputs, prediction_loss_only, *args, **kwargs):
                if not prediction_loss_only and callback.options.get("return_logits_in_eval") is False:
                    raise ValueError(
                        "lce_patch: this evaluation needs the logits (Trainer.predict(), or prediction_loss_only="
                        "False), but FusedLCECallback was given return_logits_in_eval=False. Drop that option or "
                        "set it to True."
                    )
                if not prediction_loss_only and any(callback.options.get(f"return_{name}") for name in EXTRA_OUTPUTS):
                    args, kwargs = _ignoring_extra_outputs(trainer, args, kwargs)
                with loss_only(bool(prediction_loss_only)):
                    return step(model, inputs, prediction_loss_only, *args, **kwargs)

            setattr(prediction_step, SERVED, step)
            trainer.prediction_step = prediction_step
        row = find_row(trainer, "init")
        if serve_trainer(trainer, self.options, when="init"):
            self._served_by = row.route
        elif row is not None and not row.served:
            self._served_by = ""  # warned: it trains as without the callback

    def announce_line(self, model: torch.nn.Module | None, trainer: Trainer | None, trl_head: bool) -> str | None:
        """The line logged when training starts: the model, the trainer and the path its loss takes to the fused
        op, the options; None where the loss does not reach it (a warning said why) or the model is not patched."""
        if model is None or self._served_by == "" or getattr(trainer, "compute_loss_func", None) is not None:
            return None
        model = fsdp1_inner(model)  # FSDP1 wraps the model before training starts
        inner = unwrap_causal_lm(model)
        if not isinstance(inner, PreTrainedModel) or not (trl_head or is_patched(inner)):
            return None
        head_row = find_row(trainer, "train") if trl_head else None
        if head_row is not None:
            how = head_row.route
        else:
            how = self._served_by or "the model's forward runs fused_linear_cross_entropy"
        options = options_text(LCEOptions.from_kwargs(self.options))
        name = type(trainer).__name__ if trainer is not None else "the trainer"
        return f"lce_patch: {name} trains {patch_summary(model)} with the fused loss ({how}); {options}"

    def on_init_end(self, args, state, control, model=None, **kwargs):
        self.check_args(args)
        trainer = _running_trainer(self)
        self.check_trainer(trainer)
        self.patch_model(model)
        self.serve_trainer(trainer)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.check_args(args)
        # TRL's head first: patching its forward from outside (a callback added after __init__)
        # would replace the head that SFTTrainer.compute_loss calls with fused_lm_head=True.
        trainer = _running_trainer(self)
        trl_head = self.install_trainer_heads(model, args, trainer)
        if not trl_head:
            self.patch_model(model)  # a model built by model_init at train() was not there at on_init_end
        if model is not None and id(model) not in self._announced:
            # said once the first optimizer step shows whether the fused ops ran (on_step_end), never before
            self._pending = (model, trainer, self.announce_line(model, trainer, trl_head), op_calls())

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self._pending is None:
            return
        model, trainer, line, before = self._pending
        self._pending = None
        self._announced.add(id(model))
        calls = calls_since(before)
        outcome = {
            "trainer": type(trainer).__name__ if trainer is not None else None,
            "model": type(unwrap_causal_lm(fsdp1_inner(model))).__name__,
            "fused": line is not None and bool(calls),
            "line": line,
            "op_calls": calls,
        }
        if line is not None and not calls:
            line = outcome["line"] = (
                f"lce_patch: {outcome['trainer'] or 'the trainer'} trains {outcome['model']} WITHOUT the fused loss: "
                "its first training step called none of lce_patch's fused ops, so its loss is computed outside the "
                "model's patched forward (a compute_loss that takes the labels out of the call, or a trainer lce_patch "
                "does not serve); it trains as without the callback, with the full logits"
            )
            warnings.warn(line, stacklevel=2)
        self.outcomes.append(outcome)
        if line is not None and outcome["fused"] and self.announce:
            # where the Trainer shows its own warnings (transformers' verbosity, or log_level): main process only
            level = args.get_process_log_level() if hasattr(args, "get_process_log_level") else logging.WARNING
            shown = getattr(state, "is_world_process_zero", True) and level <= logging.WARNING
            logger.log(logging.WARNING if shown else logging.DEBUG, line)
