"""The serving table (lce_patch/integrations/serving.py): every row's class with the installed TRL, the lookup, and
serve / unserve on one instance of each served class leaving it exactly as it was."""

from __future__ import annotations

import importlib
import sys
import types
import warnings
from pathlib import Path

import pytest

from lce_patch.integrations import serving
from lce_patch.integrations.serving import _HEAD, ROWS, SERVED, Row, find_row, without_fused_head
from lce_patch.integrations.trl import protocol

trl = pytest.importorskip("trl")

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _class_of(row: Row) -> type:
    """The row's class, imported; skipped (naming the reason) where its package is not installed."""
    try:
        module = importlib.import_module(row.module)
    except ImportError as error:
        pytest.skip(f"{row.module} cannot be imported here ({error}); the row is checked where it is installed")
    cls = getattr(module, row.name, None)
    assert isinstance(cls, type), f"{row.module} has no class {row.name}"
    return cls


def _bare(cls: type) -> object:
    """An instance of the trainer class without running its ``__init__`` (serving reads the class's methods)."""
    return object.__new__(cls)


def test_rows_are_unique_and_well_formed():
    assert len({row.key for row in ROWS}) == len(ROWS)
    for row in ROWS:
        assert row.when in ("init", "train", "plugin", None), row
        assert (row.serving is None) == (row.when is None), row
        assert row.how and row.tested, row


@pytest.mark.parametrize("row", ROWS, ids=lambda row: f"{row.module}.{row.name}")
def test_every_row_names_a_class_and_a_serving_module(row):
    cls = _class_of(row)
    assert cls.__module__ == row.module  # rows are matched by the defining module, not by an import path
    assert find_row(cls) is (row if row.serving != _HEAD or protocol.has_fused_lm_head() else without_fused_head(row))
    serving_module = row.load()
    if row.serving is None:
        assert serving_module is None
    else:
        assert callable(serving_module.serve) and callable(serving_module.unserve)


def test_the_most_derived_row_wins_and_subclasses_are_served_as_their_base():
    gkd = _class_of(next(row for row in ROWS if row.name == "GKDTrainer"))
    sft = _class_of(next(row for row in ROWS if row.name == "SFTTrainer"))
    assert issubclass(gkd, sft) and find_row(gkd).serving == "lce_patch.integrations.trl.gkd"
    custom = type("CustomGKD", (gkd,), {"__module__": "user_code"})
    assert find_row(custom) is find_row(gkd)
    assert find_row(type("Plain", (), {})) is None
    assert serving.base_class(custom, gkd.__module__, "GKDTrainer") is gkd
    assert serving.base_class(custom, "trl.trainer.sft_trainer", "SFTTrainer") is sft


def _module_functions() -> dict[str, object]:
    """TRL's module functions that serving replaces by a dispatcher while a trainer is served."""
    found = {}
    for module_name, name in (
        ("trl.trainer.distillation_trainer", "_chunked_divergence_loss"),
        ("trl.experimental.async_distillation.async_distillation_trainer", "_chunked_jsd_loss"),
    ):
        module = sys.modules.get(module_name)
        if module is not None:
            found[f"{module_name}.{name}"] = getattr(module, name)
    return found


_METHOD_ROWS = [row for row in ROWS if row.when == "init" and not row.serving.endswith(".unserved")]


@pytest.mark.parametrize("row", _METHOD_ROWS, ids=lambda row: row.name)
def test_serve_then_unserve_restores_the_trainer_exactly(row):
    trainer = _bare(_class_of(row))
    before, functions = dict(vars(trainer)), _module_functions()
    serving_module = row.load()
    assert serving_module.serve(trainer, {}) is True
    assert serving.serve_trainer(trainer, {}) is True  # through the table; already served: nothing more
    replaced = {name: value for name, value in vars(trainer).items() if before.get(name) is not value}
    assert replaced and all(getattr(value, SERVED, None) is not None for value in replaced.values())
    assert serving.unserve_trainer(trainer) is True
    assert vars(trainer) == before and all(vars(trainer)[name] is before[name] for name in before)
    assert serving_module.unserve(trainer) is False
    for name, function in functions.items():  # no dispatcher left unless another live trainer is served
        if getattr(function, SERVED, None) is None:
            assert _module_functions()[name] is function, name


@pytest.mark.parametrize("row", [row for row in ROWS if row.when == "train"], ids=lambda row: row.module)
@pytest.mark.skipif(not protocol.has_fused_lm_head(), reason="TRL's fused LM head needs TRL >= 1.15")
def test_trl_head_rows_serve_and_restore_the_fused_head(row):
    from trl.trainer.utils import add_fused_lm_head

    from lce_patch.integrations.trl.head import is_head_served
    from tests.integrations.trl_helpers import make_model

    trainer = _bare(_class_of(row))
    trainer.model, trainer.args = make_model(), types.SimpleNamespace(loss_type="nll")
    add_fused_lm_head(trainer.model, outputs=("log_probs",))
    trl_forward = trainer.model.forward
    assert serving.serve_trainer(trainer, {}) is True and is_head_served(trainer.model)
    assert serving.unserve_trainer(trainer) is True
    assert trainer.model.forward == trl_forward and not is_head_served(trainer.model)


def test_unserved_rows_warn_and_change_nothing():
    from lce_patch.integrations.trl import unserved

    for row in (row for row in ROWS if row.serving == unserved.__name__):
        trainer = _bare(type(row.name, (), {"__module__": row.module}))
        unserved._warned.discard(row.name)
        with pytest.warns(UserWarning, match=f"{row.name} computes its loss from the full"):
            assert serving.serve_trainer(trainer, {}) is False
        assert vars(trainer) == {} and serving.unserve_trainer(trainer) is False


def test_the_docs_trainer_table_is_generated_from_the_rows():
    sys.path.insert(0, str(DOCS / "hooks"))
    try:
        import serving_table
    finally:
        sys.path.remove(str(DOCS / "hooks"))
    assert serving_table.MARKER in (DOCS / "trainer-and-trl.md").read_text()
    table = serving_table.serving_table(ROWS)
    for row in ROWS:
        assert (f"`{row.name}`" in table) == row.module.startswith("trl."), row
    with warnings.catch_warnings():  # the hook loads serving.py from its file: the same rows
        warnings.simplefilter("error")
        assert serving_table.serving_table() == table
