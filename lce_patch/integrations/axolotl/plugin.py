"""The axolotl plugin (``lce_patch.integrations.axolotl.LCEPatchPlugin``): the fused loss from two lines of YAML.

    plugins:
      - lce_patch.integrations.axolotl.LCEPatchPlugin

axolotl imports the class named under ``plugins:`` and mixes :class:`LCEPatchArgs` into its config schema, so
the ``lce_patch*`` keys below are validated with axolotl's own. The plugin then

- patches the model axolotl built, after adapters are attached (``post_model_load``: LoRA, QLoRA and
  ``lora_modules_to_save`` work as with :func:`lce_patch.apply_fused_lce`);
- hands the trainer a :class:`~lce_patch.FusedLCECallback`, which serves axolotl's trainer the way it serves
  ``transformers.Trainer`` (evaluation logits exactly where the Trainer needs them; TRL >= 1.15 heads);
- serves the trainer axolotl built through its row of the serving table (``post_trainer_create``): with
  ``kd_trainer: true``, axolotl's KD loss through lce_patch's ops (see ``kd.py``).

The plugin is also registered under the ``axolotl.plugins`` entry point (axolotl >= 0.21 loads those without
a ``plugins:`` line), so it does nothing unless it is on: ``lce_patch: true``, or ``lce_patch`` unset and the
plugin listed under ``plugins:``. Configurations that cannot work are refused when axolotl validates the config,
and so are misspelt ``lce_patch*`` keys (which axolotl would otherwise drop without a word).

Once the model is patched the plugin logs one line at axolotl's default level (INFO), naming the model and the
options in force. axolotl's logging passes INFO only from loggers under ``axolotl``, so the plugin logs through
axolotl's own ``get_logger`` under that name (on the main process only, like axolotl's own messages).

This module imports axolotl and pydantic, so it is imported only by axolotl (never by ``import lce_patch``).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.metadata
import importlib.util
import re
import warnings
from pathlib import Path
from typing import Any, Literal

from axolotl.integrations.base import BasePlugin
from axolotl.utils.logging import get_logger
from pydantic import BaseModel, Field, create_model, model_validator

from ...models import OPTIONS, LCEOptions, option_names
from ..serving import ROWS, serve_trainer

__all__ = ["PACKAGE", "LCEPatchArgs", "LCEPatchPlugin", "is_enabled", "options_from", "patched_line"]

PACKAGE = "lce_patch.integrations.axolotl"  # where users name the plugin (it exports this module's classes)

# Under `axolotl`: axolotl's logging config (axolotl.logging_config) shows INFO from `axolotl.*` loggers only
# (AXOLOTL_LOG_LEVEL); any other logger's INFO is dropped unless LOG_LEVEL is lowered for every library.
LOG = get_logger("axolotl.integrations.lce_patch")

PLUGIN_NAMES = (f"{PACKAGE}.LCEPatchPlugin", f"{PACKAGE}:LCEPatchPlugin")

# axolotl keys that put another loss in the model's place (each patches the loss or the forward itself)
_OTHER_LOSSES = {
    "cut_cross_entropy": "Cut Cross-Entropy's plugin",
    "liger_fused_linear_cross_entropy": "Liger's fused linear cross-entropy",
    "liger_cross_entropy": "Liger's cross-entropy",
    "chunked_cross_entropy": "axolotl's chunked cross-entropy",
}


def _listed(plugins: Any) -> bool:
    return any(str(name) in PLUGIN_NAMES for name in plugins or ())


def is_enabled(cfg: Any) -> bool:
    """Whether the plugin is on for this config (a dict or axolotl's ``DictDefault``)."""
    value = cfg.get("lce_patch")
    return bool(value) if value is not None else _listed(cfg.get("plugins"))


def _head_has_lora(target_modules: Any) -> bool:
    if isinstance(target_modules, str):  # a regular expression over module names, as PEFT takes it
        return "lm_head" in target_modules
    return any(str(name).split(".")[-1] == "lm_head" for name in target_modules or ())


def _conflicts(data: dict[str, Any]) -> list[str]:
    problems = []
    for key, what in _OTHER_LOSSES.items():
        on = data.get(key)
        if key == "cut_cross_entropy" and on is None:  # CCE's own key defaults to on once its plugin is listed
            on = any("CutCrossEntropyPlugin" in str(name) for name in data.get("plugins") or ())
        if on:
            problems.append(f"`{key}` ({what}) also replaces the loss; set `{key}: false` or drop lce_patch")
    if data.get("reward_model") or data.get("process_reward_model"):
        problems.append("reward models have a score head, not an LM head: there is no cross-entropy to fuse")
    if _head_has_lora(data.get("lora_target_modules")) and data.get("peft_use_dora"):
        problems.append(
            "`lora_target_modules` with `peft_use_dora` puts a DoRA adapter on lm_head, which the fused loss does not "
            "compute (plain LoRA on the head it does); keep lm_head out of the targets, or train it fully with "
            "`lora_modules_to_save: [lm_head]`"
        )
    return problems


_LOOKALIKE = re.compile(r"_*lce_*patch_*(.*)")  # lce_patch*, LCE-PATCH-*, lcepatch*, ... (lowercased, - as _)


def _unknown_keys(data: dict[str, Any]) -> list[str]:
    """The config's keys that look like lce_patch's (``lce_patch*``, any case, ``-`` or ``_``) but are not one,
    each with the closest valid key where one is close."""
    valid = list(LCEPatchArgs.model_fields)
    # compared after the shared prefix, which would make any two keys look alike
    tails = {key.removeprefix("lce_patch").lstrip("_"): key for key in valid}
    problems = []
    for key in data:
        if not isinstance(key, str) or key in valid:
            continue
        lookalike = _LOOKALIKE.fullmatch(key.lower().replace("-", "_"))
        if lookalike is None:
            continue
        tail = lookalike.group(1)
        close = difflib.get_close_matches(tail, tails, n=1, cutoff=0.6) or [t for t in tails if tail and tail in t][:1]
        problems.append(f"`{key}`" + (f" (did you mean `{tails[close[0]]}`?)" if close else ""))
    return problems


class _PluginArgs(BaseModel):
    """The plugin's own key, and the check of every ``lce_patch*`` key (the options' keys are added from the
    options registry, :data:`lce_patch.models.OPTIONS`, as :class:`LCEPatchArgs`)."""

    lce_patch: bool | None = Field(
        default=None,
        json_schema_extra={"description": "Train with lce_patch's fused loss (default: on when the plugin is listed)."},
    )

    @model_validator(mode="before")
    @classmethod
    def check_lce_patch(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        unknown = _unknown_keys(data)
        if unknown:  # whether the plugin is on or not: a misspelt key is a mistake either way
            raise ValueError(
                f"lce_patch: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; the plugin's keys "
                f"are {', '.join(LCEPatchArgs.model_fields)}"
            )
        if not is_enabled(data):
            return data
        problems = _conflicts(data)
        if problems:
            raise ValueError(
                "lce_patch: this configuration cannot train with the fused loss:\n- " + "\n- ".join(problems)
            )
        data["lce_patch"] = True
        if data.get("rl"):
            _warn_if_unfused(data["rl"])
        return data


_KEY_TYPES = {"int | None": int, "bool": bool, "bool | None": bool}  # the options' field types, as YAML values
_FIELD_TYPES = {field.name: field.type for field in dataclasses.fields(LCEOptions)}


def _key(name: str) -> tuple[Any, Any]:
    """The pydantic field of option ``name``'s key: unset by default (the option's default then holds)."""
    option = OPTIONS[name]
    kind = Literal[option.choices] if option.choices else _KEY_TYPES[_FIELD_TYPES[name]]
    bounds = {"gt": 0} if kind is int else {}  # the only integer key is a size
    return kind | None, Field(default=None, json_schema_extra={"description": option.doc}, **bounds)


AXOLOTL_KEYS = {name: f"lce_patch_{name}" for name in option_names(axolotl=True)}
"""The options the plugin's keys set, each with its key."""

LCEPatchArgs = create_model(
    "LCEPatchArgs", __base__=_PluginArgs, __module__=__name__, **{key: _key(name) for name, key in AXOLOTL_KEYS.items()}
)
LCEPatchArgs.__doc__ = "The YAML keys of the lce_patch plugin (validated by axolotl with its own)."


def _trl_has_fused_heads() -> bool:
    try:
        from trl.trainer.utils import add_fused_lm_head  # noqa: F401 (TRL >= 1.15)
    except ImportError:
        return False
    return True


# `rl:` modes whose trainer derives from one of TRL's experimental trainers served by FusedLCECallback (ORPOTrainer,
# CPOTrainer: their log-probabilities through the fused op on any TRL whose methods it recognises, TRL 1.9 and 1.16
# checked; it raises when the trainer is built with a TRL it does not), each with the package that trainer lives in;
# from the serving table. DPO, IPO, KTO and GRPO are fused through TRL's fused-LM-head protocol (TRL >= 1.15).
_EXPERIMENTAL_RL = {mode: row.module.rsplit(".", 1)[0] for row in ROWS for mode in row.axolotl_rl}


def _has_module(name: str) -> bool:
    """Whether the package ``trl.<...>`` is installed, found on disk (importing ``trl.experimental`` warns)."""
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        return False
    parts = name.split(".")[1:]
    return any(Path(root, *parts, "__init__.py").is_file() for root in spec.submodule_search_locations)


def _warn_if_unfused(rl: Any) -> None:
    """Warn when axolotl's ``rl:`` trainer, with the installed TRL, computes its loss from the full logits."""
    mode = str(getattr(rl, "value", rl))
    module = _EXPERIMENTAL_RL.get(mode)
    if module is not None:
        if _has_module(module):
            return
        reason = f"it has no `{module}`, the trainer lce_patch serves for this mode"
    elif _trl_has_fused_heads():
        return
    else:
        reason = (
            "its trainer scores the sequences from the full [tokens x vocabulary] logits of a forward without labels, "
            "which lce_patch fuses through TRL's fused-LM-head protocol (TRL >= 1.15)"
        )
        if all(_has_module(name) for name in _EXPERIMENTAL_RL.values()):
            reason += "; `rl: orpo` and `rl: simpo` do train fused with this TRL"
    try:
        trl_version = importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        trl_version = "(not installed)"
    LOG.warning(
        "lce_patch: `rl: %s` trains with TRL %s, and %s. The model's patch is taken off for this training, which runs "
        "unfused, with the losses of a run without the plugin.",
        mode,
        trl_version,
        reason,
    )


def options_from(cfg: Any) -> dict[str, Any]:
    """The :func:`lce_patch.apply_fused_lce` options the config's ``lce_patch_*`` keys ask for."""
    return {option: cfg.get(key) for option, key in AXOLOTL_KEYS.items() if cfg.get(key) is not None}


def patched_line(model: Any) -> str:
    """The one line logged once ``model`` is patched: the model, and the options the plugin sets, as in force."""
    from ...models import OPTIONS_ATTR, unwrap_causal_lm

    inner = unwrap_causal_lm(model)
    opts = getattr(inner, OPTIONS_ATTR)
    what = f"{type(inner).__name__} (model_type {getattr(inner.config, 'model_type', None)}"
    what += f", in {type(model).__name__})" if inner is not model else ")"
    shown = {name: getattr(opts, name) for name in AXOLOTL_KEYS}
    shown = {name: "auto" if value is None else value for name, value in shown.items()}
    return f"lce_patch: patched {what} to train with the fused linear cross-entropy: " + ", ".join(
        f"{name}={value}" for name, value in shown.items()
    )


class LCEPatchPlugin(BasePlugin):
    """axolotl plugin: patch the loaded model with :func:`lce_patch.apply_fused_lce` and serve the trainer."""

    def get_input_args(self) -> str:
        return f"{PACKAGE}.LCEPatchArgs"

    def post_model_load(self, cfg: Any, model: Any) -> None:
        # After adapters are attached; axolotl also calls this for a separately loaded reference model.
        if not is_enabled(cfg):
            return
        from ...models import apply_fused_lce, unannounced

        with unannounced():  # this line instead, through axolotl's logging
            apply_fused_lce(model, **options_from(cfg))
        LOG.info(patched_line(model))

    def add_callbacks_pre_trainer(self, cfg: Any, model: Any) -> list:
        if not is_enabled(cfg):
            return []
        from ..trainer import FusedLCECallback

        callback = FusedLCECallback(**options_from(cfg))
        callback.announce = False  # post_model_load's line said it
        return [callback]

    def post_trainer_create(self, cfg: Any, trainer: Any) -> None:
        # the trainer's row served by the plugin (`kd_trainer: true`: axolotl's KD loss), its warnings on axolotl's log
        if not is_enabled(cfg):
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            served = serve_trainer(trainer, options_from(cfg), when="plugin")
        for warning in caught:
            if str(warning.message).startswith("lce_patch:"):
                LOG.warning(str(warning.message))
            else:
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
        if served:
            LOG.info("lce_patch: axolotl's KD loss runs through fused_linear_sparse_divergence and the fused CE")
