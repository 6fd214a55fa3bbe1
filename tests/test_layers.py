"""The folder tree is the architecture: each layer imports only the layers below it, and no
module imports itself back through others.

Read from the source (every ``import``, including those under ``TYPE_CHECKING`` and inside
functions), so a cycle hidden from the interpreter still counts. The packages beside the
library are held to the same: ``ddp/`` (imported as ``ringcomm_ddp``) uses only ringcomm's
public front, ``bench/`` (imported as ``ringcomm_bench``) may use anything, nothing uses
``bench/``, and neither has an import cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest

import ringcomm
import ringcomm_bench
import ringcomm_ddp

PACKAGE = Path(ringcomm.__file__).parent
BASE = "base"  # ringcomm.errors, ringcomm._support, ringcomm._version: usable everywhere
FRONT = "front"  # the package itself, the CLI, the tuner, the torch entry point: use anything

# each layer -> the layers it may import (besides itself)
ALLOWED = {
    BASE: set(),
    "core": {BASE},
    # test doubles of outside libraries (the fake device runtime, a fake of CuPy's NCCL),
    # beside the core they stand in for; the runtime layer loads them for device="fake"
    "testing": {BASE, "core"},
    "schedules": {BASE, "core"},
    "transport": {BASE, "core"},
    "engines": {BASE, "core", "schedules", "transport"},
    "observe": {BASE, "core", "schedules", "transport", "engines"},
    "faults": {BASE, "core", "schedules", "transport", "engines"},
    "plan": {BASE, "core", "schedules", "transport"},
    "runtime": {BASE, "core", "testing", "schedules", "transport", "engines", "observe",
                "faults", "plan"},
    "bootstrap": {BASE, "core", "testing", "schedules", "transport", "engines", "observe",
                  "faults", "plan", "runtime"},
    "torch_backend": {BASE, "core", "testing", "schedules", "transport", "engines", "observe",
                      "faults", "plan", "runtime", "bootstrap"},
    # the teaching views run collectives on an in-process group and draw them
    "teach": {BASE, "core", "testing", "schedules", "transport", "engines", "observe",
              "faults", "plan", "runtime"},
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


def imported(path: Path, me: str, tops: set[str], is_module: Callable[[str], bool]) -> set[str]:
    """The modules of the packages ``tops`` that ``path`` (module ``me``) imports, wherever
    the import sits (a name imported from a package counts as the submodule when
    ``is_module`` says there is one)."""
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] in tops}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] not in tops:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if is_module(sub) else target)
    return found - {me}


def imports(path: Path) -> set[str]:
    """The ringcomm modules ``path`` imports."""
    def is_module(name: str) -> bool:
        where = PACKAGE.parent / name.replace(".", "/")
        return (where.with_suffix(".py").exists() or where.is_dir()
                or where.with_suffix(".pyi").exists())  # a module compiled from C: its stub

    return imported(path, module_name(path), {"ringcomm"}, is_module)


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


# --------------------------------------------------------------------------- ddp/ and bench/

# every package of the tree, by the name it is imported as, and its folder (bench/ installs
# as ringcomm_bench, ddp/ as ringcomm_ddp)
DDP, BENCH = "ringcomm_ddp", "ringcomm_bench"
PACKAGES = {"ringcomm": PACKAGE, DDP: Path(ringcomm_ddp.__file__).parent,
            BENCH: Path(ringcomm_bench.__file__).parent}

# Ways into bench/ from outside it: none. ``ringcomm bench`` finds the harness's command
# line through the ``ringcomm.commands`` entry points, not an import. An exception listed
# here must still be used (the test below fails once it is gone).
INTO_BENCH: set[tuple[str, str]] = set()


def _files() -> dict[str, Path]:
    files = {}
    for top, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [top, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


FILES = _files()
GRAPH = {m: imported(path, m, set(PACKAGES), FILES.__contains__) for m, path in FILES.items()}
OUTSIDE = sorted(m for m in GRAPH if m.split(".")[0] in (DDP, BENCH))


def test_the_packages_beside_the_library_are_read() -> None:
    assert {"ringcomm_ddp.module", "ringcomm_ddp.join", "ringcomm_bench.sweep",
            "ringcomm_bench.backends"} <= set(OUTSIDE)
    assert "ringcomm_ddp" in GRAPH["ringcomm_bench.ddp_step"]  # imported inside a function
    assert "ringcomm_bench.sweep" in GRAPH["ringcomm_bench.cli"]  # imported inside main()


@pytest.mark.parametrize("module", [m for m in OUTSIDE if m.split(".")[0] == DDP])
def test_ddp_uses_only_ringcomms_front(module: str) -> None:
    """ddp/ is a user of the library like any other: its internals may change under it."""
    wrong = sorted(t for t in GRAPH[module] if t.split(".")[0] != DDP and t != "ringcomm")
    assert not wrong, f"{module} imports {wrong}: ddp/ may use the ringcomm package itself only"


def test_nothing_but_bench_imports_bench() -> None:
    """bench/ sits on top of ringcomm and ddp, and is installed only with its extra."""
    wrong = sorted((m, t) for m, targets in GRAPH.items() if not m.startswith(BENCH)
                   for t in targets if t.split(".")[0] == BENCH and (m, t) not in INTO_BENCH)
    assert not wrong, f"imports of bench/ from outside it: {wrong}"


def test_the_way_into_bench_is_still_there() -> None:
    """An exception no longer needed would let a new import in unseen."""
    gone = sorted(edge for edge in INTO_BENCH if edge[1] not in GRAPH.get(edge[0], ()))
    assert not gone, f"{gone} no longer import bench/: take them out of INTO_BENCH"


def _cycle_through(start: str) -> list[str] | None:
    """The shortest import cycle through ``start`` (it first and last), or None."""
    paths = {start: [start]}
    queue = [start]
    while queue:
        module = queue.pop(0)
        for target in sorted(GRAPH.get(module, ())):
            if target == start:
                return paths[module] + [start]
            if target in GRAPH and target not in paths:
                paths[target] = paths[module] + [target]
                queue.append(target)
    return None


@pytest.mark.parametrize("module", OUTSIDE)
def test_no_import_cycles_in_ddp_or_bench(module: str) -> None:
    """Through any package: a path from a module of ddp/ or bench/ back to itself, whatever
    it passes through, is a cycle."""
    cycle = _cycle_through(module)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
