"""The serving table: for each trainer class lce_patch serves, the module that serves it, when, and how.

Each :class:`Row` names a trainer class by module and name (nothing is imported to read the table), the module
that serves it (imported only for a trainer of that class), when it is served and the ops its loss then runs. The
serving module follows one protocol, :class:`Serving`: ``serve(trainer, row, options) -> bool`` puts lce_patch's op
in the trainer's loss, on that instance only, and ``unserve(trainer, row) -> bool`` puts back exactly what was there;
both are handed their row, so the module reads the class it serves from it. Whatever lce_patch puts in a trainer's,
a model's or a module's place carries one marker attribute, :data:`SERVED`.

One function serves every trainer, :func:`serve_trainer`, at each of the moments a row names: ``"init"`` (the end of
``Trainer.__init__``, ``FusedLCECallback.on_init_end``), ``"train"`` (TRL's fused LM head, which TRL installs after
``__init__``: ``FusedLCECallback.on_train_begin``) and ``"plugin"`` (the axolotl plugin, once axolotl has built the
trainer). At each moment :func:`find_row` walks the trainer's MRO once and returns the row of the most derived class
that has one for that moment, so a subclass of a served trainer is served as its base, and a served class deriving
from another served class (GKD from SFT) gets its own row, while the fused head SFT's ``__init__`` puts on its
model is still served at ``"train"`` by SFT's row. On a TRL without the fused-LM-head protocol (TRL < 1.15),
:func:`find_row` gives the ``"train"`` rows as TRL's own path, warned about at ``"init"``. The Trainer and TRL page's
trainer table and the axolotl plugin's list of preference modes are generated from :data:`ROWS`.

This module imports nothing beyond the standard library.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

__all__ = [
    "ANY_FUSED_HEAD",
    "ROWS",
    "SERVED",
    "Row",
    "Serving",
    "When",
    "base_class",
    "find_row",
    "mro_lookup",
    "serve_trainer",
    "unserve_trainer",
    "without_fused_head",
]

SERVED = "__lce_patch_served__"
"""The marker set on every function lce_patch puts in a trainer's, a model's or a module's place; its value is
what the function stands in for."""

_T = TypeVar("_T")


When = Literal["init", "train", "plugin"]
"""The moments a trainer is served at (see the module's notes)."""


class Serving(Protocol):
    """What a serving module provides (one module per trainer family, e.g. ``lce_patch.integrations.trl.tpo``).

    A module may also define ``prepare(trainer, row, options) -> None``, called at the end of ``Trainer.__init__`` for
    a row served later (``"train"``), for work the trainer's own ``__init__`` does after that point and that must
    already run fused (TRL's DPO and KTO score their reference model there)."""

    def serve(self, trainer: Any, row: Row, options: dict[str, Any]) -> bool:
        """Serve ``trainer`` (an instance of ``row``'s class) with the fused op (``options``: ``FusedLCECallback``'s);
        whether it is served. Idempotent; a subclass that overrides what is replaced is left alone, with a warning."""
        ...

    def unserve(self, trainer: Any, row: Row) -> bool:
        """Undo :meth:`serve` on ``trainer`` exactly; whether it was served."""
        ...


@dataclass(frozen=True)
class Row:
    """One served (or knowingly unserved) trainer class.

    Attributes:
        module: the module that defines the class (``cls.__module__``).
        name: the class's name.
        serving: the module implementing :class:`Serving` for it; None where nothing serves it (``how`` says why).
        when: ``"init"``: ``FusedLCECallback`` at the end of ``Trainer.__init__``; ``"train"``: TRL's fused LM head,
            served at ``on_train_begin``; ``"plugin"``: the axolotl plugin once the trainer is built; None: not served.
        how: how it is served, for the docs' trainer table.
        tested: what the tests run, for the docs' trainer table.
        axolotl_rl: axolotl's ``rl:`` modes whose trainer derives from this class and is served by this row.
        ops: the fused ops its loss runs once served (none: it trains on its own path); the callback's line names them.
        variant: which of its serving module's variants serves it, where one module serves several classes.
    """

    module: str
    name: str
    serving: str | None
    when: When | None
    how: str
    tested: str
    axolotl_rl: tuple[str, ...] = ()
    ops: tuple[str, ...] = ()
    variant: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        return self.module, self.name

    @property
    def served(self) -> bool:
        """Whether serving puts lce_patch's ops in the trainer's loss (False: it warns, or nothing serves it)."""
        return bool(self.ops)

    @property
    def route(self) -> str:
        """How the trainer's loss reaches the fused ops, in words (for ``FusedLCECallback``'s line)."""
        ops = " and ".join(self.ops)
        return f"TRL's fused LM head runs {ops}" if self.when == "train" else f"its loss runs {ops}"

    def load(self) -> Serving | None:
        """The serving module (imported now), or None for a row nothing serves."""
        return None if self.serving is None else importlib.import_module(self.serving)

    def base_of(self, obj: Any) -> type | None:
        """This row's class among the bases of ``obj``'s class (``obj`` itself if a class), or None."""
        return base_class(obj, self.module, self.name)


_HEAD = "lce_patch.integrations.trl.head"
_UNSERVED = "lce_patch.integrations.trl.unserved"
_PROTOCOL = "lce_patch.integrations.trl.protocol"
_NO_HEAD_HOW = "TRL's own path, with a warning: TRL < 1.15 has no fused LM head to serve (its model left unpatched)"
_HEAD_HOW = "TRL's fused head, policy and reference, served by lce_patch's op"
_LOG_PROBS = "Fused by lce_patch: `fused_linear_log_probs`"
_UNSERVED_HOW = (
    "TRL's path, with a warning: each loss reads the student's full logits (`model(...).logits`), some over the whole "
    "vocabulary distribution (divergences to a teacher), which this version does not replace"
)
_SPARSE_HOW = "Fused by lce_patch: `fused_linear_sparse_divergence` (the teacher's top-K)"
_SPARSE_TESTED = "yes (the vLLM teacher stood in for)"

_LOG_PROBS_OPS = ("fused_linear_log_probs",)
_DIVERGENCE_OPS = ("fused_linear_divergence",)
_SPARSE_OPS = ("fused_linear_sparse_divergence",)

ROWS: tuple[Row, ...] = (
    Row("trl.trainer.sft_trainer", "SFTTrainer", _HEAD, "train", "TRL's fused head, served by lce_patch's op (the NLL's gradient precomputed)", "yes", ops=_LOG_PROBS_OPS),
    Row("trl.trainer.dpo_trainer", "DPOTrainer", _HEAD, "train", _HEAD_HOW, "yes", ops=_LOG_PROBS_OPS),
    Row("trl.experimental.bema_for_ref_model.dpo_trainer", "DPOTrainer", _HEAD, "train", "DPO's path (TRL's fused head), served by lce_patch's op", "no", ops=_LOG_PROBS_OPS),
    Row("trl.trainer.kto_trainer", "KTOTrainer", _HEAD, "train", _HEAD_HOW, "yes", ops=_LOG_PROBS_OPS),
    Row("trl.experimental.kto", "KTOTrainer", _HEAD, "train", "KTO's path (TRL's fused head), served by lce_patch's op", "no", ops=_LOG_PROBS_OPS),
    Row("trl.trainer.grpo_trainer", "GRPOTrainer", _HEAD, "train", _HEAD_HOW, "yes", ops=_LOG_PROBS_OPS),
    Row("trl.trainer.rloo_trainer", "RLOOTrainer", _HEAD, "train", _HEAD_HOW, "yes", ops=_LOG_PROBS_OPS),
    Row("trl.experimental.gmpo.gmpo_trainer", "GMPOTrainer", _HEAD, "train", "GRPO's path (TRL's fused head), served by lce_patch's op", "no", ops=_LOG_PROBS_OPS),
    Row("trl.experimental.async_grpo.async_grpo_trainer", "AsyncGRPOTrainer", _HEAD, "train", "TRL's fused head, served by lce_patch's op", "no (needs vLLM or a rollout worker)", ops=_LOG_PROBS_OPS),
    Row("trl.trainer.distillation_trainer", "DistillationTrainer", "lce_patch.integrations.trl.distillation", "init", "Fused by lce_patch: `fused_linear_divergence`", "yes", ops=_DIVERGENCE_OPS),
    Row("trl.experimental.gkd.gkd_trainer", "GKDTrainer", "lce_patch.integrations.trl.gkd", "init", "Fused by lce_patch: `fused_linear_divergence`", "yes", ops=_DIVERGENCE_OPS),
    Row("trl.experimental.orpo.orpo_trainer", "ORPOTrainer", "lce_patch.integrations.trl.preference", "init", _LOG_PROBS, "yes", ("orpo",), ops=_LOG_PROBS_OPS, variant="orpo"),
    Row("trl.experimental.cpo.cpo_trainer", "CPOTrainer", "lce_patch.integrations.trl.preference", "init", _LOG_PROBS, "yes", ("simpo",), ops=_LOG_PROBS_OPS, variant="cpo"),
    Row("trl.experimental.tpo.tpo_trainer", "TPOTrainer", "lce_patch.integrations.trl.tpo", "init", _LOG_PROBS, "yes", ops=_LOG_PROBS_OPS),
    Row("trl.experimental.online_dpo.online_dpo_trainer", "OnlineDPOTrainer", "lce_patch.integrations.trl.online_dpo", "init", _LOG_PROBS, "yes", ops=_LOG_PROBS_OPS),
    Row("trl.experimental.a2po.a2po_trainer", "A2POTrainer", "lce_patch.integrations.trl.a2po", "init", _LOG_PROBS, "yes", ops=_LOG_PROBS_OPS),
    Row("trl.experimental.gold.gold_trainer", "GOLDTrainer", _UNSERVED, "init", _UNSERVED_HOW, "the warning"),
    Row("trl.experimental.sdft.sdft_trainer", "SDFTTrainer", _UNSERVED, "init", _UNSERVED_HOW, "the warning"),
    Row("trl.experimental.sdpo.sdpo_trainer", "SDPOTrainer", _UNSERVED, "init", _UNSERVED_HOW, "the warning"),
    Row("trl.experimental.iw_opd.iw_opd_trainer", "IWOPDTrainer", _UNSERVED, "init", _UNSERVED_HOW, "the warning"),
    Row("trl.experimental.async_distillation.async_distillation_trainer", "AsyncDistillationTrainer", "lce_patch.integrations.trl.async_distillation", "init", _SPARSE_HOW, _SPARSE_TESTED, ops=_SPARSE_OPS),
    Row("trl.experimental.server_distillation.server_distillation_trainer", "ServerDistillationTrainer", "lce_patch.integrations.trl.server_distillation", "init", _SPARSE_HOW, _SPARSE_TESTED, ops=_SPARSE_OPS),
    Row("trl.trainer.reward_trainer", "RewardTrainer", None, None, "Refused: a sequence-classification model has no LM head to fuse (the error names the `*ForCausalLM` class); train it without the callback", "no"),
    Row("axolotl.integrations.kd.trainer", "AxolotlKDTrainer", "lce_patch.integrations.axolotl.kd", "plugin", "Fused by lce_patch: `fused_linear_cross_entropy` and `fused_linear_sparse_divergence` (`kd_trainer: true`)", "yes (axolotl 0.19)", ops=("fused_linear_cross_entropy", "fused_linear_sparse_divergence")),
)  # fmt: skip

_BY_CLASS: dict[tuple[str, str], Row] = {row.key: row for row in ROWS}

ANY_FUSED_HEAD = Row("transformers.trainer", "Trainer", _HEAD, "train", _HEAD_HOW, "yes", ops=_LOG_PROBS_OPS)
"""The ``"train"`` row of a trainer whose classes have none (a trainer of TRL's this table does not name yet, or a
program's own): TRL's fused head is served wherever its model carries one (the head module serves nothing
otherwise). Not in :data:`ROWS`: it names no trainer for the docs' table."""


def mro_lookup(cls: type, table: Mapping[tuple[str, str], _T]) -> tuple[type, _T] | None:
    """The first class of ``cls``'s MRO (the most derived) whose ``(module, name)`` is in ``table``, and its entry.

    Classes are matched by module and name, so nothing is imported to find them."""
    for base in cls.__mro__:
        entry = table.get((base.__module__, base.__name__))
        if entry is not None:
            return base, entry
    return None


def base_class(obj: Any, module: str, name: str) -> type | None:
    """The class ``module.name`` among the bases of ``obj``'s class (``obj`` itself if a class), or None."""
    found = mro_lookup(obj if isinstance(obj, type) else type(obj), {(module, name): True})
    return None if found is None else found[0]


def find_row(trainer: Any, when: When | None = None) -> Row | None:
    """The row of the most derived class of ``trainer`` (an instance or a class) that has one, or None; with
    ``when``, the most derived row served at that moment.

    A row served by TRL's fused LM head, on a TRL without that protocol (TRL < 1.15), comes back as TRL's own path
    (:func:`without_fused_head`). At ``"train"``, a trainer none of whose classes has a row then gets
    :data:`ANY_FUSED_HEAD` where TRL has that protocol."""
    for base in trainer.__mro__ if isinstance(trainer, type) else type(trainer).__mro__:
        row = _BY_CLASS.get((base.__module__, base.__name__))
        if row is None:
            continue
        if row.serving == _HEAD and not importlib.import_module(_PROTOCOL).has_fused_lm_head():
            row = without_fused_head(row)
        if when is None or row.when == when:
            return row
    if when == "train" and importlib.import_module(_PROTOCOL).has_fused_lm_head():
        return ANY_FUSED_HEAD
    return None


@functools.cache
def without_fused_head(row: Row) -> Row:
    """A fused-head row as served on a TRL without the fused-LM-head protocol (TRL < 1.15): by ``unserved``, at the
    end of ``Trainer.__init__``, which warns and leaves the trainer on TRL's own path."""
    return dataclasses.replace(row, serving=_UNSERVED, when="init", how=_NO_HEAD_HOW, ops=())


def serve_trainer(trainer: Any, options: dict[str, Any], when: When | None = None) -> bool:
    """Serve ``trainer`` through its row; whether it is served. The one way a trainer is served.

    ``when``: the moment it is called at (``FusedLCECallback`` at ``"init"`` and ``"train"``, the axolotl plugin at
    ``"plugin"``): the row served then, and at ``"init"`` the ``prepare`` of the row served later, where its module
    has one. None: the trainer's row, whatever its moment (for a trainer built without the callback)."""
    if when == "init":
        later = find_row(trainer, "train")
        prepare = getattr(later.load(), "prepare", None) if later is not None else None
        if prepare is not None:
            prepare(trainer, later, dict(options))
    row = find_row(trainer, when)
    serving = None if row is None else row.load()
    return False if serving is None else serving.serve(trainer, row, dict(options))


def unserve_trainer(trainer: Any, when: When | None = None) -> bool:
    """Undo what serving did to ``trainer`` (its loss methods, TRL's fused head on its models); whether it was
    served. ``when`` as for :func:`serve_trainer`. The model's own patch stays (:func:`lce_patch.revert_fused_lce`
    removes it)."""
    row = find_row(trainer, when)
    serving = None if row is None else row.load()
    return False if serving is None else serving.unserve(trainer, row)
