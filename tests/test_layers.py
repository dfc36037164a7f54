"""The package's layers, read from its source: every import runs downward, through a package's front door, and no
private name crosses a module.

    ops/core  <-  ops/<op> (each op: core and its own folder only)  <-  ops  <-  models  <-  integrations  <-  lce_patch

``models`` reaches the ops only through ``lce_patch.ops``, ``lce_patch.ops.core`` or an op's package, and
``integrations`` reaches ``models`` and the ops only through their packages (never the root ``lce_patch``, which
imports them). Imports inside functions count as much as those at the top of a module. The tests hold a rule of
their own: no test module imports another (what they share lives in helper modules).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "lce_patch"
ROOT = "lce_patch"
OPS = f"{ROOT}.ops"
CORE = f"{OPS}.core"
MODELS = f"{ROOT}.models"
INTEGRATIONS = f"{ROOT}.integrations"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}
PACKAGES = {name for name, path in MODULES.items() if path.name == "__init__.py"}
OP_PACKAGES = sorted(name for name in PACKAGES if name.count(".") == 2 and name.startswith(f"{OPS}.") and name != CORE)


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    line: int
    target: str  # the module imported from (a submodule where ``from package import submodule``)
    names: tuple[str, ...]  # the names imported from ``target`` (empty for a whole module)
    bound: str | None = None  # the local name a whole module is bound to (``from . import kernels as _kernels``)


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(f"{package}.")


def _imports(module: str) -> list[Import]:
    path = MODULES[module]
    package = module if module in PACKAGES else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [
                Import(module, node.lineno, alias.name, (), alias.asname)
                for alias in node.names
                if _within(alias.name, ROOT)
            ]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not _within(target, ROOT):
                continue
            names = []
            for alias in node.names:
                if f"{target}.{alias.name}" in MODULES:  # `from package import submodule`
                    found.append(Import(module, node.lineno, f"{target}.{alias.name}", (), alias.asname or alias.name))
                else:
                    names.append(alias.name)
            if names:
                found.append(Import(module, node.lineno, target, tuple(names)))
    return found


IMPORTS = [imported for module in MODULES for imported in _imports(module)]


def _op_of(module: str) -> str | None:
    return next((op for op in OP_PACKAGES if _within(module, op)), None)


def _allowed(source: str, target: str) -> bool:
    """Whether ``source`` may import from ``target`` (both module names of this package)."""
    ops_front_doors = {OPS, CORE, *OP_PACKAGES}
    if _within(source, CORE):
        return _within(target, CORE)
    if (op := _op_of(source)) is not None:
        return _within(target, CORE) or _within(target, op)
    if source == OPS:
        return _within(target, OPS)
    if _within(source, MODELS):
        return _within(target, MODELS) or target in ops_front_doors
    if _within(source, INTEGRATIONS):
        return _within(target, INTEGRATIONS) or target in ops_front_doors | {MODELS}
    return source == ROOT  # the root may import any layer


def _where(imported: Import) -> str:
    return f"{MODULES[imported.source].relative_to(PACKAGE_DIR.parent)}:{imported.line}"


def test_the_layers_are_read_from_the_package():
    assert {CORE, *OP_PACKAGES, OPS, MODELS, INTEGRATIONS, ROOT} <= PACKAGES
    assert len(OP_PACKAGES) >= 3
    assert any(imported.target == f"{CORE}.backend" for imported in IMPORTS)  # relative imports resolved
    assert any(imported.bound for imported in IMPORTS)  # and submodules imported by name


@pytest.mark.parametrize("layer", [CORE, *OP_PACKAGES, OPS, MODELS, INTEGRATIONS])
def test_imports_run_downward_through_front_doors(layer):
    wrong = [
        f"{_where(imported)} imports {imported.target}"
        for imported in IMPORTS
        if _within(imported.source, layer)
        and (layer != OPS or imported.source == OPS)
        and not _allowed(imported.source, imported.target)
    ]
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_private_name_crosses_a_module():
    wrong = [
        f"{_where(imported)} imports {name} from {imported.target}"
        for imported in IMPORTS
        for name in imported.names
        if _private(name)
    ]
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        bound = {imported.bound for imported in IMPORTS if imported.source == module and imported.bound}
        wrong += [
            f"{path.relative_to(PACKAGE_DIR.parent)}:{node.lineno} reads {node.value.id}.{node.attr}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
            and _private(node.attr)
        ]
    assert not wrong, "private names used outside their module:\n" + "\n".join(wrong)


def test_no_test_module_imports_another():
    """What test modules share lives in helper modules (``tests/*/helpers.py`` and the like), so that importing one
    test module never collects another's tests or runs its module-level setup."""
    tests = Path(__file__).resolve().parent
    test_modules = {path.stem for path in tests.rglob("test_*.py")}
    wrong = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [*(node.module or "").split("."), *(alias.name for alias in node.names)]
            elif isinstance(node, ast.Import):
                names = [part for alias in node.names for part in alias.name.split(".")]
            if any(name in test_modules for name in names):
                wrong.append(f"{path.relative_to(tests.parent)}:{node.lineno}")
    assert not wrong, "test modules imported from elsewhere:\n" + "\n".join(wrong)
