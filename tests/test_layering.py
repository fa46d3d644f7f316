"""The package's floors are checked, not promised: no module imports from a floor above its own, no
module takes another module's private (``_x``) names, no two modules import each other (directly or round a
circle, ``TYPE_CHECKING`` imports included), and only core/collectives issues torch.distributed collectives.
Parses source; no processes."""
import ast
import pathlib
from typing import List

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "tplayers"
FLOORS = ["core", "regions", "layers", "models", "convert", "io", "testing", "bench", "cli"]  # bottom to top (docs/architecture.md)
LEAVES = {"_version"}  # modules with no tplayers imports that any floor may use
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
               "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "barrier", "monitored_barrier", "send",
               "recv", "isend", "irecv", "batch_isend_irecv", "all_to_all", "all_to_all_single", "gather", "scatter",
               "all_gather_object", "broadcast_object_list", "reduce"}
COMM_MODULES = {"core/collectives.py", "core/fingerprint.py"}  # the collectives and their fingerprint check


def _imported_modules(path: pathlib.Path, root: pathlib.Path) -> List[str]:
    """Absolute dotted names of everything ``path`` imports (relative imports resolved)."""
    package = ["tplayers"] + list(path.relative_to(root).parent.parts)
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out += [module] if node.module else [f"{module}.{a.name}" for a in node.names]
    return out


def upward_imports(root: pathlib.Path) -> List[str]:
    """``"file: imports module (floor a above floor b)"`` for every import from a higher floor."""
    errors = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if len(rel.parts) < 2:  # the package root (tplayers/__init__.py re-exports every floor)
            continue
        own = FLOORS.index(rel.parts[0])
        for module in _imported_modules(path, root):
            parts = module.split(".")
            if parts[0] != "tplayers":
                continue
            target = parts[1] if len(parts) > 1 else "tplayers"
            if target in LEAVES:
                continue
            if target not in FLOORS:
                errors.append(f"{rel}: imports {module} (the package root, above every floor)")
            elif FLOORS.index(target) > own:
                errors.append(f"{rel}: imports {module} (floor '{target}' is above '{rel.parts[0]}')")
    return errors


def private_imports_across_modules(root: pathlib.Path) -> List[str]:
    """``"file: from module import _name"`` for each private name one module imports from another
    (within a floor too: what a module shares is public, under a name that says what it is)."""
    errors = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        package = ["tplayers"] + list(rel.parent.parts)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = package[: len(package) - node.level + 1] if node.level else []
            parts = (base + ([node.module] if node.module else [])) if node.level else (node.module or "").split(".")
            if parts[0] != "tplayers":
                continue
            errors += [f"{rel}: from {'.'.join(parts)} import {a.name}" for a in node.names
                       if a.name.startswith("_") and not a.name.startswith("__")]
    return errors


def collectives_outside_comm(root: pathlib.Path) -> List[str]:
    """``"file:line dist.op"`` for each torch.distributed collective called outside core/collectives."""
    errors = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in COMM_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES
                    and ast.unparse(node.func.value) in ("dist", "torch.distributed")):
                errors.append(f"{rel}:{node.lineno} {ast.unparse(node.func)}")
    return errors


def import_cycles(root: pathlib.Path) -> List[str]:
    """Every circle of module imports (``a -> b -> a``), packages' ``__init__`` left out (a package re-exports
    its modules), ``TYPE_CHECKING`` imports counted: the one ordering of modules a reader can follow."""
    names = {}
    for path in root.rglob("*.py"):
        if path.name != "__init__.py":
            names[".".join(["tplayers", *path.relative_to(root).with_suffix("").parts])] = path
    graph = {m: set() for m in names}
    for m, path in names.items():
        for imported in _imported_modules(path, root):
            target = imported if imported in names else imported.rpartition(".")[0]
            if target in names and target != m:
                graph[m].add(target)
    cycles, state = set(), {}

    def visit(m: str, trail: List[str]) -> None:  # depth first; a module on the trail closes a circle
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                circle = trail[trail.index(n):]
                start = circle.index(min(circle))
                cycles.add(" -> ".join(circle[start:] + circle[:start] + [min(circle)]))
            elif n not in state:
                visit(n, trail + [n])
        state[m] = "done"
    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return sorted(cycles)


def _planted(tmp_path: pathlib.Path, target: str, addition: str) -> pathlib.Path:
    """A copy of the package with ``addition`` appended to module ``target``: a deliberate violation to show a
    check can fail."""
    import shutil

    copy = tmp_path / "tplayers"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    module = copy / target
    module.write_text(module.read_text() + addition)
    return copy


def test_every_package_folder_is_a_floor():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(FLOORS)


def test_no_floor_imports_from_above():
    assert upward_imports(PACKAGE) == []


def test_no_private_names_cross_modules():
    assert private_imports_across_modules(PACKAGE) == []


def test_collectives_are_issued_only_from_core_comm():
    assert collectives_outside_comm(PACKAGE) == []


@pytest.mark.parametrize("line, expected", [
    ("from ..io.checkpoint import save_checkpoint\n", "floor 'io' is above 'layers'"),
    ("import tplayers.cli\n", "floor 'cli' is above 'layers'"),
    ("from .. import parallelize\n", "the package root"),
])
def test_the_floor_check_catches_an_upward_import(tmp_path, line, expected):
    """The check can fail: a copy of the package with one deliberate upward import is refused."""
    errors = upward_imports(_planted(tmp_path, "layers/linear.py", line))
    assert len(errors) == 1 and errors[0].startswith("layers/linear.py") and expected in errors[0], errors


@pytest.mark.parametrize("target, line", [
    ("core/functional.py", "from .collectives import _launch\n"),  # within a floor
    ("layers/linear.py", "from ..core.wgrad import _flat\n"),  # across floors
])
def test_the_private_name_check_catches_a_private_import(tmp_path, target, line):
    copy = _planted(tmp_path, target, line)
    absolute = line.strip().replace("from ..core.", "from tplayers.core.").replace("from .", "from tplayers.core.")
    found = private_imports_across_modules(copy)
    assert f"{target}: {absolute}" in found and len(found) == len(private_imports_across_modules(PACKAGE)) + 1, found


def test_the_collective_check_catches_a_stray_collective(tmp_path):
    copy = _planted(tmp_path, "layers/vocab.py", "\ndist.all_reduce(x)\n")
    assert [e.split(" ")[1] for e in collectives_outside_comm(copy)] == ["dist.all_reduce"]


def test_no_module_imports_round_a_circle():
    assert import_cycles(PACKAGE) == []


def test_the_cycle_check_catches_a_circle(tmp_path):
    copy = _planted(tmp_path, "bench/config.py", "\nif TYPE_CHECKING:\n    from .overlap import Mode\n")
    assert "tplayers.bench.config -> tplayers.bench.overlap -> tplayers.bench.config" in import_cycles(copy)


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 70  # (a function's docstring not counted: it is its reference)


def oversized(root: pathlib.Path) -> List[str]:
    """``"file: N lines"`` for every module over MAX_MODULE_LINES, ``"file: name() N lines"`` for every function
    whose body (its docstring left out) is over MAX_FUNCTION_LINES."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel, text = path.relative_to(root), path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            found.append(f"{rel}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body[1:] if ast.get_docstring(node) is not None and len(node.body) > 1 else node.body
                lines = node.end_lineno - body[0].lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{rel}: {node.name}() {lines} lines")
    return found


def test_no_module_or_function_is_too_long_to_read_in_one_sitting():
    assert oversized(PACKAGE) == []


def test_the_size_check_catches_a_long_module_and_function(tmp_path):
    found = oversized(_planted(tmp_path, "models/rng.py", "\n\ndef long():\n    \"\"\"doc\"\"\"\n" + "    x = 1\n" * 400))
    assert len(found) == 2 and found[0].startswith("models/rng.py: ") and found[1] == "models/rng.py: long() 400 lines"
