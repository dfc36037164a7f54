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


_METHOD_ROWS = [row for row in ROWS if row.when == "init" and row.served]


@pytest.mark.parametrize("row", _METHOD_ROWS, ids=lambda row: row.name)
def test_serve_then_unserve_restores_the_trainer_exactly(row):
    trainer = _bare(_class_of(row))
    before, functions = dict(vars(trainer)), _module_functions()
    serving_module = row.load()
    assert serving_module.serve(trainer, row, {}) is True
    assert serving.serve_trainer(trainer, {}) is True  # through the table; already served: nothing more
    replaced = {name: value for name, value in vars(trainer).items() if before.get(name) is not value}
    assert replaced and all(getattr(value, SERVED, None) is not None for value in replaced.values())
    assert serving.unserve_trainer(trainer) is True
    assert vars(trainer) == before and all(vars(trainer)[name] is before[name] for name in before)
    assert serving_module.unserve(trainer, row) is False
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


def test_rows_say_the_ops_they_run_and_whether_they_are_served():
    for row in ROWS:
        assert row.served == bool(row.ops) and all(op.startswith("fused_linear_") for op in row.ops), row
        assert row.served == (row.serving is not None and not row.serving.endswith(".unserved")), row
        if row.when != "train":  # the docs' cell names the ops (the fused-head rows say TRL's head)
            assert all(f"`{op}`" in row.how for op in row.ops), row
    assert not without_fused_head(ROWS[0]).served and without_fused_head(ROWS[0]).when == "init"
    assert next(row for row in ROWS if row.name == "TPOTrainer").route == "its loss runs fused_linear_log_probs"
    assert ROWS[0].route == "TRL's fused LM head runs fused_linear_log_probs"


class _Recorder(types.ModuleType):
    """A serving module that records what the one dispatcher hands it."""

    def __init__(self) -> None:
        super().__init__("recorder")
        self.calls: list[tuple] = []

    def serve(self, trainer, row, options):
        self.calls.append(("serve", trainer, row, options))
        return row.served

    def unserve(self, trainer, row):
        self.calls.append(("unserve", trainer, row))
        return row.served


@pytest.fixture
def recorder(monkeypatch) -> _Recorder:
    """Every row's serving module replaced by one recorder."""
    module = _Recorder()
    monkeypatch.setattr(Row, "load", lambda row: None if row.serving is None else module)
    return module


def _instance_of(row: Row) -> object:
    """An instance of a class standing for the row's (same module and name: nothing is imported)."""
    return type(row.name, (), {"__module__": row.module})()


@pytest.mark.parametrize("row", [row for row in ROWS if row.serving is not None], ids=lambda row: row.module)
def test_every_row_is_served_through_the_one_function_at_its_moment(row, recorder):
    trainer = _instance_of(row)
    expected = find_row(trainer)
    # (on a TRL without the fused-head protocol a head row comes back as TRL's own path: not served)
    assert serving.serve_trainer(trainer, {"chunk_size": 8}, when=expected.when) is expected.served
    assert recorder.calls == [("serve", trainer, expected, {"chunk_size": 8})]  # handed its row
    for moment in {"init", "train", "plugin"} - {expected.when}:
        recorder.calls.clear()
        # at "train", a trainer with no row then is offered TRL's fused head, served where its model carries one
        other = serving.ANY_FUSED_HEAD if moment == "train" and protocol.has_fused_lm_head() else None
        assert serving.serve_trainer(trainer, {}, when=moment) is (other is not None), moment
        assert recorder.calls == ([] if other is None else [("serve", trainer, other, {})]), moment
    recorder.calls.clear()
    assert serving.unserve_trainer(trainer) is expected.served and recorder.calls == [("unserve", trainer, expected)]


def test_a_row_not_served_leaves_the_trainer_as_it_was():
    for row in ROWS:
        if row.served:
            continue
        trainer = _instance_of(row)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the unserved rows' warning (tested above)
            for moment in ("init", "train", "plugin", None):
                assert serving.serve_trainer(trainer, {}, when=moment) is False, (row, moment)
        assert vars(trainer) == {} and serving.unserve_trainer(trainer) is False


@pytest.mark.skipif(not protocol.has_fused_lm_head(), reason="TRL's fused LM head needs TRL >= 1.15")
def test_a_class_built_on_a_fused_head_trainer_has_its_loss_and_the_head_served(recorder):
    gkd = next(row for row in ROWS if row.name == "GKDTrainer")
    sft = next(row for row in ROWS if row.name == "SFTTrainer")
    sft_class = type(sft.name, (), {"__module__": sft.module})
    trainer = type(gkd.name, (sft_class,), {"__module__": gkd.module})()
    assert serving.serve_trainer(trainer, {}, when="init") and recorder.calls[-1][2] is gkd
    assert serving.serve_trainer(trainer, {}, when="train") and recorder.calls[-1][2] is sft


@pytest.mark.skipif(not protocol.has_fused_lm_head(), reason="TRL's fused LM head needs TRL >= 1.15")
def test_the_head_rows_prepare_the_reference_precompute_at_init(monkeypatch):
    from lce_patch.integrations.trl import head

    dpo = next(row for row in ROWS if row.name == "DPOTrainer")
    served = []
    monkeypatch.setattr(head, "install_heads", lambda *args: served.append(args) or True)

    class Trainer(type(dpo.name, (), {"__module__": dpo.module})):
        def _precompute_ref_logps(self, dataset, name, batch_size):
            return (dataset, len(served))

    trainer = Trainer()
    trainer.model, trainer.ref_model = object(), object()
    assert serving.serve_trainer(trainer, {"chunk_size": 8}, when="init") is False  # nothing served at init
    assert getattr(vars(trainer)["_precompute_ref_logps"], SERVED) is not None and served == []
    assert trainer._precompute_ref_logps("data", "train", 2) == ("data", 1)  # the heads served first
    assert served == [(trainer.model, trainer.ref_model, {"chunk_size": 8}, False)]
    serving.serve_trainer(trainer, {}, when="init")  # once
    assert trainer._precompute_ref_logps("data", "train", 2) == ("data", 2)
    assert serving.unserve_trainer(trainer) is True and "_precompute_ref_logps" not in vars(trainer)


def test_the_callbacks_head_hook_asks_the_table(recorder):
    from lce_patch import FusedLCECallback

    callback = FusedLCECallback(chunk_size=8)
    for row in ROWS:
        recorder.calls.clear()
        trainer = _instance_of(row)
        served = callback.install_trainer_heads(object(), None, trainer)
        expected = find_row(trainer, "train")
        assert served is (expected is not None)
        assert recorder.calls == ([] if expected is None else [("serve", trainer, expected, {"chunk_size": 8})])
    recorder.calls.clear()
    program_trainer = object()  # no row: offered TRL's fused head, as any trainer whose model carries one
    served = callback.install_trainer_heads(object(), None, program_trainer)
    if protocol.has_fused_lm_head():
        assert served and recorder.calls == [("serve", program_trainer, serving.ANY_FUSED_HEAD, {"chunk_size": 8})]
    else:
        assert served is False and recorder.calls == []


@pytest.mark.skipif(not protocol.has_fused_lm_head(), reason="TRL's fused LM head needs TRL >= 1.15")
def test_a_trainer_no_row_names_has_the_fused_head_its_model_carries_served():
    from trl.trainer.utils import add_fused_lm_head

    from lce_patch.integrations.trl.head import is_head_served
    from tests.integrations.trl_helpers import make_model

    program_trainer = type("ProgramTrainer", (), {"__module__": "a_program"})()
    assert find_row(program_trainer) is None and find_row(program_trainer, "train") is serving.ANY_FUSED_HEAD
    program_trainer.model, program_trainer.args = make_model(), types.SimpleNamespace(loss_type="nll")
    assert serving.serve_trainer(program_trainer, {}, when="train") is False  # no head on its model: nothing done
    add_fused_lm_head(program_trainer.model, outputs=("log_probs",))
    trl_forward = program_trainer.model.forward
    assert serving.serve_trainer(program_trainer, {}, when="train") is True and is_head_served(program_trainer.model)
    assert serving.unserve_trainer(program_trainer, when="train") is True
    assert program_trainer.model.forward == trl_forward and not is_head_served(program_trainer.model)
    assert all(row is not serving.ANY_FUSED_HEAD for row in ROWS)  # not a row of the docs' table


@pytest.fixture
def axolotl_plugin(monkeypatch):
    """lce_patch's axolotl plugin, imported over stand-ins for the two axolotl modules it imports."""
    import logging

    base = types.ModuleType("axolotl.integrations.base")
    base.BasePlugin = type("BasePlugin", (), {})
    log = types.ModuleType("axolotl.utils.logging")
    log.get_logger = logging.getLogger
    for name, module in {
        "axolotl": types.ModuleType("axolotl"),
        "axolotl.integrations": types.ModuleType("axolotl.integrations"),
        "axolotl.integrations.base": base,
        "axolotl.utils": types.ModuleType("axolotl.utils"),
        "axolotl.utils.logging": log,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    pytest.importorskip("pydantic")
    name = "lce_patch.integrations.axolotl.plugin"
    sys.modules.pop(name, None)
    yield importlib.import_module(name)
    sys.modules.pop(name, None)  # imported over the stand-ins: not kept
    vars(importlib.import_module("lce_patch.integrations.axolotl")).pop("plugin", None)


def test_the_axolotl_plugin_asks_the_table(axolotl_plugin, recorder, caplog):
    plugin = axolotl_plugin.LCEPatchPlugin()
    kd = next(row for row in ROWS if row.when == "plugin")
    trainer = _instance_of(kd)
    with caplog.at_level("INFO", logger="axolotl.integrations.lce_patch"):
        plugin.post_trainer_create({"lce_patch": True, "lce_patch_chunk_size": 8}, trainer)
    assert recorder.calls == [("serve", trainer, kd, {"chunk_size": 8})]
    assert "lce_patch: axolotl's KD loss runs through fused_linear_sparse_divergence" in caplog.text
    recorder.calls.clear()
    plugin.post_trainer_create({"lce_patch": False}, trainer)  # off: not served
    other = _instance_of(next(row for row in ROWS if row.name == "TPOTrainer"))
    plugin.post_trainer_create({"lce_patch": True}, other)  # served by the callback, not by the plugin
    assert recorder.calls == []


def test_the_axolotl_plugin_logs_its_rows_warnings_on_axolotls_log(axolotl_plugin, monkeypatch, caplog):
    kd = next(row for row in ROWS if row.when == "plugin")

    def serve(trainer, row, options):
        warnings.warn("lce_patch: a warning of the serving module", stacklevel=2)
        return False

    monkeypatch.setattr(Row, "load", lambda row: types.SimpleNamespace(serve=serve))
    with caplog.at_level("WARNING", logger="axolotl.integrations.lce_patch"), warnings.catch_warnings():
        warnings.simplefilter("error")
        axolotl_plugin.LCEPatchPlugin().post_trainer_create({"lce_patch": True}, _instance_of(kd))
    assert "lce_patch: a warning of the serving module" in caplog.text


def test_axolotls_kd_row_serves_through_the_table():
    """axolotl's KD trainer, stood in for (the real one runs in test_axolotl_kd.py, in axolotl's environment)."""
    import torch

    from lce_patch.integrations.axolotl import kd

    row = next(row for row in ROWS if row.when == "plugin")

    def forward(self, lm_head_weight, student_hidden_states, target_token_ids, target_logprobs, target_mask,
                true_labels, student_bias=None):  # fmt: skip
        raise AssertionError("not called")

    settings = dict(weight_hard_loss=1.0, weight_soft_loss=1.0, temperature=1.0, beta=0.0, ignore_index=-100)
    settings.update(compute_ce_loss=True, normalize_topk=True, forward=forward)
    loss_class = type(
        "LigerFusedLinearKLTopKLogprobLoss",
        (torch.nn.Module,),
        {"__module__": "axolotl.integrations.kd.kernels.liger", **settings},
    )

    def compute_loss(self, model, inputs):
        return self._kd_loss_fn(inputs)

    trainer = type(row.name, (), {"__module__": row.module, "compute_loss": compute_loss})()
    original = trainer._kd_loss_fn = loss_class()
    assert serving.serve_trainer(trainer, {"chunk_size": 8, "z_loss": 0.0}, when="plugin") is True
    assert isinstance(trainer._kd_loss_fn, kd.FusedKDLoss) and trainer._kd_loss_fn.options == {"chunk_size": 8}
    assert serving.serve_trainer(trainer, {}, when="plugin") is True  # already served
    assert serving.unserve_trainer(trainer) is True and trainer._kd_loss_fn is original
    trainer._kd_loss_fn = torch.nn.Identity()
    with pytest.raises(kd.AxolotlKDProtocolError, match=f"its _kd_loss_fn is Identity.*axolotl 0.19's {row.name}"):
        serving.serve_trainer(trainer, {}, when="plugin")
