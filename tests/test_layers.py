"""The folder tree is the architecture: each layer imports only the layers below it, and no
module imports itself back through others.

Read from the source (every ``import``, including those under ``TYPE_CHECKING`` and inside
functions), so a cycle hidden from the interpreter still counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ringcomm

PACKAGE = Path(ringcomm.__file__).parent
BASE = "base"  # ringcomm.errors, ringcomm._support, ringcomm._version: usable everywhere
FRONT = "front"  # the package itself, the CLI, the tuner, the torch entry point: use anything

# each layer -> the layers it may import (besides itself)
ALLOWED = {
    BASE: set(),
    "core": {BASE},
    "schedules": {BASE, "core"},
    "transport": {BASE, "core"},
    "engines": {BASE, "core", "schedules", "transport"},
    "observe": {BASE, "core", "schedules", "transport", "engines"},
    "plan": {BASE, "core", "schedules", "transport"},
    "runtime": {BASE, "core", "schedules", "transport", "engines", "observe", "plan"},
    "bootstrap": {BASE, "core", "schedules", "transport", "engines", "observe", "plan",
                  "runtime"},
    "torch_backend": {BASE, "core", "schedules", "transport", "engines", "observe", "plan",
                      "runtime", "bootstrap"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return FRONT
    if parts[1] == "torch_entry":  # the backend's light registrar, loaded by torch itself
        return "torch_backend"
    if parts[1] in ALLOWED:
        return parts[1]
    if parts[1] in ("errors", "_support", "_version"):
        return BASE
    return FRONT


def imports(path: Path) -> set[str]:
    """The ringcomm modules ``path`` imports (a name imported from a package counts as the
    submodule when there is one)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "ringcomm"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "ringcomm":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                is_module = (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").exists() \
                    or (PACKAGE.parent / sub.replace(".", "/")).is_dir()
                found.add(sub if is_module else target)
    return found - {me}


MODULES = {module_name(p): imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_belongs_to_a_layer() -> None:
    strays = [m for m in MODULES if layer(m) == FRONT and m.count(".") > 1]
    assert not strays, f"modules outside the layer folders: {strays}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer(m) != FRONT))
def test_a_layer_imports_only_the_layers_below_it(module: str) -> None:
    mine = layer(module)
    wrong = sorted(t for t in MODULES[module]
                   if layer(t) != mine and layer(t) not in ALLOWED[mine])
    assert not wrong, f"{module} ({mine}) imports {wrong}, which sit at or above its layer"


def test_no_import_cycles() -> None:
    graph = {m: {t for t in deps if t in MODULES} for m, deps in MODULES.items()
             if layer(m) != FRONT}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = path[path.index(module):] + [module]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            visit(target, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
